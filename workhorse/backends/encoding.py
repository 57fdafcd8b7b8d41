"""Result meta in Celery's layout, and exceptions that cross the wire safely.

Exceptions travel as ``{exc_type, exc_message, exc_module}`` (WIRE.md). Reading one back
never imports a module and never calls anything but an exception class: a name that is
not a loaded ``BaseException`` subclass becomes a synthesized exception class of that name.

Encoding a task's value runs code the task chose (``__json__``, ``__repr__``) and can fail
in any way (RecursionError for a deeply nested list): what cannot be encoded is replaced
by its repr, or refused as a whole, never raised as if the store had failed.
"""
from __future__ import annotations

import reprlib
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from kombu.utils.json import dumps, loads

from ..exceptions import CELERY_MODULE, CELERY_NAMED
from ..states import EXCEPTION_STATES, READY_STATES

__all__ = ["dumps", "loads", "encode_exception", "decode_exception", "resolve_exception",
           "build_meta", "safe_repr", "describe_exception"]

_synthesized: dict[tuple[str | None, str], type[BaseException]] = {}

#: How long a repr made in place of a value may get.
REPR_LIMIT = 2000

# Bounded in depth and size, and an object whose own repr raises is named, not raised.
_bounded = reprlib.Repr()
_bounded.maxlevel = 10
_bounded.maxstring = _bounded.maxother = _bounded.maxlong = REPR_LIMIT


def safe_repr(value: Any) -> str:
    """``repr(value)`` cut to ``REPR_LIMIT``; one that fails (too deep, a raising
    ``__repr__``) gives way to a depth-bounded one. Never raises."""
    if isinstance(value, BaseException):
        return describe_exception(value)
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - the value's own code, failing in its own way
        text = _bounded_repr(value)
    return text[:REPR_LIMIT]


def describe_exception(exc: BaseException) -> str:
    """``ValueError('bad', 42)`` for any exception, whatever its args hold. Never raises."""
    try:
        text = repr(exc)
    except Exception:  # noqa: BLE001 - its args' reprs, failing in their own way
        args = exc.args
        inner = _bounded_repr(args[0]) if len(args) == 1 else _bounded_repr(args)[1:-1]
        text = f"{type(exc).__name__}({inner})"
    return text[:REPR_LIMIT]


def _bounded_repr(value: Any) -> str:
    try:
        return _bounded.repr(value)
    except Exception:  # noqa: BLE001 - reprlib still calls repr() on ints (too many digits)
        return f"<{type(value).__name__} that cannot be shown>"


def _json_safe(value: Any) -> Any:
    """Keep what JSON can hold; anything else becomes its repr (exception args only)."""
    try:
        dumps(value)
    except Exception:  # noqa: BLE001 - encoding runs the value's code (__json__): any error
        return safe_repr(value)
    return value


#: workhorse's classes that Celery has too travel under Celery's module (exceptions.py).
_TO_WIRE = {cls: CELERY_MODULE for cls in CELERY_NAMED}
_FROM_WIRE = {(CELERY_MODULE, cls.__name__): cls for cls in CELERY_NAMED}


def encode_exception(exc: BaseException) -> dict[str, Any]:
    cls = type(exc)
    return {
        "exc_type": getattr(cls, "__qualname__", cls.__name__),
        "exc_message": [_json_safe(arg) for arg in exc.args],
        "exc_module": _TO_WIRE.get(cls, cls.__module__),
    }


def _synthesize(module: str | None, name: str) -> type[BaseException]:
    key = (module, name)
    cls = _synthesized.get(key)
    if cls is None:
        leaf = name.rsplit(".", 1)[-1] or "UnknownException"
        cls = type(leaf, (Exception,), {"__module__": module or __name__, "__qualname__": name})
        _synthesized[key] = cls
    return cls


def resolve_exception(module: str | None, name: str, *,
                      refuse_loaded: bool = False) -> type[BaseException] | None:
    """The exception class ``module``.``name`` names: a loaded module's (never importing
    one), else a synthesized class of that name. ``refuse_loaded``: None where a loaded
    module defines the name as something other than an exception class."""
    own = _FROM_WIRE.get((module or "", name))
    if own is not None:
        return own
    obj: Any = sys.modules.get(module) if module else None
    if obj is None and module is None:
        obj = sys.modules["builtins"]
    if obj is not None:
        for part in name.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
    if isinstance(obj, type) and issubclass(obj, BaseException):
        return obj
    if refuse_loaded and obj is not None:
        return None
    return _synthesize(module, name)


def decode_exception(value: Any) -> BaseException:
    """Rebuild an exception stored by Celery or workhorse, without running stored code."""
    if isinstance(value, BaseException):
        return value
    if not isinstance(value, Mapping) or not isinstance(value.get("exc_type"), str):
        return Exception(value)
    module = value.get("exc_module")
    name = value["exc_type"]
    message = value.get("exc_message", ())
    args = tuple(message) if isinstance(message, (list, tuple)) else (message,)
    module = module if isinstance(module, str) else None
    cls = resolve_exception(module, name) or _synthesize(module, name)
    try:
        return cls(*args)
    except Exception:  # noqa: BLE001 - a class whose __init__ wants other arguments
        exc = _synthesize(module, name)(*args)
        return exc


def _is_result(value: Any) -> bool:
    return (callable(getattr(value, "as_tuple", None)) and isinstance(getattr(value, "id", None),
                                                                       str)
            and not isinstance(value, (tuple, list, dict, str)))


def build_meta(
    task_id: str,
    state: str,
    result: Any,
    traceback: str | None = None,
    *,
    request: Mapping[str, Any] | None = None,
    extended: bool = False,
) -> dict[str, Any]:
    """The stored meta, key for key as Celery's backends write it."""
    if state in EXCEPTION_STATES and isinstance(result, BaseException):
        result = encode_exception(result)
    elif _is_result(result):
        # A task that returns a workflow it started (an AsyncResult or GroupResult, ours or
        # Celery's) is stored as Celery stores it: the result's tuple form, which
        # result_from_tuple turns back into the result object.
        result = result.as_tuple()
    meta: dict[str, Any] = {
        "status": state,
        "result": result,
        "traceback": traceback,
        "children": [],
        "date_done": datetime.now(UTC).isoformat() if state in READY_STATES else None,
        "task_id": task_id,
    }
    if request:
        meta["children"] = list(request.get("children") or ())
        if request.get("group"):
            meta["group_id"] = request["group"]
        if request.get("parent_id"):
            meta["parent_id"] = request["parent_id"]
        if extended:
            meta.update({
                "name": request.get("task"),
                "args": request.get("args"),
                "kwargs": request.get("kwargs"),
                "worker": request.get("hostname"),
                "retries": request.get("retries"),
                "queue": (request.get("delivery_info") or {}).get("routing_key"),
            })
    return meta
