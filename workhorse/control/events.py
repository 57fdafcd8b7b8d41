"""Celery's event stream: what a worker tells monitors (``celery events``, Flower).

Events are JSON dicts published to the ``celeryev`` exchange with the routing key
``<group>.<name>`` (``task.succeeded``): a ``type`` (``task-succeeded``), ``hostname``,
``timestamp`` (epoch seconds), ``utcoffset`` (hours, west positive, as Celery counts),
``pid``, a Lamport ``clock``, and the fields of their kind. Pure: no I/O.
"""
from __future__ import annotations

import os
import platform
import threading
import time
from datetime import datetime
from typing import Any

from .. import __version__

#: Worker events (online, heartbeat, offline) name their software, as Celery's do.
SOFTWARE = {"sw_ident": "py-workhorse", "sw_ver": __version__, "sw_sys": platform.system()}
#: Seconds between worker-heartbeat events (Celery's; monitors expect one in about this).
HEARTBEAT_INTERVAL = 2.0


def utcoffset() -> int:
    """Hours west of UTC, as Celery's ``utcoffset()`` gives it."""
    offset = time.altzone if time.daylight and time.localtime().tm_isdst else time.timezone
    return offset // 3600


class Clock:
    """The worker's Lamport clock: every event it sends ticks it, and a remote-control
    command's clock moves it past the sender's (as Celery's ``app.clock``). Shared by the
    events and remote-control threads."""

    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def forward(self) -> int:
        with self._lock:
            self.value += 1
            return self.value

    def adjust(self, other: int) -> int:
        with self._lock:
            self.value = max(self.value, other) + 1
            return self.value


def event(kind: str, hostname: str, clock: int, **fields: Any) -> dict[str, Any]:
    found = {"hostname": hostname, "utcoffset": utcoffset(), "pid": os.getpid(),
             "clock": clock, **fields}
    found.setdefault("timestamp", time.time())
    found["type"] = kind
    return found


def worker_fields(active: int, processed: int) -> dict[str, Any]:
    """worker-online/-heartbeat/-offline's own fields."""
    try:
        loadavg = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        loadavg = [0.0, 0.0, 0.0]
    return {"freq": HEARTBEAT_INTERVAL, "active": active, "processed": processed,
            "loadavg": loadavg, **SOFTWARE}


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def received_fields(headers: dict[str, Any] | Any, task_id: str, name: str, retries: int,
                    root_id: str | None, parent_id: str | None, eta: datetime | None,
                    expires: datetime | None) -> dict[str, Any]:
    """task-received's fields: the arguments as the producer's argsrepr/kwargsrepr show
    them (the supervisor never decodes a body)."""
    return {"uuid": task_id, "name": name, "args": headers.get("argsrepr") or "",
            "kwargs": headers.get("kwargsrepr") or "", "root_id": root_id,
            "parent_id": parent_id, "retries": retries, "eta": _iso(eta),
            "expires": _iso(expires)}


def routing_key(kind: str) -> str:
    return kind.replace("-", ".")
