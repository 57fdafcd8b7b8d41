"""The revoked tasks a worker knows of: by id, and by stamped header (Celery's
``revoke`` and ``revoke_by_stamped_headers``). Pure: no I/O.

Entries expire (``REVOKE_EXPIRES`` after the revoke, as Celery's) and there are at most
``REVOKES_MAX`` ids, the oldest forgotten first. For the store that every worker shares
(so that a worker started or reconnected later knows them too), an entry is a string:
``id:<task id>`` or ``stamp:<json [header, value]>``, with its expiry in epoch seconds.
"""
from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

#: As Celery's worker (CELERY_WORKER_REVOKES_MAX, CELERY_WORKER_REVOKE_EXPIRES).
REVOKES_MAX = 50000
REVOKE_EXPIRES = 10800.0

ID, STAMP = "id:", "stamp:"


def _values(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple, set)) else [value]


def _stamp_key(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


class Revoked:
    def __init__(self, clock: Callable[[], float] = time.time, maxlen: int = REVOKES_MAX,
                 expires: float = REVOKE_EXPIRES) -> None:
        self.clock = clock
        self.maxlen = maxlen
        self.expires = expires
        self._ids: OrderedDict[str, float] = OrderedDict()      # id -> expiry
        self._stamps: dict[str, dict[str, float]] = {}          # header -> value -> expiry

    def __bool__(self) -> bool:
        return bool(self._ids or self._stamps)

    # ------------------------------------------------------------------ adding
    def revoke_ids(self, ids: Iterable[str]) -> dict[str, float]:
        """Revoke ``ids`` from now on; returns the entries to share."""
        until = self.clock() + self.expires
        entries = {ID + task_id: until for task_id in ids}
        self.merge(entries)
        return entries

    def revoke_stamps(self, headers: Mapping[str, Any]) -> dict[str, float]:
        """Revoke every task stamped ``header`` with one of the values (a value or a list)."""
        until = self.clock() + self.expires
        entries = {STAMP + json.dumps([header, value], default=str): until
                   for header, values in headers.items() for value in _values(values)}
        self.merge(entries)
        return entries

    def merge(self, entries: Mapping[str, float]) -> None:
        """Entries from the shared store or another worker (unreadable ones are skipped)."""
        now = self.clock()
        for entry, until in entries.items():
            if until <= now:
                continue
            if entry.startswith(ID):
                task_id = entry[len(ID):]
                until = max(until, self._ids.pop(task_id, 0.0))
                self._ids[task_id] = until
            elif entry.startswith(STAMP):
                try:
                    header, value = json.loads(entry[len(STAMP):])
                except (ValueError, TypeError):
                    continue
                values = self._stamps.setdefault(str(header), {})
                key = _stamp_key(value)
                values[key] = max(until, values.get(key, 0.0))
        while len(self._ids) > self.maxlen:
            self._ids.popitem(last=False)

    # ------------------------------------------------------------------ reading
    def match(self, task_id: str, headers: Mapping[str, Any]) -> str | None:
        """Why the task with ``task_id`` and message ``headers`` is revoked, or None."""
        if not self:
            return None
        now = self.clock()
        until = self._ids.get(task_id)
        if until is not None:
            if until > now:
                return "revoked"
            del self._ids[task_id]
        if not self._stamps:
            return None
        stamps = headers.get("stamps")          # Celery: {header: value} beside the list
        if not isinstance(stamps, Mapping):
            return None
        for header in _values(headers.get("stamped_headers") or ()):
            revoked = self._stamps.get(header) if isinstance(header, str) else None
            if not revoked or stamps.get(header) is None:
                continue
            for value in _values(stamps[header]):
                if revoked.get(_stamp_key(value), 0.0) > now:
                    return f"revoked by stamped header {header}={value!r}"
        return None

    def ids(self) -> list[str]:
        """The revoked ids not yet expired (``inspect revoked``)."""
        now = self.clock()
        return [task_id for task_id, until in self._ids.items() if until > now]

    def stamps(self) -> dict[str, list[Any]]:
        now = self.clock()
        return {header: [json.loads(key) for key, until in values.items() if until > now]
                for header, values in self._stamps.items()}
