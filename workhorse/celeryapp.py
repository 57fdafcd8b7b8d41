"""Running a Celery app's tasks on a workhorse worker, unchanged: ``workhorse worker -A
proj.celery:app`` where ``app`` is a ``celery.Celery``.

Each of the Celery app's tasks (but Celery's built-ins, which workhorse has of its own) is
registered in a workhorse App under its name, with its ack options, time limits and
``ignore_result``. workhorse takes, runs, stores and settles as for its own tasks; the task
body runs with Celery's request pushed, so ``self.request``, ``self.retry()``,
``self.replace()``, ``autoretry_for`` and ``current_task`` work as under a Celery worker,
and what the task sends goes through the Celery app (its broker and result settings must
name the same broker and store as the worker's). Celery's ``Retry``, ``Ignore`` and
``Reject`` are workhorse's outcomes of the same names; a Celery retry's RETRY state is
stored as a Celery worker stores it.

Celery is imported only by the user's module: nothing here imports it at module level.
"""
from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

from ._state import current_context
from .app import App
from .config import ConfigError
from .exceptions import Ignore, Reject, Retry
from .protocol import custom_headers
from .schedules.celery import beat_entries
from .task import is_async_function
from .schedules.entries import EntryError
from .urls import redact

#: Celery task attributes that are workhorse task options of the same meaning.
_OPTIONS = ("acks_late", "reject_on_worker_lost", "acks_on_failure_or_timeout", "time_limit",
            "soft_time_limit", "ignore_result", "track_started")


def is_celery_app(obj: object) -> bool:
    cls = type(obj)
    return cls.__module__.split(".", 1)[0] == "celery" and any(
        base.__name__ == "Celery" for base in cls.__mro__)


def from_celery(celery_app: Any, main: str | None = None) -> App:
    """A workhorse App whose tasks run the Celery app's. Settings come from workhorse's
    sources (config file, env, CLI) as for any App."""
    celery_app.finalize(auto=True)
    app = App(main or getattr(celery_app, "main", None) or "celery")
    app.celery_default_queue_type, app.celery_queue_types = _queue_types(celery_app)
    for name in ("broker_transport_options", "result_backend_transport_options"):
        options = celery_app.conf.get(name)
        if isinstance(options, dict) and options:
            app.celery_transport_options[name] = dict(options)
    try:
        app.celery_conf = {key: _shown(value) for key, value in
                           celery_app.conf.table(with_defaults=False).items()
                           if isinstance(key, str) and not key.startswith("__")}
    except Exception:  # noqa: BLE001 - only inspect conf reads it: workhorse's names then
        app.celery_conf = None
    try:
        app.celery_schedule = beat_entries(celery_app)
    except EntryError as exc:
        raise ConfigError(str(exc)) from None
    for name, task in sorted(celery_app.tasks.items()):
        if name in app.tasks or _celery_builtin(task):
            continue
        app.task(name=name, typing=False, **_options(task))(_runner(task))
    return app


