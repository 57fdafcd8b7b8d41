"""A Redis Lua script called by its SHA1: shared by the Redis transport and result store."""
from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Sequence
from typing import Any

from hiredis import pack_command
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError


class Script:
    """A Lua script run by its SHA1 (``EVALSHA``: its text is not sent, nor hashed by
    the server, on every call), sent whole once when the server does not know it yet."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()

    def __call__(self, client: Any, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:       # a restarted or flushed server: load it again
            return client.eval(self.text, len(keys), *keys, *args)


class Direct:
    """Scripts run on a connection of its own made from a client's pool, outside the pool:
    a pooled call costs three more system calls (a pid check, a non-blocking read to see
    the connection is clean, two mode switches) and most of the CPU of a round trip.
    A connection the server closed meanwhile (a restart) is found out by the call,
    dropped, and the call made once more on a new one, as redis-py's client retries a
    call after a connection error: a script run twice must do no harm. A forked process
    starts with a connection (and lock) of its own."""

    def __init__(self) -> None:
        self._start()

    def _start(self) -> None:
        self.lock = threading.Lock()
        self.connection: Any = None
        self.pool: Any = None
        self._pid = os.getpid()

    def run(self, pool: Any, script: Script, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        if self._pid != os.getpid():
            self._start()       # (the parent's socket and lock are the parent's)
        with self.lock:
            try:
                return self._run_once(pool, script, keys, args)
            except RedisConnectionError:
                return self._run_once(pool, script, keys, args)

    def _run_once(self, pool: Any, script: Script, keys: Sequence[Any],
                  args: Sequence[Any]) -> Any:
        connection = self.connection
        if connection is None or self.pool is not pool:
            connection = self.connection = pool.connection_class(**pool.connection_kwargs)
            self.pool = pool
        # Connected here, not by the first send: a Sentinel-managed connection finds the
        # master in connect() only (redis-py's send would connect it to localhost:6379).
        connection.connect()
        try:
            # Packed by hiredis's C function (redis-py's packer, in Python, took 3.6 µs
            # of a round trip for a take with three acks; this, 1.1), which packs what
            # ours pass (str, bytes, int) byte for byte as redis-py does.
            connection.send_packed_command(
                [pack_command(("EVALSHA", script.sha, len(keys), *keys, *args))])
            try:
                return connection.read_response()
            except NoScriptError:     # a restarted or flushed server: load it again
                connection.send_packed_command(
                    [pack_command(("EVAL", script.text, len(keys), *keys, *args))])
                return connection.read_response()
        except ResponseError:
            raise                     # an answer: the connection is in step
        except BaseException:
            connection.disconnect()
            raise

    def close(self) -> None:
        if self.connection is not None and self._pid == os.getpid():
            self.connection.disconnect()
