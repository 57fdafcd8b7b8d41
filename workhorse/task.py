"""Tasks: the decorated function plus its options, and how a call becomes a message."""
from __future__ import annotations

import inspect
from contextvars import ContextVar
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

from ._state import current_context, new_task_id, pop_context, push_context
from .backends import reply_of
from .canvas import Signature, chain, chord, copy_signature, group, signature
from .config.task_options import TASK_OPTIONS, TaskOptionError, check_options, check_time_limits
from .exceptions import Ignore, MaxRetriesExceededError, Retry
from .protocol import countdown_to_eta, custom_headers, utcnow
from .retrying import retry_arguments

if TYPE_CHECKING:
    from .app import App
    from .result import AsyncResult

__all__ = ["UNSET", "Context", "Task", "TaskOptionError", "current_context", "new_task_id",
           "resolve_times"]


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
    properties: dict[str, Any] = field(default_factory=dict)
    timelimit: tuple[float | None, float | None] = (None, None)
    called_directly: bool = True
    group_index: int | None = None
    priority: int | None = None
    queue: str | None = None
    callbacks: list[dict[str, Any]] | None = None
    errbacks: list[dict[str, Any]] | None = None
    chain: list[dict[str, Any]] | None = None
    chord: dict[str, Any] | None = None
    #: Results of the tasks this task sent while running (stored with its result).
    children: list[Any] = field(default_factory=list)
    #: Sent by a schedule: its name, and the due time this run is for (in its time zone).
    schedule: str | None = None
    nominal_time: datetime | None = None


def is_async_function(fun: Any) -> bool:
    """Is ``fun`` an ``async def`` function (or a callable object whose call is one)?"""
    return inspect.iscoroutinefunction(fun) or (
        callable(fun) and inspect.iscoroutinefunction(type(fun).__call__))


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


#: "Not set on the task": where None has a meaning of its own (max_retries = no limit).
UNSET: Any = _Unset()

#: Options whose None means something (no limit) rather than "use the configuration".
_NONE_IS_A_VALUE = frozenset({"max_retries"})

