"""The application object: configuration, the task registry, and sending tasks."""
from __future__ import annotations

import contextlib
import inspect
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar, overload

from kombu import Connection, Producer
from kombu.exceptions import EncodeError

from ._state import current_app, current_context, new_task_id, set_current_app
from .backends import Backend, RetryPolicy, backend_from_url
from .builtins import register_builtins
from .config import SETTINGS, ConfigError, Settings, check_master_names, load_settings
from .config.types import QUEUE_TYPES
from .config.task_options import invalid
from .forksafe import abandon
from .protocol import DEAD_SUFFIX, build_message
from .broker.connection import BROKER_TIMEOUT, FailoverConnection, open_connection
from .broker.queues import ensure_queue
from .result import AsyncResult, GroupResult, ResultCache
from .task import Task, resolve_times
from .transport.rabbitmq import BrokerBlocked

if TYPE_CHECKING:
    from .schedules.entries import Entry
    from .canvas import Signature

__all__ = ["App", "BROKER_TIMEOUT", "PUBLISH_RETRY_POLICY", "SEND_OPTIONS", "current_app",
           "result_retry_policy"]

_SETTING_NAMES = frozenset(s.name for s in SETTINGS)

#: How hard a producer tries before ``apply_async`` raises: the caller decides what a
#: broker outage means for its request, so we do not hang it for long.
PUBLISH_RETRY_POLICY = {"max_retries": 3, "interval_start": 0.1, "interval_step": 0.5,
                        "interval_max": 1.0}


