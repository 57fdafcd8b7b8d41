"""Result meta in Celery's layout, and exceptions that cross the wire safely.

Exceptions travel as ``{exc_type, exc_message, exc_module}`` (WIRE.md). Reading one back
never imports a module and never calls anything but an exception class: a name that is
not a loaded ``BaseException`` subclass becomes a synthesized exception class of that name.
"""
from __future__ import annotations

import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from kombu.utils.json import dumps, loads

from ..states import EXCEPTION_STATES, READY_STATES

__all__ = ["dumps", "loads", "encode_exception", "decode_exception", "build_meta"]

_synthesized: dict[tuple[str | None, str], type[BaseException]] = {}


def _json_safe(value: Any) -> Any:
    """Keep what JSON can hold; anything else becomes its repr (exception args only)."""
    try:
        dumps(value)
    except (TypeError, ValueError):
        return repr(value)
    return value


def encode_exception(exc: BaseException) -> dict[str, Any]:
    cls = type(exc)
    return {
        "exc_type": getattr(cls, "__qualname__", cls.__name__),
        "exc_message": [_json_safe(arg) for arg in exc.args],
        "exc_module": cls.__module__,
    }


def _synthesize(module: str | None, name: str) -> type[BaseException]:
    key = (module, name)
    cls = _synthesized.get(key)
    if cls is None:
        leaf = name.rsplit(".", 1)[-1] or "UnknownException"
        cls = type(leaf, (Exception,), {"__module__": module or __name__, "__qualname__": name})
        _synthesized[key] = cls
    return cls


def _resolve(module: str | None, name: str) -> type[BaseException]:
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
    cls = _resolve(module if isinstance(module, str) else None, name)
    try:
        return cls(*args)
    except Exception:  # noqa: BLE001 - a class whose __init__ wants other arguments
        exc = _synthesize(module, name)(*args)
        return exc


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
