"""Sizing the pool on the backlog (``autoscale = "MIN,MAX"``), and the load figure that
``/scale`` gives an external autoscaler. Pure: the clock and what is measured are
arguments; the supervisor applies the answer (``Reload.resize``: the window follows, a
child is retired only between tasks).

The rule, checked every second:
- grow by one child while the oldest ready message of the consumed queues is older than
  ``target_age`` (and the pool is below MAX);
- shrink by one idle child once no message has been ready for ``idle`` seconds (and the
  pool is above MIN);
- at most one change a second, none while the backlog's view is stale (broker away).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

#: Seconds between two changes of the pool's size, at least.
STEP = 1.0


def clamp(size: int, bounds: tuple[int, int] | None) -> int:
    """``size`` brought within ``bounds`` (no bounds: as it is)."""
    if bounds is None:
        return size
    low, high = bounds
    return max(low, min(high, size))


@dataclass
class Autoscaler:
    low: int
    high: int
    target_age: float
    idle: float
    #: Monotonic times: the last change, and when a message was last seen ready.
    changed_at: float = -math.inf
    backlog_at: float = -math.inf

    def decide(self, now: float, size: int, idle_children: int, ready: int,
               oldest_age: float | None) -> int:
        """The pool size to have from ``now``: ``size``, one more or one less."""
        if ready > 0:
            self.backlog_at = now
        elif self.backlog_at == -math.inf:
            self.backlog_at = now           # the idle time counts from the first look
        if now - self.changed_at < STEP:
            return size
        wanted = size
        if size < self.high and ready > 0 and (oldest_age is None
                                              or oldest_age > self.target_age):
            wanted = size + 1
        elif (size > self.low and idle_children > 0 and ready == 0
              and now - self.backlog_at >= self.idle):
            wanted = size - 1
        if wanted != size:
            self.changed_at = now
        return wanted


def load(busy: int, slots: int, ready: int, oldest_age: float | None,
         target_age: float) -> float:
    """``/scale``'s load: this worker's busy share of its slots, plus how far the oldest
    ready message is past the target age, as a ratio (``oldest_age / target_age``; with an
    unknown age, 1 per message ready for each slot). 1.0 means the fleet is just big enough;
    an autoscaler that keeps ``workers × load / target`` workers (Kubernetes' HPA with a
    ``Value`` metric) grows it while messages wait longer than the target, and shrinks it
    to what the running tasks need once none wait."""
    share = busy / slots if slots else 0.0
    if ready <= 0:
        return round(share, 3)
    if oldest_age is None:
        return round(share + ready / max(slots, 1), 3)
    return round(share + oldest_age / target_age, 3)
