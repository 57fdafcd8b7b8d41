"""The replies to Celery's ``inspect`` commands, from a snapshot of the worker.

The snapshot (``WorkerView``) is taken on the supervisor's loop thread; the replies are
built from it on the control thread, in the formats Celery's worker answers with, so
``celery inspect``, Flower and ``app.control.inspect()`` read them unchanged. A task's
arguments are read from a JSON body on the control thread when a reply is made (the
supervisor's loop never decodes a body); a body in another serializer is shown by the
producer's ``argsrepr``/``kwargsrepr`` headers.
"""
from __future__ import annotations

import json
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
    #: The message's body and content type: its arguments are read from them when a reply
    #: is made (on the remote-control thread), only for JSON; else the argsrepr above.
    body: Any = None
    content_type: str | None = None

    def arguments(self) -> tuple[Any, Any]:
        """(args, kwargs) as Celery 5's ``Request.info()`` gives them: the values, where the
        body is JSON (protocol 2's ``[args, kwargs, embed]``, or protocol 1's dict); else
        their repr strings from the headers."""
        if self.content_type == "application/json" and self.body is not None:
            try:
                body = json.loads(self.body)
                if isinstance(body, list) and len(body) >= 2:
                    return list(body[0]), dict(body[1])
                if isinstance(body, dict):
                    return list(body.get("args") or ()), dict(body.get("kwargs") or {})
            except (ValueError, TypeError):
                pass
        return self.args, self.kwargs

    def request(self, hostname: str) -> dict[str, Any]:
        """Celery's ``Request.info()``."""
        args, kwargs = self.arguments()
        return {
            "id": self.id, "name": self.name, "args": args, "kwargs": kwargs,
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
    #: The registered task objects by name (read, never changed), for ``registered``.
    task_objects: Mapping[str, Any] = field(default_factory=dict)
    clock: int = 0                       # the worker's Lamport clock
    #: A Celery app run with -A: its settings, for ``conf`` (None: a workhorse app).
    celery_conf: Mapping[str, Any] | None = None


Handler = Callable[..., Any]


def ping(view: WorkerView) -> dict[str, str]:
    return {"ok": "pong"}


#: What ``registered`` shows of each task unless asked for other attributes (Celery's).
TASK_INFO_ITEMS = ("exchange", "routing_key", "rate_limit")


def registered(view: WorkerView, taskinfoitems: Any = None, builtins: Any = False,
               **_: Any) -> list[str]:
    """The registered tasks, as Celery lists them: ``name [attr=value ...]`` with the
    attributes asked for (``exchange``, ``routing_key`` and ``rate_limit`` by default)
    that are set; the ``celery.*`` ones only with ``builtins``."""
    items = ((taskinfoitems,) if isinstance(taskinfoitems, str)
             else tuple(taskinfoitems or TASK_INFO_ITEMS))
    found = []
    for name in sorted(view.tasks):
        if name.startswith("celery.") and not builtins:
            continue
        task = view.task_objects.get(name)
        fields = {item: getattr(task, item, None) for item in items}
        shown = " ".join(f"{item}={value}" for item, value in fields.items()
                         if value is not None and item.isidentifier())
        found.append(f"{name} [{shown}]" if shown else name)
    return found


def clock(view: WorkerView, **_: Any) -> dict[str, int]:
    return {"clock": view.clock}


def active(view: WorkerView, safe: Any = None) -> list[dict[str, Any]]:
    return [t.request(view.hostname) for t in view.active]


def reserved(view: WorkerView, safe: Any = None) -> list[dict[str, Any]]:
    return [t.request(view.hostname) for t in view.reserved]


def scheduled(view: WorkerView, safe: Any = None) -> list[dict[str, Any]]:
    # "priority" is that of Celery's timer entry for an ETA task, which is always 6.
    return [{"eta": t.eta, "priority": 6, "request": t.request(view.hostname)}
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
        "total": dict(view.totals), "pid": view.pid, "clock": str(view.clock),
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


#: Celery's names for the workhorse settings that mean the same, for ``conf``.
CELERY_NAMES = {
    "broker_url": "broker_url", "result_backend": "result_backend",
    "concurrency": "worker_concurrency", "prefetch_multiplier": "worker_prefetch_multiplier",
    "max_tasks_per_child": "worker_max_tasks_per_child",
    "max_memory_per_child": "worker_max_memory_per_child", "acks_late": "task_acks_late",
    "reject_on_worker_lost": "task_reject_on_worker_lost", "time_limit": "task_time_limit",
    "soft_time_limit": "task_soft_time_limit", "track_started": "task_track_started",
    "result_expires": "result_expires", "result_extended": "result_extended",
    "send_events": "worker_send_task_events", "visibility_timeout": None,
}


def conf(view: WorkerView, with_defaults: Any = False, **_: Any) -> dict[str, Any]:
    """The worker's settings by workhorse's names, passwords in URLs hidden, and by
    Celery's: a Celery app's own (as its worker answers), else those of workhorse's that
    Celery has a name for."""
    found = dict(view.settings)
    if view.celery_conf is not None:
        celery = dict(view.celery_conf)
    else:
        celery = {name: view.settings[ours] for ours, name in CELERY_NAMES.items()
                  if name and ours in view.settings}
    for name, value in celery.items():
        found.setdefault(name, value)
    return found


def report(view: WorkerView, **_: Any) -> dict[str, str]:
    """Celery's bug report's first lines (the software, the platform, the broker and
    results), then workhorse's own."""
    import platform
    versions = [f"workhorse:{_version('workhorse')}", f"kombu:{_version('kombu')}",
                f"py:{platform.python_version()}", f"billiard:{_version('billiard')}"]
    celery = _version("celery")
    if celery != "?":           # the Celery library the tasks may come from, first
        versions.insert(0, f"celery:{celery}")
    lines = [f"software -> {' '.join(versions)}",
             f"platform -> system:{platform.system()} arch:{platform.machine()} "
             f"imp:{platform.python_implementation()}",
             f"settings -> transport:{view.broker.split('://', 1)[0]} "
             f"results:{view.settings.get('result_backend', '?')}", "",
             f"hostname: {view.hostname} (pid {view.pid})", f"broker_url: {view.broker}",
             f"queues: {', '.join(view.queues)}", f"concurrency: {view.concurrency}",
             f"uptime: {int(view.uptime)} s"]
    return {"ok": "\n".join(lines)}


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(package)
    except PackageNotFoundError:
        return "?"


#: Every command the mailbox answers, by Celery's name.
COMMANDS: dict[str, Handler] = {
    "ping": ping, "registered": registered, "clock": clock, "active": active,
    "reserved": reserved,
    "scheduled": scheduled, "query_task": query_task, "active_queues": active_queues,
    "stats": stats, "conf": conf, "report": report, "revoked": revoked,
}
