"""When a schedule is due: cron expressions on a time zone's wall clock, and fixed
intervals in absolute time. Pure; no clock is read here.

Cron fields are matched against local wall-clock times, and each matching local time is
turned into an instant with ``fold=0``:

- a local time that does not exist (the spring gap) is read with the offset in force before
  the gap, so it fires the gap's length later (02:30 becomes 03:30+02:00 in Europe/Berlin on
  the day the clocks jump);
- a local time that occurs twice (autumn) fires once, at its first occurrence (RFC 5545
  §3.3.5), for every cron: an hourly one does not fire in the repeated hour's second pass.

Around a gap several local times can map to one instant, or map out of order; the due
times are the distinct instants, in order.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from datetime import UTC, date, datetime, timedelta
from typing import Protocol
from zoneinfo import ZoneInfo

#: No zone's offset moves by more than this at once: how far around a local time to look.
MAX_SHIFT = timedelta(hours=3)
#: A cron that is not due within this many days from 2000-01-01 never is (leap days too).
SEARCH_DAYS = 366 * 9
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MICROSECOND = timedelta(microseconds=1)

MACROS = {"@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *",
          "@weekly": "0 0 * * 0", "@daily": "0 0 * * *", "@midnight": "0 0 * * *",
          "@hourly": "0 * * * *"}
FIELDS = ("minute", "hour", "day-of-month", "month", "day-of-week")
RANGES = ((0, 59), (0, 23), (1, 31), (1, 12), (0, 7))
MONTHS = {name: i for i, name in enumerate(
    ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"), 1)}
WEEKDAYS = {name: i for i, name in enumerate(("sun", "mon", "tue", "wed", "thu", "fri", "sat"))}


class Timing(Protocol):
    tz: ZoneInfo

    def next_after(self, after: datetime) -> datetime:
        """The first due time strictly after ``after`` (aware), in ``tz``."""
        ...

    def describe(self) -> str: ...


class Cron:
    def __init__(self, expression: str, tz: ZoneInfo) -> None:
        text = " ".join(expression.split())
        self.expression, self.tz = text, tz
        fields = text
        if text.startswith("@"):
            if text.lower() not in MACROS:
                raise ValueError(f"cron {expression!r}: unknown macro (known: "
                                 f"{', '.join(MACROS)})")
            fields = MACROS[text.lower()]
        parts = fields.split()
        if len(parts) != 5:
            raise ValueError(f"cron {expression!r}: expected 5 fields (minute hour "
                             f"day-of-month month day-of-week), got {len(parts)}")
        sets = [_field(expression, part, index) for index, part in enumerate(parts)]
        self._set(*sets, days_or=not parts[2].startswith("*") and not parts[4].startswith("*"))

    @classmethod
    def from_fields(cls, minutes: Iterable[int], hours: Iterable[int],
                    days_of_month: Iterable[int], months: Iterable[int],
                    days_of_week: Iterable[int], tz: ZoneInfo, *, days_both: bool,
                    text: str | None = None) -> Cron:
        """A cron from expanded fields (a Celery crontab's; day of week 0 = Sunday)."""
        cron = cls.__new__(cls)
        cron.expression, cron.tz = text or "(fields)", tz
        sets = []
        for index, values in enumerate((minutes, hours, days_of_month, months, days_of_week)):
            low, high = RANGES[index]
            found = frozenset(int(v) for v in values)
            bad = sorted(v for v in found if not low <= v <= high)
            if bad or not found:
                why = f"{bad[0]} is out of range {low}-{high}" if bad else "no values"
                raise ValueError(f"cron {cron.expression}: {FIELDS[index]} field: {why}")
            sets.append(found)
        cron._set(*sets, days_or=not days_both)
        return cron

    def _set(self, minutes: frozenset[int], hours: frozenset[int], doms: frozenset[int],
             months: frozenset[int], dows: frozenset[int], *, days_or: bool) -> None:
        self.minutes, self.hours = sorted(minutes), sorted(hours)
        self.days_of_month, self.months = doms, months
        self.days_of_week = frozenset(0 if d == 7 else d for d in dows)
        self.days_or = days_or
        if next(self._local_times(datetime(2000, 1, 1)), None) is None:
            raise ValueError(f"cron {self.expression!r}: never due (no such day)")

    def describe(self) -> str:
        return f"cron {self.expression!r} in {self.tz.key}"

    def _day_due(self, day: date) -> bool:
        if day.month not in self.months:
            return False
        dom = day.day in self.days_of_month
        dow = day.isoweekday() % 7 in self.days_of_week
        return (dom or dow) if self.days_or else (dom and dow)

    def _local_times(self, start: datetime) -> Iterator[datetime]:
        """Matching naive local times at or after ``start``, in order (within SEARCH_DAYS)."""
        day = start.date()
        for _ in range(SEARCH_DAYS):
            if self._day_due(day):
                first = day == start.date()
                for hour in self.hours:
                    if first and hour < start.hour:
                        continue
                    for minute in self.minutes:
                        moment = datetime(day.year, day.month, day.day, hour, minute)
                        if moment >= start:
                            yield moment
            day += timedelta(days=1)

    def next_after(self, after: datetime) -> datetime:
        after = after.astimezone(UTC)
        local = after.astimezone(self.tz).replace(tzinfo=None)
        best: datetime | None = None
        best_local: datetime | None = None
        for moment in self._local_times((local - MAX_SHIFT).replace(second=0, microsecond=0)):
            if best_local is not None and moment > best_local + 2 * MAX_SHIFT:
                break
            instant = moment.replace(tzinfo=self.tz, fold=0).astimezone(UTC)
            if instant > after and (best is None or instant < best):
                best, best_local = instant, moment
        if best is None:
            raise ValueError(f"cron {self.expression!r}: not due within {SEARCH_DAYS} days "
                             f"after {after.isoformat()}")
        return best.astimezone(self.tz)


def _field(expression: str, text: str, index: int) -> frozenset[int]:
    name, (low, high) = FIELDS[index], RANGES[index]
    names = MONTHS if index == 3 else WEEKDAYS if index == 4 else {}

    def fail(why: str) -> ValueError:
        return ValueError(f"cron {expression!r}: {name} field {text!r}: {why}")

    def number(word: str) -> int:
        value = names.get(word.lower()) if names else None
        if value is None:
            if not word.isdigit():
                raise fail(f"{word!r} is not a number" + (" or a name" if names else ""))
            value = int(word)
        if not low <= value <= high:
            raise fail(f"{value} is out of range {low}-{high}")
        return value

    values: set[int] = set()
    for item in text.split(","):
        base, slash, step_text = item.partition("/")
        step = 1
        if slash:
            if not step_text.isdigit() or int(step_text) == 0:
                raise fail(f"step {step_text!r} must be a positive integer")
            step = int(step_text)
        if base == "*":
            first, last = low, high
        elif "-" in base:
            a, _, b = base.partition("-")
            first, last = number(a), number(b)
            if first > last:
                raise fail(f"range {base!r} runs backwards")
        else:
            first = number(base)
            last = high if slash else first
        values.update(range(first, last + 1, step))
    return frozenset(values)


class Every:
    """Due every ``seconds``, at anchor + k × seconds: the same instants on every worker."""

    def __init__(self, seconds: float, tz: ZoneInfo, anchor: datetime | None = None) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
            raise ValueError(f"every: the interval must be a positive number of seconds, got "
                             f"{seconds!r}")
        self.seconds, self.tz = float(seconds), tz
        self._step = round(self.seconds * 1_000_000)
        if self._step <= 0:
            raise ValueError(f"every: the interval {seconds!r} is under a microsecond")
        if anchor is None:
            anchor = EPOCH
        elif anchor.tzinfo is None:
            anchor = anchor.replace(tzinfo=tz)
        self.anchor = anchor
        self._anchor = (anchor - EPOCH) // MICROSECOND

    def describe(self) -> str:
        text = f"every {self.seconds:g} s"
        return text if self.anchor == EPOCH else f"{text} from {self.anchor.isoformat()}"

    def next_after(self, after: datetime) -> datetime:
        now = (after - EPOCH) // MICROSECOND
        k = (now - self._anchor) // self._step + 1
        return (EPOCH + (self._anchor + k * self._step) * MICROSECOND).astimezone(self.tz)


_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")


def parse_duration(value: object, what: str) -> float:
    """Seconds from ``90``, ``"90"``, ``"90s"``, ``"1h30m"``, ``"1.5h"``, ``"500ms"``, ``"2d"``,
    ``"1w"``; positive."""
    seconds: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower()
        try:
            seconds = float(text)
        except ValueError:
            pos, total = 0, 0.0
            for match in _DURATION.finditer(text):
                if match.start() != pos:
                    break
                total += float(match.group(1)) * _UNITS[match.group(2)]
                pos = match.end()
            if text and pos == len(text):
                seconds = total
    if seconds is None or not seconds > 0 or seconds != seconds or seconds == float("inf"):
        raise ValueError(f"{what}: expected a positive duration such as 90s, 15m, 1h30m or "
                         f"2d (or a number of seconds), got {value!r}")
    return seconds


def due_between(timing: Timing, after: datetime, until: datetime,
                limit: int | None = None) -> list[datetime]:
    """The due times after ``after`` up to and including ``until``, in order (the first
    ``limit`` of them)."""
    found: list[datetime] = []
    moment = timing.next_after(after)
    while moment <= until and (limit is None or len(found) < limit):
        found.append(moment)
        moment = timing.next_after(moment)
    return found
