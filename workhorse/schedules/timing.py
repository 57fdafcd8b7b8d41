"""When a periodic task is due: cron expressions read on a time zone's wall clock, and fixed
intervals counted in absolute time. Pure: nothing here reads the clock.

The due times are called nominal times. Every worker must compute the same ones, whenever it
started, because the fence that sends each one once is keyed by them.

Cron fields are matched against local wall-clock times, and each matching local time becomes
an instant the way ``zoneinfo`` reads it with ``fold=0``:

- a local time that does not exist (in the spring gap) is read with the offset in force
  before the gap, so it fires the gap's length later: ``30 2 * * *`` in Europe/Berlin fires
  at 03:30+02:00 on the day the clocks jump from 02:00 to 03:00;
- a local time that occurs twice (autumn) fires once, at its first occurrence (RFC 5545
  §3.3.5), whatever the cron: an hourly cron does not fire in the repeated hour's second pass.

Around a gap several local times can map to one instant (02:30 read before the gap and 03:30
after it are the same instant), and a later local time can map to an earlier instant. The
nominal times are the distinct instants, in increasing order.
"""
from __future__ import annotations

import math
import re
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from datetime import MAXYEAR, UTC, date, datetime, time, timedelta
from typing import Protocol
from zoneinfo import ZoneInfo

__all__ = ["Cron", "Every", "Timing", "due_between", "parse_duration"]

#: At least as far back as any clock jump forward in today's rules (Antarctica/Troll jumps
#: 2 h): how far before ``after``'s wall time a gap's local times can still map past it.
LOOKBACK = timedelta(hours=3)
#: A gap larger than LOOKBACK (Samoa skipped a whole day in 2011) is noticed by comparing the
#: offset now with the offset this long before.
JUMP_PROBE = timedelta(hours=26)
#: Where the offset is looked up before ``after``: when it is the same at all of them, no
#: clock change is near and the scan can start at ``after``'s own wall time (a dense cron
#: then costs a couple of candidates a call, not LOOKBACK's worth).
PROBES = (*(timedelta(minutes=30 * k) for k in range(1, 7)), JUMP_PROBE)
#: Where the "is this cron ever due" search starts, and how far it goes: 29 years cover
#: every combination of date and weekday, Feb 29 on a Monday included (2016).
REFERENCE = datetime(2000, 1, 1)
SEARCH_END = date(2029, 1, 1)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MICROSECOND = timedelta(microseconds=1)
MINUTE = timedelta(minutes=1)
DAY = timedelta(days=1)

