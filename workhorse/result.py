"""Client-side handle on a task's result."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .backends import decode_exception
from .exceptions import TaskRevokedError
from .states import FAILURE, READY_STATES, REVOKED, SUCCESS

if TYPE_CHECKING:
    from .app import App
    from .backends import Backend


class AsyncResult:
    """The result of a task by id; reads the result store of ``app`` (default: current app)."""

    def __init__(self, id: str, app: App | None = None) -> None:
        from .app import current_app
        self.id = id
        self.app = app or current_app()
        self._ready_meta: dict[str, Any] | None = None

    @property
    def backend(self) -> Backend:
        return self.app.backend

    def _meta(self) -> dict[str, Any]:
        if self._ready_meta is not None:
            return self._ready_meta
        meta = self.backend.get_task_meta(self.id)
        if meta["status"] in READY_STATES:
            self._ready_meta = meta   # a ready result never changes again
        return meta

    @property
    def state(self) -> str:
        return self._meta()["status"]

    status = state

    @property
    def result(self) -> Any:
        """The return value, or the rebuilt exception for FAILURE and REVOKED."""
        meta = self._meta()
        if meta["status"] in (FAILURE, REVOKED):
            return decode_exception(meta["result"])
        return meta["result"]

    info = result

    @property
    def traceback(self) -> str | None:
        return self._meta().get("traceback")

    def ready(self) -> bool:
        return self.state in READY_STATES

    def successful(self) -> bool:
        return self.state == SUCCESS

    def failed(self) -> bool:
        return self.state == FAILURE

    def get(self, timeout: float | None = None, propagate: bool = True,
            interval: float = 0.5) -> Any:
        """Wait for the result; raise the task's exception when it failed and ``propagate``."""
        if self._ready_meta is None:
            self._ready_meta = self.backend.wait_for(self.id, timeout=timeout, interval=interval)
        meta = self._ready_meta
        if meta["status"] == SUCCESS or not propagate:
            return self.result
        if meta["status"] == REVOKED:
            raise TaskRevokedError(f"task {self.id} was revoked: {self.result}")
        raise self.result

    def forget(self) -> None:
        self._ready_meta = None
        self.backend.forget(self.id)

    def __repr__(self) -> str:
        return f"<AsyncResult: {self.id}>"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, AsyncResult):
            return other.id == self.id
        return other == self.id if isinstance(other, str) else NotImplemented

    def __hash__(self) -> int:
        return hash(self.id)