class App:
    """Holds settings and tasks. ``App("name", broker_url=..., config_file=...)``.

    Keyword arguments are settings (see docs/settings.md); a config file, env vars and the
    worker's command line override them, in that order.
    """

    #: The options a signature may carry into ``send_task`` (the rest are Celery's own, such
    #: as ``exchange``); set below, from send_task's signature.
    SEND_OPTIONS: ClassVar[frozenset[str]]

    def __init__(self, main: str | None = None, *,
                 config_file: str | os.PathLike[str] | None = None, **settings: Any) -> None:
        unknown = set(settings) - _SETTING_NAMES
        if unknown:
            raise ConfigError(
                f"App(...) keyword {sorted(unknown)[0]!r} is not a setting; "
                "see docs/settings.md for the settings")
        self.main = main
        self.config_file = config_file
        self.code_settings: dict[str, Any] = dict(settings)
        self.tasks: dict[str, Task] = {}
        self._settings: Settings | None = None
        self._lock = threading.Lock()
        self._pid = 0
        self._producer_connection: Connection | None = None
        self._queues_ready: set[str] = set()
        self._backend: Backend | None = None
        #: What a Celery app run with -A declares its queues as (its task_queues'
        #: x-queue-type, its task_default_queue_type): see ``queue_type``.
        self.celery_queue_types: dict[str, str] = {}
        self.celery_default_queue_type: str | None = None
        #: A Celery app's broker_transport_options and result_backend_transport_options
        #: (under -A), used where workhorse's settings of those names are not set.
        self.celery_transport_options: dict[str, dict[str, Any]] = {}
        #: A Celery app's beat_schedule (under -A), as schedule entries; the config
        #: files' entries of the same names replace them.
        self.celery_schedule: list[Entry] = []
        #: A Celery app's settings, as its worker's ``inspect conf`` shows them (passwords
        #: in URLs hidden); None for a workhorse app.
        self.celery_conf: dict[str, Any] | None = None
        self.result_cache = ResultCache()
        register_builtins(self)
        set_current_app(self)

    # -- configuration
    @property
    def settings(self) -> Settings:
        if self._settings is None:
            settings = load_settings(config_file=self.config_file, code=self.code_settings)
            check_master_names(settings, self.celery_transport_options)
            self._settings = settings
        return self._settings

    def configure(self, settings: Settings | None = None) -> None:
        """Install settings resolved elsewhere (the worker: with its config file, env, CLI);
        ``None`` re-reads them from their sources on next use."""
        if settings is not None:
            check_master_names(settings, self.celery_transport_options)
        self.close()
        self._settings = settings
        self.result_cache = ResultCache()

    # -- tasks
    @overload
    def task(self, fun: Callable[..., Any]) -> Task: ...
    @overload
    def task(self, *, name: str | None = None, bind: bool = False, base: type[Task] | None = None,
             **options: Any) -> Callable[[Callable[..., Any]], Task]: ...

    def task(self, fun: Callable[..., Any] | None = None, *, name: str | None = None,
             bind: bool = False, base: type[Task] | None = None,
             **options: Any) -> Task | Callable[[Callable[..., Any]], Task]:
        """Register a function as a task: ``@app.task`` or ``@app.task(name=..., bind=True)``."""
        def register(f: Callable[..., Any]) -> Task:
            task_name = name if isinstance(name, str) and name.strip() else self._default_name(f)
            _check_decorator(f"task {task_name}", name, bind, base)
            if task_name in self.tasks:
                raise ValueError(f"task {task_name!r} is already registered")
            task = (base or Task)(self, f, task_name, bind, options)
            self.tasks[task_name] = task
            return task
        return register(fun) if fun is not None else register

    def _default_name(self, fun: Callable[..., Any]) -> str:
        module = fun.__module__
        if module == "__main__" and self.main:
            module = self.main
        return f"{module}.{fun.__qualname__}"

    # -- results
    @property
    def backend(self) -> Backend:
        self._check_fork()
        if self._backend is None:
            self._backend = self.new_backend()
        return self._backend

    def new_backend(self) -> Backend:
        """A result store object of its own, as configured (for another thread)."""
        s = self.settings
        return backend_from_url(
            s.result_backend, expires=s.result_expires, extended=s.result_extended,
            retry=result_retry_policy(s),
            transport_options=self.transport_options("result_backend_transport_options"),
            connection=self.connection)

    # -- broker
    def queue_type(self, queue: str) -> str:
        """The type ``queue`` is declared with on RabbitMQ when it does not exist: as the
        queues setting writes it beside the name, else as a Celery app run with -A declares
        it (unless the queue_type setting is set), else queue_type. A dead-letter queue
        has its queue's type."""
        settings = self.settings
        queue = queue.removesuffix(DEAD_SUFFIX)
        for listed in settings.queues:
            if listed == queue and getattr(listed, "queue_type", None):
                return str(listed.queue_type)
        if settings.source("queue_type") == "default":
            celery = self.celery_queue_types.get(queue, self.celery_default_queue_type)
            if celery in QUEUE_TYPES:
                return str(celery)
        return str(settings.queue_type)

    def connection(self, heartbeat: float = 0) -> FailoverConnection:
        """A new, unconnected kombu Connection to the configured broker. ``heartbeat``
        (RabbitMQ): only for a connection whose owner calls ``heartbeat_check``."""
        return open_connection(self.settings, heartbeat,
                               self.transport_options("broker_transport_options"))

    def transport_options(self, name: str) -> dict[str, Any]:
        """``broker_transport_options`` or ``result_backend_transport_options``: the
        setting where it is set, else a Celery app's (under -A), else none."""
        settings = self.settings
        if settings.source(name) == "default":
            return dict(self.celery_transport_options.get(name) or {})
        return dict(settings[name])

    def send_task(self, name: str, args: Sequence[Any] | None = None,
                  kwargs: Mapping[str, Any] | None = None, *,
                  countdown: float | None = None, eta: datetime | None = None,
                  expires: float | datetime | None = None, queue: str | None = None,
                  priority: int | None = None, time_limit: float | None = None,
                  soft_time_limit: float | None = None, task_id: str | None = None,
                  headers: Mapping[str, Any] | None = None, ignore_result: bool | None = None,
                  shadow: str | None = None, retries: int = 0,
                  link: Signature | Sequence[Signature] | None = None,
                  link_error: Signature | Sequence[Signature] | None = None,
                  chain: Sequence[Mapping[str, Any]] | None = None,
                  chord: Mapping[str, Any] | None = None,
                  root_id: str | None = None, parent_id: str | None = None,
                  group_id: str | None = None, group_index: int | None = None,
                  reply_to: str | None = None) -> AsyncResult:
        """Publish a protocol v2 message for task ``name`` and return its AsyncResult.

        ``link``/``link_error``: signatures to apply on success / call on failure.
        ``root_id``/``parent_id`` default to the task this is sent from, if any.
        ``reply_to``: the queue rpc:// sends its states to (a retry keeps its sender's);
        by default, with rpc://, this process's own."""
        if priority is not None and not (isinstance(priority, int) and 0 <= priority <= 255):
            raise ValueError(f"{name}: priority must be an integer from 0 to 255, not {priority!r}")
        for what, limit in (("time_limit", time_limit), ("soft_time_limit", soft_time_limit)):
            if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float))
                                      or limit <= 0):
                raise ValueError(f"{name}: {what} must be a positive number, not {limit!r}")
        if time_limit and soft_time_limit and soft_time_limit >= time_limit:
            raise ValueError(f"{name}: time_limit ({time_limit}) must be greater than "
                             f"soft_time_limit ({soft_time_limit})")
        eta, expires_at = resolve_times(countdown, eta, expires)
        task_id = task_id or new_task_id()
        parent = current_context()
        message = build_message(
            name, task_id, list(args or ()), dict(kwargs or {}),
            eta=eta, expires=expires_at, retries=retries,
            time_limit=time_limit, soft_time_limit=soft_time_limit,
            root_id=root_id or (parent.root_id if parent else None),
            parent_id=parent_id or (parent.id if parent else None),
            group=group_id, group_index=group_index,
            callbacks=_signatures(link), errbacks=_signatures(link_error),
            chain=[dict(s) for s in chain] if chain else None,
            chord=dict(chord) if chord else None,
            ignore_result=ignore_result, shadow=shadow, extra_headers=headers)
        properties = dict(message.properties)
        # Celery also sets the AMQP `expiration` property; RabbitMQ then drops the expired
        # message by itself, silently, and the task stays PENDING forever. workhorse leaves
        # expiry to the worker, which records REVOKED and acks (docs/delivery.md).
        properties.pop("expiration", None)
        if reply_to:
            properties["reply_to"] = reply_to
        elif self.settings.result_backend.startswith("rpc://") and not ignore_result:
            # rpc://: the states come back to this process's own reply queue.
            properties["reply_to"] = self.backend.reply_to()  # type: ignore[attr-defined]
        queue_name = queue or self.settings.queues[0]
        try:
            self._publish(queue_name, message.body, message.headers, priority, properties)
        except EncodeError as exc:
            raise TypeError(f"{name}: arguments cannot be sent as JSON: {exc}") from None
        result = AsyncResult(task_id, app=self)
        if parent is not None:
            parent.children.append(result)
        return result

    def _publish(self, queue: str, body: Any, headers: dict[str, Any], priority: int | None,
                 properties: dict[str, Any]) -> None:
        self._check_fork()
        with self._lock:
            if self._producer_connection is None:
                self._producer_connection = self.connection()
                self._queues_ready = set()
            connection = self._producer_connection
            try:
                if queue not in self._queues_ready:
                    connection.ensure_connection(**PUBLISH_RETRY_POLICY)

                    def declare() -> None:
                        ensure_queue(connection, queue, self.queue_type(queue))
                    # Retried as the publish is, and raised as kombu's OperationalError in
                    # the end, as the publish's errors are (a lost connection; the SQLite
                    # file in trouble, as when it was deleted a moment ago).
                    connection.ensure(connection, declare, **PUBLISH_RETRY_POLICY)()
                    self._queues_ready.add(queue)
                Producer(connection).publish(
                    body, exchange="", routing_key=queue, serializer="json", headers=headers,
                    priority=priority, delivery_mode=2, timeout=BROKER_TIMEOUT,
                    retry=True, retry_policy=PUBLISH_RETRY_POLICY, **properties)
            except (EncodeError, BrokerBlocked):
                raise           # the connection is fine (a blocked one learns of the unblock)
            except Exception:
                # The next send starts on a new connection: this one may be unusable (an
                # unconfirmed publish leaves a confirm owed on it).
                self._producer_connection = None
                with contextlib.suppress(Exception):
                    connection.release()
                raise

    # -- lifecycle
    def _check_fork(self) -> None:
        # Connections never cross fork(): a child starts with its own.
        if self._pid != os.getpid():
            self._pid = os.getpid()
            abandon(self._producer_connection)
            abandon(self._backend)
            self._producer_connection = None
            self._backend = None

    def close(self) -> None:
        """Close broker and result connections held by this process."""
        if self._pid == os.getpid():
            if self._producer_connection is not None:
                self._producer_connection.release()
            if self._backend is not None:
                self._backend.close()
        self._producer_connection = None
        self._backend = None

    def __repr__(self) -> str:
        return f"<workhorse.App {self.main or '__main__'} tasks={len(self.tasks)}>"

    # -- Celery's result constructors; last in the class because from here on their names
    # hide the classes in annotations.
    def GroupResult(self, group_id: str, results: Sequence[AsyncResult]) -> GroupResult:
        return GroupResult(group_id, results, app=self)

    def AsyncResult(self, task_id: str) -> AsyncResult:
        return AsyncResult(task_id, app=self)