MACROS = {
    "@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0", "@daily": "0 0 * * *", "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
FIELD_NAMES = ("minute", "hour", "day-of-month", "month", "day-of-week")
FIELD_RANGES = ((0, 59), (0, 23), (1, 31), (1, 12), (0, 7))
MONTH_NAMES = {name: number for number, name in enumerate(
    ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"), 1)}
WEEKDAY_NAMES = {name: number for number, name in enumerate(
    ("sun", "mon", "tue", "wed", "thu", "fri", "sat"))}
FIELD_WORDS: tuple[dict[str, int], ...] = ({}, {}, {}, MONTH_NAMES, WEEKDAY_NAMES)


class Timing(Protocol):
    """What a schedule's due times come from: a Cron or an Every."""

    tz: ZoneInfo

    def next_after(self, after: datetime) -> datetime:
        """The first nominal time strictly later than ``after`` (aware, any zone), in ``tz``."""
        ...

    def describe(self) -> str:
        """A short text for listings and logs, e.g. ``every 90 s``."""
        ...


class Cron:
    """A five-field cron expression (or a Celery crontab's expanded fields) on ``tz``'s wall
    clock.

    ``days_or`` is the day rule: when true a day is due if its day of month or its day of week
    matches (Vixie cron, when both fields are restricted); when false both must match.
    """

    expression: str
    tz: ZoneInfo
    minutes: tuple[int, ...]
    hours: tuple[int, ...]
    days_of_month: frozenset[int]
    months: frozenset[int]
    days_of_week: frozenset[int]
    days_or: bool
    _label: str

    def __init__(self, expression: str, tz: ZoneInfo) -> None:
        """Raises ValueError with one line naming the field and what is wrong with it."""
        text = " ".join(expression.split())
        self.expression = text
        self._label = f"cron '{text}'"
        fields = text
        if text.startswith("@"):
            fields = _macro(text, self._label)
        parts = fields.split()
        if len(parts) != 5:
            raise ValueError(f"{self._label}: expected 5 fields ({' '.join(FIELD_NAMES)}), "
                             f"got {len(parts)}")
        sets = [_parse_field(self._label, index, part) for index, part in enumerate(parts)]
        # Vixie cron: "*" or "*/n" in either day field means "both must match".
        days_or = not parts[2].startswith("*") and not parts[4].startswith("*")
        self._setup(tz, *sets, days_or=days_or)

    @classmethod
    def from_fields(cls, minutes: Iterable[int], hours: Iterable[int],
                    days_of_month: Iterable[int], months: Iterable[int],
                    days_of_week: Iterable[int], tz: ZoneInfo, *, days_both: bool,
                    text: str | None = None) -> Cron:
        """A cron from expanded sets of values, as a Celery ``crontab`` holds them (day of
        week 0 = Sunday ... 6 = Saturday; 7 is taken as Sunday too).

        With ``days_both`` a day is due only when both day fields match (Celery's reading);
        without it, either one, when neither set is complete (cron's reading). ``text`` is
        what describe() shows; without it the fields are written out as a cron expression.
        """
        given = (minutes, hours, days_of_month, months, days_of_week)
        cron = cls.__new__(cls)
        label = text if text is not None else "cron fields"
        sets = [_check_values(label, index, values) for index, values in enumerate(given)]
        if text is None:
            text = " ".join(_write_field(index, found) for index, found in enumerate(sets))
            label = f"cron '{text}'"
        cron.expression, cron._label = text, label
        full_dom = sets[2] >= frozenset(range(1, 32))
        full_dow = {0 if day == 7 else day for day in sets[4]} >= set(range(7))
        cron._setup(tz, *sets, days_or=not days_both and not full_dom and not full_dow)
        return cron

    def _setup(self, tz: ZoneInfo, minutes: frozenset[int], hours: frozenset[int],
               days_of_month: frozenset[int], months: frozenset[int],
               days_of_week: frozenset[int], *, days_or: bool) -> None:
        """Stores the fields and refuses a cron that can never be due (Feb 30, Apr 31)."""
        self.tz = tz
        self.minutes, self.hours = tuple(sorted(minutes)), tuple(sorted(hours))
        self.days_of_month, self.months = days_of_month, months
        self.days_of_week = frozenset(0 if day == 7 else day for day in days_of_week)
        self.days_or = days_or
        if next(self._wall_times(REFERENCE, SEARCH_END), None) is None:
            raise ValueError(f"{self._label}: never due (no such day)")

    def describe(self) -> str:
        """``cron '30 2 * * *' in Europe/Berlin``; a Celery crontab shows its own text."""
        return f"{self._label} in {self.tz}"

    def __repr__(self) -> str:
        return f"<Cron {self.describe()}>"

    def next_after(self, after: datetime) -> datetime:
        """The first nominal time strictly later than ``after``, in ``tz``.

        Local candidates are scanned in wall-clock order from a little before ``after``'s
        wall time, since a local time in a spring gap can map past ``after`` even though it
        lies before it on the wall. The scan stops at the wall time of the best instant found:
        every later local time maps to that instant or a later one (only gap times map back,
        and they lie before the wall time their instant shows).
        """
        moment = _utc(after, "after")
        wall = moment.astimezone(self.tz).replace(tzinfo=None, fold=0)
        best: datetime | None = None
        stop: datetime | None = None
        for local in self._wall_times(wall - self._lookback(moment)):
            if stop is not None and local >= stop:
                break
            instant = local.replace(tzinfo=self.tz).astimezone(UTC)
            if instant > moment and (best is None or instant < best):
                best = instant
                stop = instant.astimezone(self.tz).replace(tzinfo=None, fold=0)
        if best is None:
            raise ValueError(f"{self._label}: not due again after {after.isoformat()}")
        return best.astimezone(self.tz)

    def _lookback(self, moment: datetime) -> timedelta:
        """How far before ``moment``'s wall time to start: nothing when the offset has not
        changed lately, else LOOKBACK, or the size of a larger clock jump forward that
        happened just before ``moment``."""
        now = moment.astimezone(self.tz).utcoffset()
        before = [(moment - probe).astimezone(self.tz).utcoffset() for probe in PROBES]
        if all(offset == now for offset in before):
            return timedelta(0)
        if now is None or before[-1] is None:
            return LOOKBACK
        return max(LOOKBACK, now - before[-1])

    def _day_due(self, day: date) -> bool:
        on_date = day.day in self.days_of_month
        on_weekday = day.isoweekday() % 7 in self.days_of_week
        return (on_date or on_weekday) if self.days_or else (on_date and on_weekday)

    def _wall_times(self, start: datetime, end: date | None = None) -> Iterator[datetime]:
        """The matching naive local times at or after ``start`` (and before day ``end``), in
        order. Months and days that cannot match are skipped whole, so a leap-day cron costs
        a few hundred steps, not millions of minutes."""
        if start.second or start.microsecond:
            start = start.replace(second=0, microsecond=0) + MINUTE
        last = end or date.max
        day, first = start.date(), start.time()
        while day < last:
            if day.month not in self.months:
                day, first = _next_month(day), time.min
                continue
            if self._day_due(day):
                for hour in self.hours[bisect_left(self.hours, first.hour):]:
                    skip = first.minute if hour == first.hour else 0
                    for minute in self.minutes[bisect_left(self.minutes, skip):]:
                        yield datetime.combine(day, time(hour, minute))
            if day == date.max:
                return
            day, first = day + DAY, time.min


def _macro(text: str, label: str) -> str:
    """The five fields a macro stands for."""
    fields = MACROS.get(text.lower())
    if fields is not None:
        return fields
    if text.lower() == "@reboot":
        raise ValueError(f"{label}: @reboot is not a schedule (it means once at boot)")
    raise ValueError(f"{label}: unknown macro (known: {', '.join(MACROS)})")


def _parse_field(label: str, index: int, text: str) -> frozenset[int]:
    """One cron field's values: ``*``, ``5``, ``mon``, ``1-5``, ``*/15``, ``1-30/5``,
    ``5/20`` (5 to the field's maximum, every 20th) and comma lists of these."""
    low, high = FIELD_RANGES[index]
    prefix = f"{label}: {FIELD_NAMES[index]} field '{text}'"
    values: set[int] = set()
    for item in text.split(","):
        if not item:
            raise ValueError(f"{prefix}: an empty item in the list")
        base, slash, step_text = item.partition("/")
        step = 1
        if slash:
            if not (step_text.isascii() and step_text.isdigit()):
                raise ValueError(f"{prefix}: step '{step_text}' is not a number")
            step = int(step_text)
            if step == 0:
                raise ValueError(f"{prefix}: step 0 never advances")
        if base == "*":
            first, last = low, high
        elif "-" in base:
            start_text, _, end_text = base.partition("-")
            first = _value(prefix, index, start_text)
            last = _value(prefix, index, end_text)
            if first > last:
                raise ValueError(f"{prefix}: range '{base}' runs backwards ({first} > {last})")
        else:
            first = _value(prefix, index, base)
            last = high if slash else first
        values.update(range(first, last + 1, step))
    return frozenset(values)


def _value(prefix: str, index: int, word: str) -> int:
    """A number, or a month or weekday name, within the field's range."""
    low, high = FIELD_RANGES[index]
    names = FIELD_WORDS[index]
    named = names.get(word.lower())
    if named is not None:
        return named
    if not word:
        raise ValueError(f"{prefix}: a value is missing")
    if not word.isascii() or not word.isdigit():
        kind = {3: "a number or month name", 4: "a number or weekday name"}.get(index, "a number")
        raise ValueError(f"{prefix}: '{word}' is not {kind}")
    value = int(word)
    if not low <= value <= high:
        raise ValueError(f"{prefix}: {value} is out of range {low}-{high}")
    return value


def _check_values(label: str, index: int, values: Iterable[int]) -> frozenset[int]:
    """A from_fields set, with the same range checks as a parsed field."""
    low, high = FIELD_RANGES[index]
    prefix = f"{label}: {FIELD_NAMES[index]} field"
    found: set[int] = set()
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{prefix}: {value!r} is not a whole number")
        if not low <= value <= high:
            raise ValueError(f"{prefix}: {value} is out of range {low}-{high}")
        found.add(value)
    if not found:
        raise ValueError(f"{prefix}: no values")
    return frozenset(found)


def _write_field(index: int, values: frozenset[int]) -> str:
    """A set of values as cron text: ``*`` when complete, else runs such as ``1-5,7``."""
    low, high = FIELD_RANGES[index]
    if index == 4:
        values, high = frozenset(0 if day == 7 else day for day in values), 6
    if values >= frozenset(range(low, high + 1)):
        return "*"
    runs: list[str] = []
    ordered = sorted(values)
    start = previous = ordered[0]
    for value in [*ordered[1:], None]:
        if value is not None and value == previous + 1:
            previous = value
            continue
        runs.append(str(start) if start == previous else f"{start}-{previous}")
        if value is not None:
            start = previous = value
    return ",".join(runs)


def _next_month(day: date) -> date:
    """The first day of the month after ``day``'s (date.max past the last month there is)."""
    if day.month < 12:
        return date(day.year, day.month + 1, 1)
    if day.year == MAXYEAR:
        return date.max
    return date(day.year + 1, 1, 1)


def _utc(moment: datetime, what: str) -> datetime:
    """An aware datetime as UTC; a naive one is refused, since its zone would be a guess."""
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise ValueError(f"{what}: expected an aware datetime, got naive {moment.isoformat()}")
    return moment.astimezone(UTC)


class Every:
    """Due every ``seconds``, at ``anchor`` + k × ``seconds`` for whole k.

    The anchor (the Unix epoch unless given) fixes the grid in absolute time, so every worker
    agrees on the due times whenever it started, and daylight-saving changes do not move
    them. ``tz`` only decides how the results are shown.
    """

    seconds: float
    tz: ZoneInfo
    anchor: datetime

    def __init__(self, seconds: float, tz: ZoneInfo, anchor: datetime | None = None) -> None:
        """Raises ValueError unless ``seconds`` is a finite number > 0 (at least 1 µs).
        A naive ``anchor`` is read in ``tz``."""
        if (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                or not math.isfinite(seconds) or seconds <= 0):
            raise ValueError(f"every: the interval must be a positive number of seconds, "
                             f"got {seconds!r}")
        self.seconds, self.tz = float(seconds), tz
        # Whole microseconds: 0.1 s steps must land on 0.3 s exactly, which floats do not.
        self._step = round(self.seconds * 1_000_000)
        if self._step < 1:
            raise ValueError(f"every: the interval must be at least a microsecond, got "
                             f"{seconds!r}")
        if anchor is None:
            anchor = EPOCH
        elif anchor.tzinfo is None:
            anchor = anchor.replace(tzinfo=tz)
        self.anchor = anchor
        self._anchor = _microseconds(anchor)

    def describe(self) -> str:
        """``every 90 s``, plus the anchor when it is not the epoch."""
        text = f"every {_seconds_text(self.seconds)} s"
        if self._anchor == 0:
            return text
        return f"{text} from {self.anchor.isoformat()}"

    def __repr__(self) -> str:
        return f"<Every {self.describe()} in {self.tz}>"

    def next_after(self, after: datetime) -> datetime:
        """The first anchor + k × seconds strictly later than ``after``, in ``tz``."""
        now = _microseconds(_utc(after, "after"))
        k = (now - self._anchor) // self._step + 1
        return (EPOCH + (self._anchor + k * self._step) * MICROSECOND).astimezone(self.tz)


def _microseconds(moment: datetime) -> int:
    """Whole microseconds since the epoch (exact: timedelta // timedelta is an int)."""
    return (moment - EPOCH) // MICROSECOND


def _seconds_text(seconds: float) -> str:
    return str(int(seconds)) if seconds.is_integer() else repr(seconds)


UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"
DURATION_PART = re.compile(rf"({NUMBER})\s*(ms|s|m|h|d|w)")
DURATION = re.compile(rf"(?:{NUMBER}\s*(?:ms|s|m|h|d|w)\s*)+")


def parse_duration(value: object, what: str) -> float:
    """Seconds (> 0) from a config value: ``90``, ``1.5``, ``"90"``, ``"90s"``, ``"15m"``,
    ``"1h30m"``, ``"1.5h"``, ``"2d"``, ``"1w"``, ``"500ms"``.

    Raises ValueError naming ``what`` (the setting) and the value otherwise: empty, zero,
    negative, an unknown unit or a value of another type.
    """
    seconds: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower()
        if re.fullmatch(NUMBER, text):
            seconds = float(text)
        elif DURATION.fullmatch(text):
            seconds = sum(float(number) * UNITS[unit]
                          for number, unit in DURATION_PART.findall(text))
    if seconds is None or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{what}: expected a positive duration such as '90s', '15m', "
                         f"'1h30m', '500ms' or a number of seconds, got '{value}'")
    return seconds


def due_between(timing: Timing, after: datetime, until: datetime,
                limit: int | None = None) -> list[datetime]:
    """Every nominal time n with after < n <= until, in order; only the first ``limit``
    when given.

    Instants are compared in UTC: two datetimes in the same zone compare by wall time, which
    gets the repeated autumn hour wrong.
    """
    end = _utc(until, "until")
    found: list[datetime] = []
    moment = after
    while limit is None or len(found) < limit:
        moment = timing.next_after(moment)
        if moment.astimezone(UTC) > end:
            break
        found.append(moment)
    return found
