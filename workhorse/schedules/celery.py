"""A Celery app's ``beat_schedule`` as workhorse schedule entries (under ``-A``).

- ``crontab(...)``: its expanded fields, in the app's ``timezone`` (UTC if unset). A day
  is due when both its day of month and its day of week match, as Celery's crontab reads
  them (plain cron takes either).
- a number of seconds, a ``timedelta`` or ``schedule(run_every=...)``: ``every``, whose due
  times are multiples of the interval since the Unix epoch (beat counts from its own last
  run, which differs between processes; workers must agree). ``relative`` is ignored.
- ``solar(...)`` is refused (no sun positions here): the worker does not start.
- ``options``: ``queue``, ``priority`` and ``expires`` (seconds) are used; ``routing_key``
  names the queue when ``queue`` does not; other options are refused, since a task sent
  without them would not be what beat sent.
"""
from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from .entries import Entry, EntryError, from_table, zone
from .timing import Cron, Every

SOURCE = "Celery beat_schedule"
OPTIONS = ("queue", "priority", "expires", "routing_key")


def beat_entries(celery_app: Any) -> list[Entry]:
    """Raises EntryError naming the entry and what is wrong."""
    conf = celery_app.conf
    schedule = conf.get("beat_schedule") or {}
    if not isinstance(schedule, Mapping):
        raise EntryError(f"{SOURCE}: expected a dict of entries, got {type(schedule).__name__}")
    try:
        tz = zone(conf.get("timezone") or "UTC")
    except ValueError as exc:
        raise EntryError(f"Celery timezone: {exc}") from None
    entries = []
    for name, spec in schedule.items():
        label = f"{SOURCE} {name!r}"
        if not isinstance(spec, Mapping):
            raise EntryError(f"{label}: expected a dict with task and schedule")
        table: dict[str, Any] = {"name": str(name), "task": spec.get("task"),
                                 "every": "1s"}     # (a placeholder: timing is set below)
        if "args" in spec:
            table["args"] = list(spec.get("args") or ())
        if "kwargs" in spec:
            table["kwargs"] = dict(spec.get("kwargs") or {})
        options = dict(spec.get("options") or {})
        for key in options:
            if key not in OPTIONS:
                raise EntryError(f"{label}: options: {key!r} is not supported here (supported: "
                                 f"{', '.join(OPTIONS)})")
        queue = options.get("queue") or options.get("routing_key")
        if queue is not None:
            table["queue"] = queue
        for key in ("priority", "expires"):
            if options.get(key) is not None:
                table[key] = options[key]
        entry = from_table(table, SOURCE)
        timing = _timing(spec.get("schedule"), tz, label)
        entries.append(Entry(entry.name, entry.task, timing, entry.args, entry.kwargs,
                             entry.queue, entry.priority, entry.expires, entry.catchup,
                             entry.misfire_grace, SOURCE))
    return entries


def _timing(value: Any, tz: Any, label: str) -> Cron | Every:
    kind = type(value).__name__
    if isinstance(value, bool) or value is None:
        raise EntryError(f"{label}: schedule: expected a crontab, a timedelta or seconds, got "
                         f"{value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif kind == "crontab":
        try:
            return Cron.from_fields(value.minute, value.hour, value.day_of_month,
                                    value.month_of_year, value.day_of_week, tz,
                                    days_both=True, text=_crontab_text(value))
        except ValueError as exc:
            raise EntryError(f"{label}: schedule: {exc}") from None
    elif kind == "solar":
        raise EntryError(f"{label}: schedule: solar schedules are not supported by workhorse "
                         "(use a crontab at the times you need, or keep beat for this entry)")
    elif isinstance(getattr(value, "run_every", None), timedelta):
        seconds = value.run_every.total_seconds()
    else:
        raise EntryError(f"{label}: schedule: {kind} is not supported (crontab, timedelta, "
                         "schedule(run_every=...) or seconds)")
    if seconds <= 0:
        raise EntryError(f"{label}: schedule: the interval must be positive, got {seconds} s")
    return Every(seconds, tz)


def _crontab_text(value: Any) -> str:
    fields = ("_orig_minute", "_orig_hour", "_orig_day_of_month", "_orig_month_of_year",
              "_orig_day_of_week")
    return "crontab(" + " ".join(str(getattr(value, f, "?")) for f in fields) + ")"
