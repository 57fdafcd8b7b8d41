"""Tasks: the decorated function plus its options, and how a call becomes a message."""
from __future__ import annotations

import inspect
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar

from .protocol import countdown_to_eta, utcnow

if TYPE_CHECKING:
    from .app import App
    from .result import AsyncResult


@dataclass
class Context:
    """``self.request`` inside a bound task: what the running message said."""

    id: str | None = None
    task: str | None = None
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    retries: int = 0
    root_id: str | None = None
    parent_id: str | None = None
    group: str | None = None
    origin: str | None = None
    eta: datetime | None = None
    expires: datetime | None = None
    hostname: str | None = None
    delivery_info: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, Any] = field(default_factory=dict)
    timelimit: tuple[float | None, float | None] = (None, None)
    called_directly: bool = True


#: Contexts of the tasks running in this process, innermost last (a child runs one at a
#: time; the stack is for tasks called directly from other tasks).
_running: list[Context] = []


def current_context() -> Context | None:
    """The request of the task running in this process, if any: the parent of what it sends."""
    return _running[-1] if _running else None


class Task:
    """A registered task. Options left ``None`` fall back to the configuration.

    Subclass it and pass ``base=`` to ``app.task`` to share options between tasks.
    """

    name: str = ""
    app: App
    bind: bool = False
    # Options; None means "the configured default".
    acks_late: bool | None = None
    reject_on_worker_lost: bool | None = None
    acks_on_failure: bool | None = None
    acks_on_timeout: bool | None = None
    max_deliveries: int | None = None
    time_limit: float | None = None
    soft_time_limit: float | None = None
    track_started: bool | None = None
    ignore_result: bool = False
    queue: str | None = None
    priority: int | None = None
    #: Check call arguments against the function's signature when sending.
    typing: bool = True

    OPTIONS: ClassVar[frozenset[str]] = frozenset({
        "acks_late", "reject_on_worker_lost", "acks_on_failure", "acks_on_timeout",
        "max_deliveries", "time_limit", "soft_time_limit", "track_started", "ignore_result",
        "queue", "priority", "typing",
    })

    def __init__(self, app: App, fun: Callable[..., Any], name: str, bind: bool,
                 options: Mapping[str, Any]) -> None:
        unknown = set(options) - self.OPTIONS
        if unknown:
            raise TypeError(f"task {name}: unknown option(s) {', '.join(sorted(unknown))}; "
                            f"accepted: {', '.join(sorted(self.OPTIONS))}")
        self.app = app
        self.name = name
        self.run = fun
        self.bind = bind  # type: ignore[misc]
        self._stack: list[Context] = []
        for key, value in options.items():
            setattr(self, key, value)
        self.__doc__ = fun.__doc__
        self.__wrapped__ = fun

    # -- running
    @property
    def request(self) -> Context:
        return self._stack[-1] if self._stack else Context()

    def push_request(self, context: Context) -> None:
        self._stack.append(context)
        _running.append(context)

    def pop_request(self) -> None:
        self._stack.pop()
        _running.pop()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the task body in this process, as a plain function call."""
        if self.bind:
            return self.run(self, *args, **kwargs)
        return self.run(*args, **kwargs)

    # -- sending
    def check_arguments(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Raise TypeError now, at the caller, rather than in the worker later."""
        try:
            signature = inspect.signature(self.run)
        except (TypeError, ValueError):
            return
        try:
            if self.bind:
                signature.bind(None, *args, **kwargs)
            else:
                signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{self.name}(): {exc}") from None

    def delay(self, *args: Any, **kwargs: Any) -> AsyncResult:
        return self.apply_async(args, kwargs)

    def apply_async(self, args: Sequence[Any] | None = None,
                    kwargs: Mapping[str, Any] | None = None, **options: Any) -> AsyncResult:
        """Send the task. Options: countdown, eta, expires, queue, priority, time_limit,
        soft_time_limit, task_id, headers, ignore_result, shadow."""
        args = _as_args(self.name, args)
        kwargs = _as_kwargs(self.name, kwargs)
        if self.typing:
            self.check_arguments(args, kwargs)
        for key in ("queue", "priority", "time_limit", "soft_time_limit"):
            if options.get(key) is None and getattr(self, key) is not None:
                options[key] = getattr(self, key)
        if options.get("ignore_result") is None and self.ignore_result:
            options["ignore_result"] = True
        return self.app.send_task(self.name, args, kwargs, **options)

    def AsyncResult(self, task_id: str) -> AsyncResult:  # noqa: N802 - Celery's name
        return self.app.AsyncResult(task_id)

    def __repr__(self) -> str:
        return f"<task {self.name}>"


def _as_args(name: str, args: Any) -> tuple[Any, ...]:
    if args is None:
        return ()
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise TypeError(f"{name}: args must be a list or tuple, not {type(args).__name__}")
    return tuple(args)


def _as_kwargs(name: str, kwargs: Any) -> dict[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"{name}: kwargs must be a mapping, not {type(kwargs).__name__}")
    return dict(kwargs)


def resolve_times(countdown: float | None, eta: datetime | None,
                  expires: float | datetime | None) -> tuple[datetime | None, datetime | None]:
    """Turn countdown/eta/expires call options into absolute UTC datetimes."""
    if countdown is not None and eta is not None:
        raise TypeError("give countdown or eta, not both")
    now = utcnow()
    if countdown is not None:
        eta = countdown_to_eta(float(countdown), now)
    if isinstance(expires, (int, float)) and not isinstance(expires, bool):
        expires = countdown_to_eta(float(expires), now)
    elif expires is not None and not isinstance(expires, datetime):
        raise TypeError(f"expires must be seconds or a datetime, not {expires!r}")
    return eta, expires


def new_task_id() -> str:
    return str(uuid.uuid4())
