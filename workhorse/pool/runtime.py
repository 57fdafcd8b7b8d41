"""The child process: read a job, run the task, store its result, report the outcome.

A child runs one task at a time and holds nothing else: the prefetch buffer lives in the
supervisor. It exits when the supervisor says so, when its pipe closes, or — through
PR_SET_PDEATHSIG — at once when the supervisor dies, so no orphan keeps running tasks.

A task may fork. The copy shares the child's memory and pipes, so if it returned into this
module it would store the task's result a second time, report a second Done, and then
read jobs meant for the child. It does not get that far: the pipes' descriptors are
pointed at /dev/null in any process forked here, and a process that is not the child
exits as soon as the task returns (or raises) in it.
"""
from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import sys
import traceback
from collections import deque
from types import TracebackType
from typing import TYPE_CHECKING

import setproctitle
from billiard.util import set_pdeathsig

from ..logs import reopen_logfile
from .execute import Finished, TaskExecution
from .heart import Heart
from .ipc import MAX_DETAIL, Done, FrameStream, Hello, Job, Stop, write_frame
from .limits import SOFT_LIMIT_SIGNAL, SoftLimit, signals_blocked

if TYPE_CHECKING:
    from ..app import App
    from .aio import AsyncSession

log = logging.getLogger("workhorse.child")

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")

#: Signals the supervisor handles; blocked across fork() so none lands between fork and
#: the child installing its own dispositions.
SUPERVISOR_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP,
                      signal.SIGUSR1, signal.SIGUSR2, signal.SIGTTIN, signal.SIGTTOU,
                      signal.SIGCHLD)


