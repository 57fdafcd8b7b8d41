"""Reconnecting to a lost broker with back-off, from loop timers (never a sleep)."""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .loop import Loop

log = logging.getLogger("workhorse.supervisor")

#: Reconnecting backs off from this delay, doubling, up to the cap.
RECONNECT_BACKOFF_START = 0.5
RECONNECT_BACKOFF_MAX = 30.0


def backoff(attempts: int) -> float:
    """No attempt failed yet: at once; then from the start delay, doubling, to the cap."""
    if attempts <= 0:
        return 0.0
    return min(RECONNECT_BACKOFF_START * 2 ** (attempts - 1), RECONNECT_BACKOFF_MAX)


class Reconnect:
    """``connect`` raises while the broker is unreachable; ``wanted`` says whether the
    worker still wants a connection (not when stopping, nor when connected already)."""

    def __init__(self, loop: Loop, clock: Callable[[], float], connect: Callable[[], None],
                 wanted: Callable[[], bool], on_restored: Callable[[], None]) -> None:
        self.loop = loop
        self.clock = clock
        self.connect = connect
        self.wanted = wanted
        self.on_restored = on_restored
        self.attempts = 0          # since the connection was lost
        self.connected_at = 0.0    # monotonic time of the last (re)connect

    def connected(self) -> None:
        self.connected_at = self.clock()

    def lost(self) -> None:
        """A connection that lasted a while starts over; one lost again at once (an error
        that only shows after connecting) keeps backing off instead of spinning."""
        if self.clock() - self.connected_at > RECONNECT_BACKOFF_MAX:
            self.attempts = 0
        self.loop.call_later(backoff(self.attempts), self._attempt)

    def _attempt(self) -> None:
        if not self.wanted():
            return
        try:
            self.connect()
        except Exception as exc:  # noqa: BLE001 - unreachable still: try again later
            self.attempts += 1
            delay = backoff(self.attempts)
            log.warning("broker still unreachable (%r); next attempt in %.1f s", exc, delay)
            self.loop.call_later(delay, self._attempt)
            return
        self.connected()
        self.attempts += 1          # reset only once the connection has lasted a while
        self.on_restored()