def _check_decorator(owner: str, name: object, bind: object, base: object) -> None:
    """The decorator's own keywords; Task checks the options."""
    if name is not None and not (isinstance(name, str) and name.strip()):
        raise invalid(owner, "name", "expected a non-empty str, or None", name)
    if not isinstance(bind, bool):
        raise invalid(owner, "bind", "expected True or False", bind)
    if base is not None and not (isinstance(base, type) and issubclass(base, Task)):
        raise invalid(owner, "base", "expected a Task subclass, or None", base)


def result_retry_policy(settings: Settings) -> RetryPolicy:
    """The result_backend_* retry settings as a policy."""
    return RetryPolicy(
        always_retry=settings.result_backend_always_retry,
        max_retries=settings.result_backend_max_retries,
        base_sleep=settings.result_backend_base_sleep_between_retries_ms / 1000,
        max_sleep=settings.result_backend_max_sleep_between_retries_ms / 1000)


def _signatures(value: Signature | Sequence[Signature] | None) -> list[dict[str, Any]] | None:
    """Signatures as the plain dicts the wire carries (None when there are none)."""
    if value is None:
        return None
    items = [value] if isinstance(value, Mapping) else list(value)
    return [dict(item) for item in items] or None


App.SEND_OPTIONS = frozenset(inspect.signature(App.send_task).parameters) - {
    "self", "name", "args", "kwargs"}
SEND_OPTIONS = App.SEND_OPTIONS