class ChildRuntime:
    """Everything a child does, from setup after fork to exit."""

    def __init__(self, app: App, index: int, read_fd: int, write_fd: int,
                 supervisor_pid: int, hostname: str, heart: Heart | None = None, *,
                 measure_memory: bool = True) -> None:
        self.app = app
        self.index = index
        self.read_fd = read_fd
        self.write_fd = write_fd
        self.supervisor_pid = supervisor_pid
        self.hostname = hostname
        self.soft_limit = SoftLimit()
        self.current = ""                    # the running task's label, for logs
        # Set in setup(), after fork: made here they would name the supervisor.
        self.pid = 0
        #: /proc/self/statm, kept open: the RSS is read after every task (one pread), where
        #: the supervisor compares it with max_memory_per_child (``measure_memory``).
        self._statm: int | None = None
        self.measure_memory = measure_memory
        self._frames: FrameStream | None = None
        #: Shared with the supervisor: the event loop's beats, and whose code runs on it.
        self.heart = heart or Heart()
        self._session: AsyncSession | None = None
        self._around_task = AroundTask(self)

    # -- setup
    def setup(self, close_fds: list[int]) -> None:
        """Fork hygiene: own group, die with the supervisor, own signals, no supervisor fds."""
        self.pid = os.getpid()
        try:
            if self.measure_memory:
                self._statm = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._statm = None          # no /proc: RSS reads as 0, memory is not checked
        self._frames = FrameStream(self.read_fd)
        os.register_at_fork(after_in_child=self._unplug_forked_copy)
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
        # A log file the supervisor opened again (SIGUSR2) is one of its own descriptors,
        # just sent to /dev/null: this child opens it anew.
        reopen_logfile()
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

    # -- processes the task forks
    def _unplug_forked_copy(self) -> None:
        """In a process os.fork()ed by a task: its copies of the child's pipes read and
        write /dev/null, so even a copy that outlives its task cannot send a frame or take a
        job. (A fork that bypasses os.fork, through libc, skips this: the supervisor then
        drops the copy's frames by their pid, or kills the child if they interleave.)"""
        devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        for fd in (self.read_fd, self.write_fd):
            with contextlib.suppress(OSError):
                os.dup2(devnull, fd)
        os.close(devnull)

    def running_task(self) -> AroundTask:
        """Around the task body: the soft limit is armed, and a process the task forked
        exits the moment the task returns or raises in it, before anything is stored,
        reported or called back; the child alone finishes the job."""
        return self._around_task

    def exit_forked_copy(self, exc: BaseException | None) -> None:
        """Exit the forked copy as a plain Python process would: 0 for a return, the
        SystemExit code, 1 for an exception; without cleanups that belong to the child."""
        code = 0 if exc is None else 1
        if isinstance(exc, SystemExit):
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        try:
            log.warning("pid %d, forked by task %s, came back from the task: it exits "
                        "(status %d) without storing a result or reporting to the "
                        "supervisor; child %d (pid %d) finishes the job", os.getpid(),
                        self.current, code, self.index, self.pid)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)

    # -- main loop
    def run(self) -> int:
        self.send(Hello(self.pid))
        frames = self._frames or FrameStream(self.read_fd)
        leftover: deque[object] = deque()
        while True:
            frame = leftover.popleft() if leftover else frames.read()
            if frame is None or isinstance(frame, Stop):
                return 0
            if isinstance(frame, Job):
                if frame.asynchronous:
                    leftover.extend(self.run_async(frame))
                else:
                    self.send(self.execute(frame))
                self.set_title("idle")

    def run_async(self, job: Job) -> deque[object]:
        """Run async jobs on an event loop until none is left; the frames that came
        meanwhile for after them are returned."""
        if self._session is None:
            from .aio import AsyncSession    # (asyncio is loaded only where it is used)
            self._session = AsyncSession(self, self.heart)
        return self._session.run(job)

    def pending_frames(self) -> list[object]:
        """Whole frames read already and not yet handled."""
        assert self._frames is not None
        return self._frames.pending()

    def read_available(self) -> list[object] | None:
        """The frames the pipe has now (its fd is non-blocking); None: the supervisor is
        gone."""
        assert self._frames is not None
        return self._frames.read_available()

    def send(self, frame: object) -> None:
        """A soft-limit signal must never cut a frame short: while the limit is armed (its
        handler raises) the signal is blocked across the write. Unarmed, as it is for the
        result of every task, the handler does nothing, and the write goes on where the
        signal found it: two system calls a task fewer."""
        if self.soft_limit.armed:
            with signals_blocked(SOFT_LIMIT_SIGNAL):
                write_frame(self.write_fd, frame)
        else:
            write_frame(self.write_fd, frame)

    # -- one task
    def execute(self, job: Job) -> Done:
        execution = TaskExecution(self.app, job, self.hostname, self.running_task, self.send)
        self.current = f"{job.task}[{job.headers.get('id')}]"
        self.set_title(f"running {self.current}")
        return self.done(job, execution.run())

    def done(self, job: Job, finished: Finished) -> Done:
        """The frame that reports ``finished``."""
        detail = None if finished.detail is None else finished.detail[:MAX_DETAIL]
        return Done(self.pid, job.seq, finished.outcome.value, detail, self.rss(),
                    finished.runtime, finished.result and finished.result[:MAX_DETAIL],
                    finished.traceback and finished.traceback[:MAX_DETAIL])

    def rss(self) -> int:
        """This child's resident set size in bytes (0 if it cannot be read, or is not
        measured: no max_memory_per_child to compare it with)."""
        if self._statm is None:
            return 0
        try:
            return int(os.pread(self._statm, 64, 0).split()[1]) * PAGE_SIZE
        except (OSError, ValueError, IndexError):
            return 0


class AroundTask:
    """``ChildRuntime.running_task``: one object for every task, a class rather than a
    generator (entered and left once a task)."""

    __slots__ = ("runtime",)

    def __init__(self, runtime: ChildRuntime) -> None:
        self.runtime = runtime

    def __enter__(self) -> None:
        self.runtime.soft_limit.armed = True

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        runtime = self.runtime
        runtime.soft_limit.armed = False
        if os.getpid() != runtime.pid:
            runtime.exit_forked_copy(exc)


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
