"""Sizing the pool on the backlog (``autoscale = "MIN,MAX"``), and the load figure that
``/scale`` gives an external autoscaler. Pure: the clock and what is measured are
arguments; the supervisor applies the answer (``Reload.resize``: the window follows, a
child is retired only between tasks).

The rule, checked every second:
- grow by one child while the oldest ready message of the consumed queues is older than
  ``target_age`` and is not getting younger (then the pool is catching up), up to MAX;
- shrink by one idle child once, for ``idle`` seconds, no message has waited longer than
  ``target_age`` and at every look two children or more were idle, so that one fewer would
  still have left one idle (a steady load keeps the children it needs, and one spare);
- at most one change a second, each on a reading of the backlog taken after the last
  change; none while that reading is stale (broker away).
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
    #: Monotonic times: the last change, the last look that found a message waiting past
    #: the target age, and the last that found at most one child idle.
    changed_at: float = -math.inf
    backlog_at: float = -math.inf
    tight_at: float = -math.inf
    first_look: float | None = None
    #: The reading the last change was made on; the last reading and its oldest age, and
    #: the age the reading before it gave.
    acted_on: float = -math.inf
    read_last: float = -math.inf
    age_last: float | None = None
    age_before: float | None = None

    def decide(self, now: float, size: int, idle_children: int, ready: int,
               oldest_age: float | None, read_at: float | None = None) -> int:
        """The pool size to have from ``now``: ``size``, one more or one less. ``read_at``:
        when the backlog was read (a change waits for a reading taken after the last one,
        so a child just added is seen at work before another is)."""
        read_at = now if read_at is None else read_at
        if self.first_look is None:
            self.first_look = now           # the quiet time counts from the first look
        if read_at > self.read_last:
            self.read_last, self.age_before, self.age_last = read_at, self.age_last, oldest_age
        waiting = ready > 0 and (oldest_age is None or oldest_age > self.target_age)
        falling = (oldest_age is not None and self.age_before is not None
                   and oldest_age < self.age_before)
        if waiting:
            self.backlog_at = now
        if idle_children <= 1:
            self.tight_at = now
        if now - self.changed_at < STEP or read_at <= self.acted_on:
            return size
        wanted = size
        quiet_since = max(self.backlog_at, self.tight_at, self.first_look)
        if waiting and not falling and size < self.high:
            wanted = size + 1
        elif size > self.low and now - quiet_since >= self.idle:
            wanted = size - 1
        if wanted != size:
            self.changed_at, self.acted_on = now, read_at
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
