"""When to retry: the back-off schedule, and which exceptions retry automatically. Pure."""
from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def retry_countdown(retries: int, *, backoff: bool | int, backoff_max: float, jitter: bool,
                    default_delay: float, rng: random.Random | None = None) -> float:
    """Seconds to wait before retry number ``retries + 1``.

    Without back-off: ``default_delay``. With it (``True`` = base 1, or an integer base):
    ``min(base × 2**retries, backoff_max)``, and with jitter a uniform draw in [0, that].
    """
    if backoff is False or backoff is None or backoff == 0:
        return float(default_delay)
    base = 1 if backoff is True else int(backoff)
    countdown = float(min(base * 2 ** retries, backoff_max))
    if jitter:
        countdown = (rng or random).uniform(0, countdown)
    return countdown


def should_autoretry(exc: BaseException, retry_for: Sequence[type[BaseException]],
                     dont_retry_for: Sequence[type[BaseException]]) -> bool:
    return isinstance(exc, tuple(retry_for)) and not isinstance(exc, tuple(dont_retry_for))


def retry_arguments(function: Callable[..., Any], original_args: Sequence[Any],
                    original_kwargs: Mapping[str, Any], args: Sequence[Any] | None,
                    kwargs: Mapping[str, Any] | None) -> tuple[list[Any], dict[str, Any]]:
    """The arguments a retry is sent with, as Celery 5.7 combines them.

    Neither given: the original ones. Both given: exactly those. Only ``args``: they
    replace the original positional ones, and original keyword arguments naming a
    parameter those now fill are dropped. Only ``kwargs``: an original positional argument
    whose parameter they name is replaced in place, the rest kept.
    """
    if args is None and kwargs is None:
        return list(original_args), dict(original_kwargs)
    if args is not None and kwargs is not None:
        return list(args), dict(kwargs)
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):     # no signature to read: as given, task checks follow
        return (list(original_args if args is None else args),
                dict(original_kwargs if kwargs is None else kwargs))
    if args is not None:
        positional = [p for p in parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        kept = dict(original_kwargs)
        for parameter in positional[:len(args)]:
            if parameter.kind is parameter.POSITIONAL_OR_KEYWORD:
                kept.pop(parameter.name, None)
        return list(args), kept
    assert kwargs is not None
    try:
        bound = inspect.signature(function).bind_partial(*original_args)
    except TypeError:
        return list(original_args), dict(kwargs)
    new = dict(kwargs)
    for name in list(new):
        if (name in bound.arguments
                and parameters[name].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD):
            bound.arguments[name] = new.pop(name)
    return list(bound.args), {**bound.kwargs, **new}
