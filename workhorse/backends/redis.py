"""Results in Redis with Celery's key layout, so Celery clients read them unchanged."""
from __future__ import annotations

import os
import time
from typing import Any

import redis

from ..exceptions import TimeoutError
from ..states import READY_STATES
from .base import Backend
from .encoding import loads

KEY_PREFIX = "celery-task-meta-"


class RedisBackend(Backend):
    """``SETEX`` + ``PUBLISH`` in one MULTI/EXEC; waiting clients subscribe, then GET once."""

    def __init__(self, url: str, *, expires: float | None = None, extended: bool = False) -> None:
        super().__init__(url, expires=expires, extended=extended)
        self._client: redis.Redis | None = None
        self._pid = 0

    @property
    def client(self) -> redis.Redis:
        if self._client is None or self._pid != os.getpid():
            self._client = redis.Redis.from_url(self.url)
            self._pid = os.getpid()
        return self._client

    def close(self) -> None:
        if self._client is not None and self._pid == os.getpid():
            self._client.close()
        self._client = None

    @staticmethod
    def key(task_id: str) -> str:
        return KEY_PREFIX + task_id

    def _set(self, task_id: str, state: str, payload: str) -> None:
        key = self.key(task_id)
        with self.client.pipeline(transaction=True) as pipe:
            if self.expires:
                pipe.setex(key, max(1, int(self.expires)), payload)
            else:
                pipe.set(key, payload)
            pipe.publish(key, payload)
            pipe.execute()

    def _get(self, task_id: str) -> str | None:
        value = self.client.get(self.key(task_id))
        return value.decode() if isinstance(value, bytes) else value

    def _forget(self, task_id: str) -> None:
        self.client.delete(self.key(task_id))

    def wait_for(self, task_id: str, timeout: float | None = None,
                 interval: float = 0.5) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.subscribe(self.key(task_id))
            meta = self.get_task_meta(task_id)
            while meta["status"] not in READY_STATES:
                wait = interval if deadline is None else min(interval, deadline - time.monotonic())
                if wait <= 0:
                    raise TimeoutError(f"task {task_id} not ready after {timeout} s")
                message = pubsub.get_message(timeout=wait)
                if message is not None and message["type"] == "message":
                    meta = loads(message["data"])
                elif message is None:
                    # A missed publish (reconnect) must not leave us waiting forever.
                    meta = self.get_task_meta(task_id)
            return meta
        finally:
            pubsub.close()
