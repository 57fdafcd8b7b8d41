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
import traceback
from typing import TYPE_CHECKING

import psutil
import setproctitle
from billiard.util import set_pdeathsig

from .execute import TaskExecution
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
        execution = TaskExecution(self.app, job, self.hostname, self.soft_limit.armed_around_task,
                                  self.send)
        self.set_title(f"running {job.task}[{job.headers.get('id')}]")
        finished = execution.run()
        try:
            rss = self.process.memory_info().rss
        except psutil.Error:
            rss = 0
        return Done(job.seq, finished.outcome.value, finished.detail, rss)


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