def _shown(value: Any) -> Any:
    """A setting's value for a JSON reply: URLs without passwords, others as their repr."""
    if isinstance(value, str):
        return redact(value)
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, list | tuple | set | frozenset):
        return [_shown(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _shown(item) for key, item in value.items()}
    try:
        return repr(value)
    except Exception:  # noqa: BLE001 - an object that cannot show itself (a broken solar)
        return f"<{type(value).__name__}>"


def _celery_builtin(task: Any) -> bool:
    """One of Celery's own workflow tasks (celery.chord_unlock, celery.group, ...), which
    run Celery's machinery, not the app's code: workhorse has its own where it needs one.
    Other tasks named ``celery.*`` (``celery.contrib.testing``'s ``celery.ping``) are the
    app's, and registered like any other."""
    return getattr(getattr(task, "run", None), "__module__", "") == "celery.app.builtins"


def _queue_types(celery_app: Any) -> tuple[str | None, dict[str, str]]:
    """The Celery app's task_default_queue_type, and the x-queue-type its task_queues
    declare each of them with."""
    conf = celery_app.conf
    default = conf.get("task_default_queue_type")
    types: dict[str, str] = {}
    for queue in conf.get("task_queues") or ():
        kind = (getattr(queue, "queue_arguments", None) or {}).get("x-queue-type")
        if isinstance(kind, str) and getattr(queue, "name", None):
            types[queue.name] = kind
    return (default if isinstance(default, str) else None), types


def _options(task: Any) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for name in _OPTIONS:
        value = getattr(task, name, None)
        if value is None:
            continue
        if name == "acks_on_failure_or_timeout":
            options["acks_on_failure"] = options["acks_on_timeout"] = bool(value)
        elif name in ("time_limit", "soft_time_limit"):
            options[name] = float(value)
        else:
            options[name] = bool(value)
    if "soft_time_limit" in options and options.get("time_limit", float("inf")) <= options[
            "soft_time_limit"]:
        del options["soft_time_limit"]        # Celery allows it; workhorse refuses it
    return options


def _runner(task: Any) -> Callable[..., Any]:
    """The function workhorse calls: the Celery task's body, with Celery's request (an
    ``async def`` one for an async Celery task, whose request stack is then one per asyncio
    task: Celery's own is one per thread)."""
    run: Any
    if is_async_function(task.run):
        task.request_stack = _ContextStack()

        async def run_async(*args: Any, **kwargs: Any) -> Any:
            with _celery_call(task, args, kwargs):
                return await task.run(*args, **kwargs)
        run = run_async
    else:
        def run_sync(*args: Any, **kwargs: Any) -> Any:
            with _celery_call(task, args, kwargs):
                return task.run(*args, **kwargs)
        run = run_sync
    run.__name__ = task.name.rsplit(".", 1)[-1]
    run.__qualname__ = run.__name__
    try:   # what the task takes, for whoever asks (an errback's arity, as Celery's)
        run.__signature__ = inspect.signature(task.run)
    except (TypeError, ValueError):
        pass
    return run


@contextlib.contextmanager
def _celery_call(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[None]:
    """Around a Celery task's body: its request pushed, and Celery's Retry, Ignore and
    Reject made workhorse's."""
    from celery import exceptions as celery_exceptions   # the user's module imported it
    from celery._state import _task_stack
    context = current_context()
    task.push_request(**_celery_request(context, args, kwargs))
    _task_stack.push(task)
    try:
        yield
    except celery_exceptions.Retry as retry:
        if not task.ignore_result and context is not None and context.id:
            task.backend.mark_as_retry(context.id, retry.exc or retry, request=task.request)
        raise Retry(str(retry), exc=retry.exc, when=retry.when) from retry
    except celery_exceptions.Ignore as ignore:
        raise Ignore(*ignore.args) from ignore
    except celery_exceptions.Reject as reject:
        raise Reject(reject.reason, requeue=bool(reject.requeue)) from reject
    finally:
        _task_stack.pop()
        task.pop_request()


class _ContextStack:
    """Celery's request stack (push, pop, top) kept in a context variable: each asyncio
    task sees the requests it pushed, not those of the tasks beside it."""

    def __init__(self) -> None:
        self._var: ContextVar[tuple[Any, ...]] = ContextVar("celery.request_stack",
                                                            default=())

    def push(self, obj: Any) -> None:
        self._var.set((*self._var.get(), obj))

    def pop(self) -> Any:
        stack = self._var.get()
        if not stack:
            return None
        self._var.set(stack[:-1])
        return stack[-1]

    @property
    def top(self) -> Any:
        stack = self._var.get()
        return stack[-1] if stack else None

    @property
    def stack(self) -> list[Any]:
        return list(self._var.get())

    def __len__(self) -> int:
        return len(self._var.get())


def _celery_request(context: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                    ) -> dict[str, Any]:
    """Celery's request fields, from the message workhorse is running."""
    if context is None:
        return {"args": list(args), "kwargs": kwargs, "called_directly": True}
    headers = context.headers or {}
    return {
        "id": context.id, "task": context.task, "args": list(args), "kwargs": kwargs,
        "retries": context.retries, "root_id": context.root_id,
        "parent_id": context.parent_id, "group": context.group,
        "group_index": context.group_index, "origin": context.origin,
        "eta": headers.get("eta"), "expires": headers.get("expires"),
        "hostname": context.hostname, "delivery_info": context.delivery_info,
        # What a retry re-sends as custom headers: the producer's own, never the
        # protocol's (they would override the retry's id, retries, ...).
        "headers": custom_headers(headers), "timelimit": list(context.timelimit),
        "callbacks": context.callbacks, "errbacks": context.errbacks,
        "chain": context.chain, "chord": context.chord, "is_eager": False,
        "called_directly": False, "ignore_result": headers.get("ignore_result"),
        "replaced_task_nesting": headers.get("replaced_task_nesting", 0),
        "stamped_headers": headers.get("stamped_headers"), "stamps": headers.get("stamps"),
        "reply_to": (context.properties or {}).get("reply_to"),
        "correlation_id": (context.properties or {}).get("correlation_id"),
        "properties": context.properties,
        "schedule": context.schedule, "nominal_time": context.nominal_time,
    }
