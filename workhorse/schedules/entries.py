"""A schedule entry: which task to send, when, and what to do about due times missed.

Entries come from the config files (``[[schedule]]`` tables in TOML, ``[schedule NAME]``
sections in INI; a drop-in's entry replaces the main file's of the same name) and, for a
Celery app run with ``-A``, from its ``beat_schedule`` (``celery.py``). A bad entry is
refused with one line naming the entry and the field."""
from __future__ import annotations

import difflib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, UTC
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from .timing import Cron, Every, Timing, parse_duration

#: What to do with due times missed while no worker could send them (see ``plan``).
CATCHUP = ("none", "latest", "all")
DEFAULT_CATCHUP = "latest"
DEFAULT_MISFIRE_GRACE = 3600.0
NAME = re.compile(r"^[^\x00-\x1f\x7f]{1,200}$")
KEYS = ("name", "task", "cron", "every", "anchor", "tz", "args", "kwargs", "queue",
        "priority", "expires", "catchup", "misfire_grace")


class EntryError(ValueError):
    """An entry that cannot be used; the message names it and the field."""


@dataclass(frozen=True)
class Entry:
    name: str
    task: str
    timing: Timing
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    queue: str | None = None
    priority: int | None = None
    #: Seconds after its nominal time that a sent task expires (not run later).
    expires: float | None = None
    catchup: str = DEFAULT_CATCHUP
    misfire_grace: float = DEFAULT_MISFIRE_GRACE
    #: Where it was read ("/etc/workhorse/workhorse.toml", "Celery beat_schedule").
    source: str = ""

    @property
    def tz(self) -> ZoneInfo:
        return self.timing.tz

    def same_as(self, other: Entry) -> bool:
        """Does it send the same thing at the same times (a reload that changed nothing)?"""
        return (self.task, self.timing.describe(), self.args, dict(self.kwargs), self.queue,
                self.priority, self.expires, self.catchup, self.misfire_grace) == (
            other.task, other.timing.describe(), other.args, dict(other.kwargs), other.queue,
            other.priority, other.expires, other.catchup, other.misfire_grace)


def zone(value: object) -> ZoneInfo:
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected an IANA time zone name such as 'Europe/Berlin', got "
                         f"{value!r}")
    try:
        return ZoneInfo(value)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {value!r} (IANA names such as 'Europe/Berlin', "
                         "'UTC')") from None


