"""Which due times to send now: the one due now, and the missed ones the entry's
``catchup`` asks for. Pure: the clock is an argument.

A due time is *on time* if it is the latest one due and at most ``ON_TIME`` seconds (or
``misfire_grace``, if shorter) old when a worker looks: a worker that was running sends it.
Every other due time not sent yet was *missed* (every worker was down, frozen, or busy
deploying). Missed due times older than ``misfire_grace`` are never sent. Of the rest:

- ``none`` sends none of them;
- ``latest`` sends the last one, unless an on-time one is sent (it is the latest);
- ``all`` sends each one, oldest first, then the on-time one.

Never more than that: a worker that comes back after a week with ``all`` sends what fell
within ``misfire_grace``, not a week of runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from .timing import Timing, due_between

#: How late (seconds) the latest due time may be found and still count as on time: the
#: worst a loaded worker's timer, plus a broker round trip, should ever be late by.
ON_TIME = 10.0
#: Missed due times beyond misfire_grace are counted up to this many (for the log).
COUNT_LIMIT = 10_000


@dataclass
class Plan:
    send: list[datetime] = field(default_factory=list)
    #: Due times that will never be sent (missed: beyond misfire_grace, or the policy's).
    skipped: list[datetime] = field(default_factory=list)
    #: How many more were skipped, beyond misfire_grace (counted up to COUNT_LIMIT).
    skipped_beyond_grace: int = 0


def plan(timing: Timing, catchup: str, misfire_grace: float, last: datetime,
         now: datetime) -> Plan:
    """The due times after ``last`` (the last one sent, or when the schedule was first
    seen) up to ``now``: what to send and what is skipped."""
    result = Plan()
    if now <= last:
        return result
    horizon = now - timedelta(seconds=misfire_grace)
    if horizon > last:
        result.skipped_beyond_grace = len(due_between(timing, last, horizon, COUNT_LIMIT))
        last = horizon
    missed = due_between(timing, last, now)
    on_time_limit = min(ON_TIME, misfire_grace)
    current = None
    if missed and (now - missed[-1]).total_seconds() <= on_time_limit:
        current = missed.pop()
    if catchup == "all":
        result.send = missed
    elif catchup == "latest" and missed and current is None:
        result.send = [missed.pop()]
        result.skipped = missed
    else:
        result.skipped = missed
    if current is not None:
        result.send.append(current)
    return result
