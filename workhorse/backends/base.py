"""The result store interface every backend implements."""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from ..exceptions import ResultEncodeError, TaskRevokedError, TimeoutError
from ..states import FAILURE, PENDING, READY_STATES, RETRY, REVOKED, STARTED, SUCCESS
from .encoding import build_meta, dumps, loads

RequestInfo = Mapping[str, Any]


def pending_meta(task_id: str) -> dict[str, Any]:
    """What a task that has no stored result looks like (PENDING is never stored)."""
    return {"status": PENDING, "result": None, "traceback": None, "children": [],
            "date_done": None, "task_id": task_id}


class Backend(ABC):
    """Stores task results in Celery's layout and reads them back.

    Subclasses hold the storage: ``_set``, ``_get`` and ``_forget`` on encoded JSON text.
    A backend object is used from one process; each process opens its own connection.
    """

    def __init__(self, url: str, *, expires: float | None = None, extended: bool = False) -> None:
        self.url = url
        self.expires = expires or None
        self.extended = extended

    # -- storage, per backend
    @abstractmethod
    def _set(self, task_id: str, state: str, payload: str) -> None: ...

    @abstractmethod
    def _get(self, task_id: str) -> str | None: ...

    @abstractmethod
    def _forget(self, task_id: str) -> None: ...

    def close(self) -> None:
        """Release connections; the backend reconnects on next use."""

    # -- writing
    def store_result(self, task_id: str, result: Any, state: str,
                     traceback: str | None = None, request: RequestInfo | None = None,
                     extra: Mapping[str, Any] | None = None) -> None:
        meta = build_meta(task_id, state, result, traceback, request=request, extended=self.extended)
        if extra:
            meta.update(extra)
        try:
            payload = dumps(meta)
        except (TypeError, ValueError) as exc:
            raise ResultEncodeError(
                f"the {state} result of task {task_id} cannot be encoded as JSON: {exc}") from exc
        self._set(task_id, state, payload)

    def mark_as_started(self, task_id: str, request: RequestInfo | None = None) -> None:
        self.store_result(task_id, {"pid": None, "hostname": (request or {}).get("hostname")},
                          STARTED, request=request)

    def mark_as_done(self, task_id: str, result: Any, request: RequestInfo | None = None) -> None:
        self.store_result(task_id, result, SUCCESS, request=request)

    def mark_as_failure(self, task_id: str, exc: BaseException, traceback: str | None = None,
                        request: RequestInfo | None = None) -> None:
        self.store_result(task_id, exc, FAILURE, traceback, request=request)

    def mark_as_retry(self, task_id: str, exc: BaseException, traceback: str | None = None,
                      request: RequestInfo | None = None, *, retries: int | None = None,
                      eta: datetime | None = None) -> None:
        """RETRY, with the retry's number and when it is due (extra keys Celery ignores)."""
        self.store_result(task_id, exc, RETRY, traceback, request=request,
                          extra={"retries": retries, "eta": eta.isoformat() if eta else None})

    def mark_as_revoked(self, task_id: str, reason: str,
                        request: RequestInfo | None = None) -> None:
        self.store_result(task_id, TaskRevokedError(reason), REVOKED, request=request)

    def forget(self, task_id: str) -> None:
        self._forget(task_id)

    # -- reading
    def get_task_meta(self, task_id: str) -> dict[str, Any]:
        payload = self._get(task_id)
        return loads(payload) if payload else pending_meta(task_id)

    def wait_for(self, task_id: str, timeout: float | None = None,
                 interval: float = 0.5) -> dict[str, Any]:
        """Poll until the result is ready, starting fast and backing off to ``interval``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = min(0.005, interval)
        while True:
            meta = self.get_task_meta(task_id)
            if meta["status"] in READY_STATES:
                return meta
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"task {task_id} not ready after {timeout} s")
                delay = min(delay, remaining)
            time.sleep(delay)
            delay = min(delay * 2, interval)


class DisabledBackend(Backend):
    """``result_backend = "disabled"``: results are not stored and cannot be read."""

    def _set(self, task_id: str, state: str, payload: str) -> None:
        return None

    def _get(self, task_id: str) -> str | None:
        raise NotImplementedError(
            "results are disabled (result_backend = \"disabled\"): set result_backend "
            "to read task results")

    def _forget(self, task_id: str) -> None:
        return None
