"""Task rate limits, as Celery spells them (``"10/m"``), kept per worker and task name by a
token bucket of capacity one: starts of a task are spaced at least 1/rate seconds apart.
Pure: the supervisor's clock is passed in."""
from __future__ import annotations

import re
from typing import Any

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:/\s*([smh]))?\s*$")


def parse_rate(value: Any) -> float | None:
    """Tasks per second from ``"100/m"``, ``"2/s"``, ``"10/h"``, ``"5"`` (per second) or a
    number; None (or 0) for no limit. Raises ValueError saying what is accepted."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value) or None
    if isinstance(value, str) and (match := _RATE.match(value)):
        per_second = float(match.group(1)) / _UNITS[match.group(2) or "s"]
        return per_second or None
    raise ValueError('expected a rate such as "10/s", "100/m" or "1000/h", a number of '
                     "tasks per second, or None")


class TokenBucket:
    """One start per token; a token comes back every 1/rate seconds, one held at most."""

    def __init__(self, rate: float, now: float) -> None:
        self.rate = rate
        self._next = now       # when the next start is allowed

    def wait(self, now: float) -> float:
        """Seconds until a start is allowed (0: now)."""
        return max(0.0, self._next - now)

    def take(self, now: float) -> None:
        """A start now: the next one may come 1/rate seconds later."""
        self._next = max(self._next, now) + 1.0 / self.rate


class RateLimits:
    """The buckets of the tasks that have a rate limit, by task name."""

    def __init__(self) -> None:
        self._buckets: dict[str, TokenBucket] = {}

    def wait(self, task: str, rate: float | None, now: float) -> float:
        """Seconds until ``task`` may start (0 for a task without a limit). A changed rate
        (a reload) starts a fresh bucket."""
        if rate is None:
            return 0.0
        bucket = self._buckets.get(task)
        if bucket is None or bucket.rate != rate:
            bucket = self._buckets[task] = TokenBucket(rate, now)
        return bucket.wait(now)

    def take(self, task: str, now: float) -> None:
        bucket = self._buckets.get(task)
        if bucket is not None:
            bucket.take(now)
