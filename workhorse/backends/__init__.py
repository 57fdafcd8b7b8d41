"""Result backends, chosen by the URL in the ``result_backend`` setting."""
from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..urls import SENTINEL, as_redis, scheme_of
from .base import (Backend, ChordCompletion, ChordPart, Claim, DisabledBackend, RetryPolicy,
                   reply_of)
from .encoding import decode_exception, encode_exception

if TYPE_CHECKING:
    from kombu import Connection

__all__ = ["Backend", "ChordCompletion", "ChordPart", "Claim", "DisabledBackend", "RetryPolicy",
           "backend_from_url", "decode_exception", "encode_exception", "reply_of"]


def backend_from_url(url: str, *, expires: float | None = None, extended: bool = False,
                     retry: RetryPolicy | None = None,
                     transport_options: Mapping[str, Any] | None = None,
                     connection: Callable[[], Connection] | None = None) -> Backend:
    """``sqlite:///…``, ``redis://…``, ``rediss://…`` (also ``valkey://``, ``valkeys://``),
    a ``sentinel://`` list (``transport_options``: its ``master_name``, ``sentinel_kwargs``),
    ``db+<SQLAlchemy URL>`` (Celery's database store), ``rpc://`` (results sent to the
    sender's reply queue through the broker ``connection`` makes), ``disabled``, or
    ``pkg.module:Class``."""
    if url.startswith("rpc://"):
        from .rpc import RPCBackend
        return RPCBackend(url, expires=expires, extended=extended, retry=retry,
                          connection=connection)
    if url.startswith("db+"):
        from .database import DatabaseBackend
        return DatabaseBackend(url, expires=expires, extended=extended, retry=retry)
    url = as_redis(url)
    scheme = scheme_of(url) if "://" in url else ""
    if url == "disabled":
        return DisabledBackend(url)
    if scheme == "sqlite":
        from .sqlite import SQLiteBackend
        return SQLiteBackend(url, expires=expires, extended=extended, retry=retry)
    if scheme in ("redis", "rediss", SENTINEL):
        from .redis import RedisBackend
        return RedisBackend(url, expires=expires, extended=extended, retry=retry,
                            transport_options=transport_options)
    if not scheme and "." in url:
        module_name, _, attr = url.partition(":") if ":" in url else url.rpartition(".")
        cls = getattr(importlib.import_module(module_name), attr)
        if not (isinstance(cls, type) and issubclass(cls, Backend)):
            raise ValueError(f"result_backend {url!r} is not a workhorse Backend subclass")
        return cls(url, expires=expires, extended=extended, retry=retry)
    raise ValueError(
        f"result_backend {url!r}: expected sqlite:///<path>, redis://, rediss://, "
        "db+<SQLAlchemy URL>, rpc://, disabled "
        "or a Backend class path like package.module:Class")