class Task:
    """A registered task. Options left ``None`` fall back to the configuration.

    Subclass it and pass ``base=`` to ``app.task`` to share options between tasks; options
    set as class attributes are checked when the subclass is defined.
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
    #: An async def task: at most this many at once in one child (None: the setting's).
    async_concurrency: int | None = None
    time_limit: float | None = None
    soft_time_limit: float | None = None
    track_started: bool | None = None
    ignore_result: bool = False
    queue: str | None = None
    priority: int | None = None
    #: Check call arguments against the function's signature when sending.
    typing: bool = True
    # Retries; None (UNSET for max_retries, where None means "no limit") = configuration.
    max_retries: int | None | object = UNSET
    default_retry_delay: float | None = None
    autoretry_for: tuple[type[BaseException], ...] = ()
    dont_autoretry_for: tuple[type[BaseException], ...] = ()
    retry_kwargs: dict[str, Any] | None = None
    retry_backoff: bool | int | None = None
    retry_backoff_max: float | None = None
    retry_jitter: bool | None = None
    #: Claim the task id (True) or ``f"{name}:{idempotent(*args, **kwargs)}"`` (a function)
    #: in the result store before running: no two runs at once, none after a success.
    idempotent: bool | Callable[..., Any] = False
    #: Starts per second in each worker (given as Celery's "10/m"), None: no limit.
    rate_limit: float | None = None

    OPTIONS: ClassVar[frozenset[str]] = TASK_OPTIONS

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        owner = f"Task subclass {cls.__module__}.{cls.__qualname__}"
        given = {key: value for key, value in vars(cls).items() if key in TASK_OPTIONS}
        for key, value in check_options(owner, given).items():
            setattr(cls, key, value)
        check_time_limits(owner, cls.soft_time_limit, cls.time_limit)

    def __init__(self, app: App, fun: Callable[..., Any], name: str, bind: bool,
                 options: Mapping[str, Any]) -> None:
        owner = f"task {name}"
        for key, value in check_options(owner, options).items():
            setattr(self, key, value)
        check_time_limits(owner, self.soft_time_limit, self.time_limit)
        self.app = app
        self.name = name
        self.run = fun
        self.bind = bind
        #: The requests of this task's runs in progress here, innermost last: a context
        #: variable, so each async run (an asyncio task of its own) sees its own.
        self._stack: ContextVar[tuple[Context, ...]] = ContextVar(f"workhorse.request.{name}",
                                                                  default=())
        #: An ``async def`` task: its child runs it on an event loop, many at once.
        self.is_async = is_async_function(fun)
        self.__doc__ = fun.__doc__
        self.__wrapped__ = fun

    # -- running
    @property
    def request(self) -> Context:
        stack = self._stack.get()
        return stack[-1] if stack else Context()

    def push_request(self, context: Context) -> None:
        self._stack.set((*self._stack.get(), context))
        push_context(context)

    def pop_request(self) -> None:
        self._stack.set(self._stack.get()[:-1])
        pop_context()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the task body in this process, as a plain function call."""
        if self.bind:
            return self.run(self, *args, **kwargs)
        return self.run(*args, **kwargs)

    def ignores_result(self, requested: Any) -> bool:
        """Is this call's result left unstored? The message's ``ignore_result`` header when
        it says (Celery's producers always do), else the task's option: Celery's rule."""
        return bool(self.ignore_result if requested is None else requested)

    def idempotency_key(self, task_id: str, args: Sequence[Any],
                        kwargs: Mapping[str, Any]) -> str | None:
        """The key an idempotent task claims for one call; None if it is not idempotent."""
        if self.idempotent is True:
            return task_id
        if callable(self.idempotent):
            return f"{self.name}:{self.idempotent(*args, **kwargs)}"
        return None

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

    def AsyncResult(self, task_id: str) -> AsyncResult:  # Celery's name
        return self.app.AsyncResult(task_id)

    # -- signatures
    def signature(self, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
                  **options: Any) -> Signature:
        return Signature(self, args, kwargs, options)

    def s(self, *args: Any, **kwargs: Any) -> Signature:
        """A partial call: more arguments (a previous task's result) may come first."""
        return Signature(self, args, kwargs)

    def si(self, *args: Any, **kwargs: Any) -> Signature:
        """An immutable call: exactly these arguments, whatever comes before it."""
        return Signature(self, args, kwargs, immutable=True)

    # -- configuration with fallbacks
    def option(self, name: str) -> Any:
        """The task's own value (decorator, then base class), else the configured one."""
        value = getattr(self, name)
        unset = value is UNSET or (value is None and name not in _NONE_IS_A_VALUE)
        return self.app.settings[name] if unset else value

    # -- retrying
    def retry(self, args: Sequence[Any] | None = None, kwargs: Mapping[str, Any] | None = None,
              exc: BaseException | None = None, throw: bool = True, eta: datetime | None = None,
              countdown: float | None = None, max_retries: int | None = None,
              **options: Any) -> Retry:
        """Send this task again (same id, ``retries + 1``) and raise Retry.

        The retry is published, and its RETRY state stored, before this returns or
        raises, so the worker acks the running message only once the retry is safe.
        Past ``max_retries`` (this call's, else the task's, else the configuration's; None
        = no limit): re-raise ``exc`` if given, else MaxRetriesExceededError.
        """
        request = self.request
        if request.called_directly or request.id is None:
            raise exc if exc is not None else Retry("task called directly: cannot be retried")
        retries = request.retries + 1
        limit = self.option("max_retries") if max_retries is None else max_retries
        call_args, call_kwargs = retry_arguments(
            partial(self.run, self) if self.bind else self.run, request.args or (),
            request.kwargs or {}, args, kwargs)
        if limit is not None and retries > limit:
            if exc is not None:
                raise exc
            raise MaxRetriesExceededError(
                f"Can't retry {self.name}[{request.id}] args:{call_args} kwargs:{call_kwargs}",
                task_args=call_args, task_kwargs=call_kwargs)
        if eta is None and countdown is None:
            countdown = self.option("default_retry_delay")
        when: Any = eta if eta is not None else countdown
        hard, soft = request.timelimit
        send: dict[str, Any] = dict(
            task_id=request.id, retries=retries, queue=request.queue, priority=request.priority,
            time_limit=hard, soft_time_limit=soft, root_id=request.root_id,
            parent_id=request.parent_id, group_id=request.group, group_index=request.group_index,
            link=request.callbacks, link_error=request.errbacks, chain=request.chain,
            chord=request.chord, expires=request.expires,
            ignore_result=request.headers.get("ignore_result"),
            headers=custom_headers(request.headers),
            reply_to=(request.properties or {}).get("reply_to") or None)
        send.update(options)
        eta_at, _ = resolve_times(countdown if eta is None else None, eta, None)
        if not self.ignores_result(request.headers.get("ignore_result")):
            self.app.backend.mark_as_retry(request.id, exc or Retry(when=when), retries=retries,
                                           eta=eta_at, request={"task": self.name,
                                                                "hostname": request.hostname,
                                                                **reply_of(request.properties)})
        self.app.send_task(self.name, call_args, call_kwargs, eta=eta_at, **send)
        signal = Retry(exc=exc, when=when)
        if throw:
            raise signal
        return signal

    # -- replacing
    def replace(self, sig: Signature) -> NoReturn:
        """Replace this running task by ``sig``, as Celery's ``Task.replace`` does.

        ``sig`` (its last task, for a chain; its body, for a chord; a group becomes a chord
        whose body gathers the group's results) takes over this task's id, so its result is
        this task's; it takes over its callbacks, error callbacks, place in a group or
        chord, and the rest of its chain. It is sent now, and this task ends with Ignore:
        its message is acked and nothing is stored for it (the replacement stores its result
        under the id). A crash between the two can send the replacement twice, never lose
        it.
        """
        request = self.request
        if request.called_directly or request.id is None:
            raise RuntimeError(f"task {self.name} called directly: it cannot be replaced")
        if sig.options.get("chord"):
            raise ValueError("a signature that replaces a task must not be part of a chord")
        if isinstance(sig, chain) and not sig.tasks:
            raise ValueError("a task cannot be replaced by an empty chain")
        replacement = copy_signature(sig, self.app)
        if isinstance(replacement, group):
            replacement = chord(replacement, self.app.tasks["celery.accumulate"].s(index=0),
                                app=self.app)
        last = replacement
        while isinstance(last, (chain, chord)):
            last = last.tasks[-1] if isinstance(last, chain) else last.kwargs["body"]
        nesting = (request.headers.get("replaced_task_nesting") or 0) + 1
        last.set(task_id=request.id, headers={"replaced_task_nesting": nesting})
        if request.group:
            last.set(group_id=request.group, group_index=request.group_index)
        if request.chord:
            last.set(chord=request.chord)
        for callback in request.callbacks or ():
            last.link(signature(callback, self.app))
        for errback in request.errbacks or ():
            replacement.link_error(signature(errback, self.app))
        if request.chain:
            replacement = chain(replacement, *(signature(step, self.app)
                                               for step in reversed(request.chain)),
                                app=self.app)
        replacement.apply_async(root_id=request.root_id)
        raise Ignore(f"replaced by {replacement!r}")

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

