"""Every OS call the supervisor's parts make, in one façade: the seam that lets the pool,
holding and settlement be tested against a fake, without forking (supervisord's
``DummyOptions`` idea)."""
from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable
from datetime import UTC, datetime

import psutil

from ..pool.child import ProcessHandle
from ..pool.linux import SUPERVISOR_OOM_SCORE_ADJ, become_subreaper, lower_oom_score_adj
from ..pool.runtime import ChildRuntime
from ..pool.spawn import spawn
from .sentinel import Sentinel

RuntimeFactory = Callable[[int, int, int], ChildRuntime]


class System:
    """The real operating system."""

    def __init__(self) -> None:
        self._baseline_fds: set[int] = set()
        self.sentinel = Sentinel()

    #: The clock itself, not a method around it: read several times a task.
    monotonic = staticmethod(time.monotonic)

    #: A clock that, unlike ``monotonic``, goes on while the host is suspended: how long
    #: the loop was away (``Loop.away_for``) counts a suspend as a freeze.
    boottime = staticmethod(functools.partial(time.clock_gettime, time.CLOCK_BOOTTIME))

    def now(self) -> datetime:
        return datetime.now(UTC)

    def getpid(self) -> int:
        return os.getpid()

    def mark_fds(self) -> None:
        """Remember the fds open before the supervisor opened its own (sockets, pipes)."""
        self._baseline_fds = _open_fds()

    def guard_descendants(self) -> None:
        """At start-up, before any socket is open: adopt the orphans of what tasks start,
        leave the OOM killer to children, and start the sentinel (its own score low too)."""
        become_subreaper()
        lower_oom_score_adj(SUPERVISOR_OOM_SCORE_ADJ)
        self.sentinel.start()

    def spawn(self, number: int, make_runtime: RuntimeFactory) -> ProcessHandle:
        """Fork child ``number``; it closes the supervisor's private fds, and the sentinel
        kills its group should the supervisor die."""
        private = sorted(set(_private_fds(self._baseline_fds)) | set(self.sentinel.fds()))
        handle = spawn(number, make_runtime, private)
        self.sentinel.watch(handle.pid)
        return handle

    def exited(self) -> tuple[int, int] | None:
        """A child of the supervisor (one of the pool's, or adopted) that has exited, as
        (pid, exit status; negative: killed by that signal), left unreaped: its zombie
        keeps its pid and process group from being reused until ``reap``."""
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return None
        if info is None:
            return None
        if info.si_code == os.CLD_EXITED:
            return info.si_pid, info.si_status
        return info.si_pid, -info.si_status        # CLD_KILLED, CLD_DUMPED

    def reap(self, pid: int) -> None:
        """Collect an exited child ``exited`` reported."""
        self.sentinel.forget(pid)       # before the number is free for reuse
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        if pid == self.sentinel.pid:
            self.sentinel.exited()

    def close(self) -> None:
        """The supervisor is done: let the sentinel go."""
        self.sentinel.close()

    def signal(self, pid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)

    def rss(self, pid: int) -> int | None:
        """Resident memory of process ``pid`` in bytes; None if it is gone."""
        try:
            return int(psutil.Process(pid).memory_info().rss)
        except psutil.Error:
            return None


def _open_fds() -> set[int]:
    """The fds open now. Listing /proc/self/fd opens one of its own, closed again by the
    time the listing returns: leave it out, or a number it used, given later to the
    supervisor's selector, would count as inherited and stay open in children."""
    listed = [int(name) for name in os.listdir("/proc/self/fd")]
    return {fd for fd in listed if _is_open(fd)}


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _private_fds(baseline: set[int]) -> list[int]:
    """The sockets, pipes and event fds the supervisor opened since it started: a child
    must not keep them. Regular files (SQLite databases) are left to workhorse.forksafe."""
    private = []
    for fd in sorted(_open_fds() - baseline):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(("socket:", "pipe:", "anon_inode:")):
            private.append(fd)
    return private
