"""Signals, turned into bytes on a wakeup pipe that the loop reads.

The handlers do nothing: ``signal.set_wakeup_fd`` writes the signal number to the pipe
from C, at once, so a loop blocked in ``select`` wakes immediately (a Python-level flag
would only be noticed when ``select`` returns on its own).
"""
from __future__ import annotations

import os
import signal
from collections.abc import Iterable
from types import FrameType


def _wake_only(signum: int, frame: FrameType | None) -> None:
    """Nothing to do: the wakeup fd already carries the signal number."""


class SignalPipe:
    def __init__(self, signals: Iterable[signal.Signals]) -> None:
        self.signals = tuple(signals)
        self.read_fd, self.write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._previous: dict[int, object] = {}
        self._previous_fd = -1

    def install(self) -> None:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, _wake_only)
        self._previous_fd = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)

    def drain(self) -> list[signal.Signals]:
        """The signals received since the last call, in arrival order."""
        received: list[signal.Signals] = []
        while True:
            try:
                data = os.read(self.read_fd, 512)
            except BlockingIOError:
                return received
            if not data:
                return received
            received.extend(signal.Signals(b) for b in data)

    def restore(self) -> None:
        signal.set_wakeup_fd(self._previous_fd)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    def fds(self) -> tuple[int, int]:
        return self.read_fd, self.write_fd

    def close(self) -> None:
        os.close(self.read_fd)
        os.close(self.write_fd)
