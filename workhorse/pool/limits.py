"""Time limits, child side (the soft limit's handler) and supervisor side (the tree and
group kills)."""
from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from types import FrameType

import psutil

from ..exceptions import SoftTimeLimitExceeded

SOFT_LIMIT_SIGNAL = signal.SIGUSR1


def effective_limit(*candidates: float | None) -> float | None:
    """The first limit that is set, in precedence order: message header (which carries the
    call's ``apply_async`` options) > task decorator > configuration."""
    for candidate in candidates:
        if candidate is not None:
            return candidate
    return None


class SoftLimit:
    """Raises SoftTimeLimitExceeded in task code, and only there.

    The handler is installed for the child's life but does nothing unless ``armed``; it
    is armed only around the task body (``ChildRuntime.running_task``), so a SIGUSR1 that
    arrives while the child reads a job or writes a result is ignored.
    """

    def __init__(self) -> None:
        self.armed = False

    def install(self) -> None:
        signal.signal(SOFT_LIMIT_SIGNAL, self._handler)

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.armed:
            self.armed = False
            raise SoftTimeLimitExceeded()


@contextlib.contextmanager
def signals_blocked(*signals: int) -> Iterator[None]:
    """Defer ``signals`` (they stay pending) for the duration, e.g. while writing a frame."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> list[int]:
    """Send ``sig`` to ``pid`` and every process it started; return the pids signalled.

    Descendants are found through /proc (psutil) before the child is killed, so ones that
    left its process group (setsid) are caught too; the child's own group catches any
    started between the listing and the kill.
    """
    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    victims = [pid]
    for target in [pid, *(p.pid for p in descendants)]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(target, sig)
            if target != pid:
                victims.append(target)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
    return victims


def kill_group(pgid: int) -> None:
    """SIGKILL what is left in process group ``pgid``. Call it while its leader is an
    unreaped zombie: the zombie pins the number, so it cannot be another group's."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
