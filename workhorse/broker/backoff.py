"""Reconnecting to a lost broker with back-off (the broker thread's timers, never a sleep)."""
from __future__ import annotations

#: Reconnecting backs off from this delay, doubling, up to the cap.
RECONNECT_BACKOFF_START = 0.5
RECONNECT_BACKOFF_MAX = 30.0
#: A connection that lasted this long starts the back-off over; one lost again sooner (an
#: error that only shows after connecting) goes on backing off instead of spinning.
LASTED = 60.0


def backoff(attempts: int) -> float:
    """No attempt failed yet: at once; then from the start delay, doubling, to the cap."""
    if attempts <= 0:
        return 0.0
    return min(RECONNECT_BACKOFF_START * 2 ** (attempts - 1), RECONNECT_BACKOFF_MAX)
