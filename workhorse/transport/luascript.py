"""A Redis Lua script called by its SHA1: shared by the Redis transport and result store."""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from redis.exceptions import NoScriptError


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
