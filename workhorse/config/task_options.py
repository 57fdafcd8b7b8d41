"""Task options (``@app.task(...)`` keywords and class attributes of ``Task`` subclasses),
checked when the task is defined, so a bad one stops the import instead of a worker.

An option that is also a setting is checked by that setting's declaration, as a Python
value: like a TOML value and unlike env or INI text, ``"3"`` is not 3 and ``"no"`` is not
False. The other options have checks of their own below.
"""
from __future__ import annotations

import difflib
import reprlib
from collections.abc import Callable, Mapping
from typing import Any

from ..ratelimit import parse_rate
from .settings import BY_NAME
from .types import Invalid

#: Options that are settings too; None (the default) means "the configured value", except
#: for max_retries, where None means "no limit".
SETTING_OPTIONS = ("acks_late", "reject_on_worker_lost", "acks_on_failure", "acks_on_timeout",
                   "max_deliveries", "async_concurrency", "time_limit", "soft_time_limit",
                   "track_started",
                   "max_retries", "default_retry_delay", "retry_backoff", "retry_backoff_max",
                   "retry_jitter")


class TaskOptionError(TypeError, ValueError):
    """A task option that cannot be used; the message names the task and the option.

    Both a TypeError (like an unexpected keyword) and a ValueError (like a bad value)."""


def _flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise Invalid("expected True or False")


def _queue(value: Any) -> str | None:
    if value is None or (isinstance(value, str) and value.strip()):
        return value
    raise Invalid("expected a queue name (a non-empty str), or None")


def _priority(value: Any) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)
                         and 0 <= value <= 255):
        return value
    raise Invalid("expected an integer from 0 to 255, or None")


def _exception_classes(value: Any) -> tuple[type[BaseException], ...]:
    classes = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    if all(isinstance(c, type) and issubclass(c, BaseException) for c in classes):
        return classes
    raise Invalid("expected an exception class or a tuple of them")


def _retry_kwargs(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if isinstance(value, Mapping) and all(isinstance(key, str) for key in value):
        return dict(value)
    raise Invalid("expected a dict of self.retry() keyword arguments, or None")


def _idempotent(value: Any) -> bool | Callable[..., Any]:
    if isinstance(value, bool) or callable(value):
        return value
    raise Invalid("expected True, False or a function of the task's arguments returning "
                  "its key")


def _rate_limit(value: Any) -> float | None:
    try:
        return parse_rate(value)
    except ValueError as exc:
        raise Invalid(str(exc)) from None


OWN_CHECKS: dict[str, Callable[[Any], Any]] = {
    "ignore_result": _flag, "typing": _flag, "queue": _queue, "priority": _priority,
    "autoretry_for": _exception_classes, "dont_autoretry_for": _exception_classes,
    "retry_kwargs": _retry_kwargs, "idempotent": _idempotent, "rate_limit": _rate_limit,
}

#: Every option a task takes, besides the decorator's name, bind and base.
TASK_OPTIONS = frozenset(SETTING_OPTIONS) | frozenset(OWN_CHECKS)


def check_option(name: str, value: Any) -> Any:
    """The option's value as the task keeps it (time limits as floats, ...); raises
    Invalid saying what is accepted."""
    if name in OWN_CHECKS:
        return OWN_CHECKS[name](value)
    return None if value is None else BY_NAME[name].type.parse_native(value)


def check_options(owner: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """Every option checked; ``owner`` ("task app.add") starts each error message.

    Unknown options are errors: kept as attributes, as Celery keeps them, a misspelt
    ``acks_lat=True`` would be ignored without a word."""
    checked = {}
    for name, value in options.items():
        if name not in TASK_OPTIONS:
            close = difflib.get_close_matches(name, sorted(TASK_OPTIONS), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise TaskOptionError(
                f"{owner}: unknown option {name}{hint}; task options: "
                f"{', '.join(sorted(TASK_OPTIONS))}; other attributes belong on a Task subclass "
                "given as base=")
        try:
            checked[name] = check_option(name, value)
        except Invalid as exc:
            raise invalid(owner, name, str(exc), value) from None
    return checked


def invalid(owner: str, option: str, complaint: str, value: Any) -> TaskOptionError:
    """The error for a bad value: ``task app.add: option x: expected ..., got '3' (a str)``."""
    return TaskOptionError(f"{owner}: option {option}: {complaint}, got {_show(value)}")


def check_time_limits(owner: str, soft: float | None, hard: float | None) -> None:
    if soft is not None and hard is not None and soft >= hard:
        raise TaskOptionError(f"{owner}: time_limit ({_number(hard)}) must be greater than "
                              f"soft_time_limit ({_number(soft)})")


def _show(value: Any) -> str:
    if value is None:
        return "None"
    kind = type(value).__name__
    return f"{reprlib.repr(value)} ({'an' if kind[0] in 'aeiou' else 'a'} {kind})"


def _number(value: float) -> str:
    return str(int(value)) if value == int(value) else str(value)
