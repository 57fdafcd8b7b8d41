"""The child process: read a job, run the task, store its result, report the outcome.

A child runs one task at a time and holds nothing else: the prefetch buffer lives in the
supervisor. It exits when the supervisor says so, when its pipe closes, or — through
PR_SET_PDEATHSIG — at once when the supervisor dies, so no orphan keeps running tasks.
"""
from __future__ import annotations

import logging
import os
import random
import signal
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any

import psutil
import setproctitle
from billiard.util import set_pdeathsig

from ..exceptions import MalformedMessage, NotRegistered, ResultEncodeError
from ..outcome import Outcome
from ..protocol import decode_body, parse_request
from ..task import Context
from .ipc import Done, Hello, Job, Stop, read_frame, write_frame
from .limits import SOFT_LIMIT_SIGNAL, SoftLimit, signals_blocked

if TYPE_CHECKING:
    from ..app import App

log = logging.getLogger("workhorse.child")

#: Signals the supervisor handles; blocked across fork() so none lands between fork and
#: the child installing its own dispositions.
SUPERVISOR_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP,
                      signal.SIGUSR1, signal.SIGUSR2, signal.SIGTTIN, signal.SIGTTOU,
                      signal.SIGCHLD)


class ChildRuntime:
    """Everything a child does, from setup after fork to exit."""

    def __init__(self, app: App, index: int, read_fd: int, write_fd: int,
                 supervisor_pid: int, hostname: str) -> None:
        self.app = app
        self.index = index
        self.read_fd = read_fd
        self.write_fd = write_fd
        self.supervisor_pid = supervisor_pid
        self.hostname = hostname
        self.soft_limit = SoftLimit()
        self.process = psutil.Process()

    # -- setup
    def setup(self, close_fds: list[int]) -> None:
        """Fork hygiene: own group, die with the supervisor, own signals, no supervisor fds."""
        os.setpgid(0, 0)
        set_pdeathsig(signal.SIGKILL)
        if os.getppid() != self.supervisor_pid:   # the supervisor died before prctl
            os._exit(0)
        # The supervisor's fds (broker sockets, its pipes to other children, its selector)
        # must not stay open here. dup2 of /dev/null rather than close: Python objects in
        # this copy of memory still own those numbers, and a number closed now could be
        # reused and then closed again by one of them when it is collected. SQLite files
        # are left alone: a sqlite3 connection must see its real file descriptor, and the
        # objects holding them are never closed in a child (workhorse.forksafe).
        devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        for fd in close_fds:
            if fd != devnull:
                try:
                    os.dup2(devnull, fd)
                except OSError:
                    pass
        os.close(devnull)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU):
            signal.signal(sig, signal.SIG_IGN)
        for sig in (signal.SIGTERM, signal.SIGQUIT, signal.SIGUSR2, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        self.soft_limit.install()
        random.seed()
        self.set_title("idle")
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SUPERVISOR_SIGNALS)

    def set_title(self, what: str) -> None:
        setproctitle.setproctitle(f"workhorse: child {self.index} {what}")

    # -- main loop
    def run(self) -> int:
        self.send(Hello(os.getpid()))
        while True:
            frame = read_frame(self.read_fd)
            if frame is None or isinstance(frame, Stop):
                return 0
            if isinstance(frame, Job):
                self.send(self.execute(frame))
                self.set_title("idle")

    def send(self, frame: object) -> None:
        # A soft-limit signal must never interrupt a half-written frame.
        with signals_blocked(SOFT_LIMIT_SIGNAL):
            write_frame(self.write_fd, frame)

    # -- one task
    def execute(self, job: Job) -> Done:
        request = parse_request(job.headers)  # the supervisor checked these already
        task = self.app.tasks.get(job.task)
        label = f"{job.task}[{request.id}]"
        self.set_title(f"running {label}")
        if task is None:   # the supervisor checks the registry first; never trust it blindly
            return Done(job.seq, Outcome.UNKNOWN_TASK, str(NotRegistered(job.task)))
        try:
            args, kwargs, _embed = decode_body(job.body, job.content_type, job.content_encoding)
        except MalformedMessage as exc:
            log.error("%s: malformed message, dead-lettered: %s", label, exc)
            return Done(job.seq, Outcome.MALFORMED, str(exc))
        context = Context(
            id=request.id, task=job.task, args=args, kwargs=kwargs, retries=request.retries,
            root_id=request.root_id, parent_id=request.parent_id, group=request.group,
            origin=request.origin, eta=request.eta, expires=request.expires,
            hostname=self.hostname, delivery_info=job.delivery_info, headers=job.headers,
            timelimit=(request.time_limit, request.soft_time_limit), called_directly=False)
        info: dict[str, Any] = {"task": job.task, "args": args, "kwargs": kwargs,
                                "hostname": self.hostname, "retries": request.retries,
                                "group": request.group, "parent_id": request.parent_id,
                                "delivery_info": job.delivery_info}
        backend = self.app.backend
        store = not (task.ignore_result or request.ignore_result)
        started = time.monotonic()
        task.push_request(context)
        try:
            if job.track_started and store:
                backend.mark_as_started(request.id, request=info)
            try:
                with self.soft_limit.armed_around_task():
                    retval = task.run(task, *args, **kwargs) if task.bind else task.run(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - a task's SystemExit is its failure too
                # A soft limit landing just as the task returned is counted against it.
                tb = traceback.format_exc()
                runtime = time.monotonic() - started
                log.error("Task %s raised %s in %.3fs: %r\n%s", label, type(exc).__name__,
                          runtime, exc, tb)
                if store:
                    self._store_failure(backend, request.id, exc, tb, info)
                return self._done(job, Outcome.FAILED, f"{type(exc).__name__}: {exc}")
            runtime = time.monotonic() - started
            if store:
                try:
                    backend.mark_as_done(request.id, retval, request=info)
                except ResultEncodeError as exc:
                    log.error("Task %s returned a value that cannot be stored: %s", label, exc)
                    self._store_failure(backend, request.id, exc, None, info)
                    return self._done(job, Outcome.FAILED, str(exc))
            log.info("Task %s succeeded in %.3fs: %.200r", label, runtime, retval)
            return self._done(job, Outcome.SUCCEEDED)
        except Exception as exc:  # noqa: BLE001 - the result store failed
            log.error("Task %s: result store error, the message goes back to the broker: %r",
                      label, exc)
            return self._done(job, Outcome.STORE_FAILED, repr(exc))
        finally:
            task.pop_request()

    def _store_failure(self, backend: Any, task_id: str, exc: BaseException, tb: str | None,
                       info: dict[str, Any]) -> None:
        try:
            backend.mark_as_failure(task_id, exc, tb, request=info)
        except ResultEncodeError:
            # The exception's own args would not encode: store a plain description instead.
            backend.mark_as_failure(task_id, ResultEncodeError(
                f"{type(exc).__name__}: {exc!r}"[:2000]), tb, request=info)

    def _done(self, job: Job, outcome: Outcome, detail: str | None = None) -> Done:
        try:
            rss = self.process.memory_info().rss
        except psutil.Error:
            rss = 0
        return Done(job.seq, outcome.value, detail, rss)


def child_main(runtime: ChildRuntime, close_fds: list[int]) -> None:
    """Entry point in the forked child; never returns."""
    code = 1
    try:
        runtime.setup(close_fds)
        code = runtime.run()
    except BaseException:  # noqa: BLE001 - report, then exit with a code the supervisor reads
        traceback.print_exc()
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
