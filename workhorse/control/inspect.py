"""The replies to Celery's ``inspect`` commands, from a snapshot of the worker.

The snapshot (``WorkerView``) is taken on the supervisor's loop thread; the replies are
built from it on the control thread, in the formats Celery's worker answers with, so
``celery inspect``, Flower and ``app.control.inspect()`` read them unchanged. A task's
arguments are shown as the producer's ``argsrepr``/``kwargsrepr`` headers: the supervisor
never decodes a body.
"""
from __future__ import annotations

import resource
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TaskInfo:
    """One held message, as ``inspect active/reserved/scheduled`` list it."""

    id: str
    name: str
    args: str
    kwargs: str
    queue: str
    redelivered: bool
    priority: int | None
    acknowledged: bool
    time_start: float | None = None     # wall clock, once a child runs it
    worker_pid: int | None = None
    eta: str | None = None               # ISO 8601, while it waits for its ETA

    def request(self, hostname: str) -> dict[str, Any]:
        """Celery's ``Request.info()``."""
        return {
            "id": self.id, "name": self.name, "args": self.args, "kwargs": self.kwargs,
            "type": self.name, "hostname": hostname, "time_start": self.time_start,
            "acknowledged": self.acknowledged,
            "delivery_info": {"exchange": "", "routing_key": self.queue,
                              "priority": self.priority, "redelivered": self.redelivered},
            "worker_pid": self.worker_pid,
        }


@dataclass(frozen=True)
class WorkerView:
    """What the replies are made of, taken at once on the loop thread."""

    hostname: str
    pid: int
    uptime: float
    tasks: Sequence[str]
    queues: Sequence[str]
    active: Sequence[TaskInfo] = ()
    reserved: Sequence[TaskInfo] = ()
    scheduled: Sequence[TaskInfo] = ()
    totals: Mapping[str, int] = field(default_factory=dict)
    concurrency: int = 0
    child_pids: Sequence[int] = ()
    max_tasks_per_child: int | None = None
    time_limits: tuple[float | None, float | None] = (None, None)   # (soft, hard)
    prefetch_count: int = 0
    broker: str = ""
    settings: Mapping[str, Any] = field(default_factory=dict)
    revoked: Sequence[str] = ()          # revoked ids, not yet expired


Handler = Callable[..., Any]


def ping(view: WorkerView) -> dict[str, str]:
    return {"ok": "pong"}


def registered(view: WorkerView, taskinfoitems: Any = None) -> list[str]:
    return sorted(view.tasks)


def active(view: WorkerView, safe: Any = None) -> list[dict[str, Any]]:
    return [t.request(view.hostname) for t in view.active]


def reserved(view: WorkerView, safe: Any = None) -> list[dict[str, Any]]:
    return [t.request(view.hostname) for t in view.reserved]


def scheduled(view: WorkerView, safe: Any = None) -> list[dict[str, Any]]:
    return [{"eta": t.eta, "priority": t.priority, "request": t.request(view.hostname)}
            for t in view.scheduled]


def query_task(view: WorkerView, ids: Any = None) -> dict[str, Any]:
    """``{id: [state, request]}`` for the ids held here (Celery's states: active,
    reserved, scheduled)."""
    wanted = {ids} if isinstance(ids, str) else set(ids or ())
    found: dict[str, Any] = {}
    for state, tasks in (("active", view.active), ("reserved", view.reserved),
                         ("scheduled", view.scheduled)):
        for task in tasks:
            if task.id in wanted:
                found[task.id] = [state, task.request(view.hostname)]
    return found


def revoked(view: WorkerView) -> list[str]:
    return list(view.revoked)


def active_queues(view: WorkerView) -> list[dict[str, Any]]:
    """Each consumed queue as kombu's ``Queue.as_dict(recurse=True)`` gives it."""
    return [{"name": name, "exchange": {"name": name, "type": "direct", "arguments": None,
                                        "durable": True, "passive": False,
                                        "auto_delete": False, "delivery_mode": None,
                                        "no_declare": False},
             "routing_key": name, "queue_arguments": None, "binding_arguments": None,
             "consumer_arguments": None, "durable": True, "exclusive": False,
             "auto_delete": False, "no_ack": False, "alias": None, "bindings": [],
             "no_declare": None, "expires": None, "message_ttl": None, "max_length": None,
             "max_length_bytes": None, "max_priority": None}
            for name in view.queues]


def stats(view: WorkerView) -> dict[str, Any]:
    """Celery's ``stats`` fields that mean something here."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "total": dict(view.totals), "pid": view.pid, "clock": "0",
        "uptime": int(view.uptime),
        "pool": {"implementation": "workhorse.prefork", "max-concurrency": view.concurrency,
                 "processes": list(view.child_pids),
                 "max-tasks-per-child": view.max_tasks_per_child or "N/A",
                 "put-guarded-by-semaphore": False,
                 "timeouts": [view.time_limits[0] or 0, view.time_limits[1] or 0],
                 "writes": {}},
        "prefetch_count": view.prefetch_count,
        "broker": {"url": view.broker},
        "rusage": {"utime": usage.ru_utime, "stime": usage.ru_stime,
                   "maxrss": usage.ru_maxrss, "minflt": usage.ru_minflt,
                   "majflt": usage.ru_majflt, "nvcsw": usage.ru_nvcsw,
                   "nivcsw": usage.ru_nivcsw, "inblock": usage.ru_inblock,
                   "oublock": usage.ru_oublock},
    }


def conf(view: WorkerView, with_defaults: Any = False) -> dict[str, Any]:
    """The worker's settings, passwords in URLs hidden."""
    return dict(view.settings)


def report(view: WorkerView) -> dict[str, str]:
    lines = [f"workhorse {view.hostname} (pid {view.pid})",
             f"broker: {view.broker}", f"queues: {', '.join(view.queues)}",
             f"concurrency: {view.concurrency}", f"uptime: {int(view.uptime)} s"]
    return {"ok": "\n".join(lines)}


#: Every command the mailbox answers, by Celery's name.
COMMANDS: dict[str, Handler] = {
    "ping": ping, "registered": registered, "active": active, "reserved": reserved,
    "scheduled": scheduled, "query_task": query_task, "active_queues": active_queues,
    "stats": stats, "conf": conf, "report": report, "revoked": revoked,
}