def from_table(table: Mapping[str, Any], source: str) -> Entry:
    """An entry from a config table (TOML values, or INI strings: JSON for args/kwargs)."""
    raw_name = table.get("name")
    label = f"{source} schedule {raw_name!r}" if raw_name else f"{source} schedule"
    if not isinstance(raw_name, str) or not raw_name.strip() or not NAME.match(raw_name):
        raise EntryError(f"{label}: name: expected a name of 1 to 200 printable characters, "
                         f"got {raw_name!r}")
    name = raw_name
    label = f"{source} schedule {name!r}"

    def field_error(key: str, why: str) -> EntryError:
        return EntryError(f"{label}: {key}: {why}")

    for key in table:
        if key not in KEYS:
            close = difflib.get_close_matches(key, KEYS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise field_error(key, f"unknown key{hint} (keys: {', '.join(KEYS)})")
    task = table.get("task")
    if not isinstance(task, str) or not task.strip():
        raise field_error("task", f"expected the task's name, got {task!r}")
    try:
        tz = zone(table.get("tz", "UTC"))
    except ValueError as exc:
        raise field_error("tz", str(exc)) from None
    cron, every = table.get("cron"), table.get("every")
    if (cron is None) == (every is None):
        raise field_error("cron", "give either cron or every (one of them)")
    timing: Timing
    if cron is not None:
        if "anchor" in table:
            raise field_error("anchor", "only an every schedule has an anchor")
        if not isinstance(cron, str):
            raise field_error("cron", f"expected a cron expression string, got {cron!r}")
        try:
            timing = Cron(cron, tz)
        except ValueError as exc:
            raise field_error("cron", str(exc)) from None
    else:
        try:
            seconds = parse_duration(every, "every")
        except ValueError as exc:
            raise field_error("every", str(exc)) from None
        anchor = None
        if "anchor" in table:
            try:
                anchor = _datetime(table["anchor"])
            except ValueError as exc:
                raise field_error("anchor", str(exc)) from None
        timing = Every(seconds, tz, anchor)
    args = _json_ish(table.get("args", ()), list, "args", field_error)
    kwargs = _json_ish(table.get("kwargs", {}), dict, "kwargs", field_error)
    if any(not isinstance(key, str) for key in kwargs):
        raise field_error("kwargs", "keys must be strings")
    queue = table.get("queue")
    if queue is not None and (not isinstance(queue, str) or not queue):
        raise field_error("queue", f"expected a queue name, got {queue!r}")
    priority = _int_or_none(table.get("priority"))
    if priority is not None and not 0 <= priority <= 255:
        raise field_error("priority", f"expected an integer from 0 to 255, got "
                                      f"{table.get('priority')!r}")
    if "priority" in table and priority is None:
        raise field_error("priority", f"expected an integer from 0 to 255, got "
                                      f"{table.get('priority')!r}")
    expires = None
    if table.get("expires") is not None:
        try:
            expires = parse_duration(table["expires"], "expires")
        except ValueError as exc:
            raise field_error("expires", str(exc)) from None
    catchup = table.get("catchup", DEFAULT_CATCHUP)
    if catchup not in CATCHUP:
        raise field_error("catchup", f"expected one of {', '.join(CATCHUP)}, got {catchup!r}")
    grace = DEFAULT_MISFIRE_GRACE
    if "misfire_grace" in table:
        try:
            grace = parse_duration(table["misfire_grace"], "misfire_grace")
        except ValueError as exc:
            raise field_error("misfire_grace", str(exc)) from None
    return Entry(name, task.strip(), timing, tuple(args), dict(kwargs), queue, priority,
                 expires, catchup, grace, source)


def _json_ish(value: Any, kind: type, key: str, error: Any) -> Any:
    """args / kwargs: a TOML array / table, or (INI, env) their JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise error(key, f"not valid JSON: {exc}") from None
    if isinstance(value, tuple):
        value = list(value)
    if not isinstance(value, kind):
        what = "an array (list)" if kind is list else "a table (mapping)"
        raise error(key, f"expected {what}, got {value!r}")
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise error(key, f"cannot be sent as JSON: {exc}") from None
    return value


def _int_or_none(value: Any) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    return None


def _datetime(value: Any) -> datetime:
    if isinstance(value, datetime):
        return value
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value)
        except ValueError:
            pass
    raise ValueError(f"expected an ISO 8601 time such as 2026-01-01T00:00:00+00:00, got "
                     f"{value!r}")


def merge(entries: list[Entry]) -> list[Entry]:
    """Later entries (drop-ins, read after the main file) replace earlier ones of the same
    name; the order is the first appearance's."""
    by_name: dict[str, Entry] = {}
    for entry in entries:
        by_name[entry.name] = entry
    return list(by_name.values())


def iso(moment: float | datetime, tz: ZoneInfo | None = None) -> str:
    """``YYYY-MM-DDTHH:MM:SS±HH:MM`` in ``tz`` (UTC if None); fractions only if any."""
    if isinstance(moment, (int, float)):
        moment = datetime.fromtimestamp(moment, UTC)
    moment = moment.astimezone(tz or UTC)
    return moment.isoformat(timespec="microseconds" if moment.microsecond else "seconds")


def entries_for(schedule: tuple[Entry, ...], celery_schedule: list[Entry]) -> list[Entry]:
    """A worker's entries: a Celery app's beat_schedule, then the config files' (which
    replace those of the same names)."""
    return merge([*celery_schedule, *schedule])
