"""Client-side handles on results: one task (AsyncResult), several (ResultSet), a group."""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from ._state import current_app, current_context
from .backends import decode_exception
from .exceptions import TaskRevokedError, TimeoutError
from .states import FAILURE, READY_STATES, REVOKED, SUCCESS

if TYPE_CHECKING:
    from .app import App
    from .backends import Backend


class ResultCache:
    """A small LRU of ready results' meta: a ready result never changes again."""

    def __init__(self, size: int = 1024) -> None:
        self.size = size
        self._data: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def get(self, task_id: str) -> dict[str, Any] | None:
        meta = self._data.get(task_id)
        if meta is not None:
            self._data.move_to_end(task_id)
        return meta

    def put(self, task_id: str, meta: dict[str, Any]) -> None:
        self._data[task_id] = meta
        self._data.move_to_end(task_id)
        while len(self._data) > self.size:
            self._data.popitem(last=False)

    def discard(self, task_id: str) -> None:
        self._data.pop(task_id, None)


def _forbid_inside_task(what: str) -> None:
    if current_context() is not None:
        raise RuntimeError(
            f"Never call {what} within a task: the task would wait for a worker slot it "
            "occupies itself (deadlock). Use a chain or a chord, or pass "
            "disable_sync_subtasks=False if you know the subtask runs elsewhere.")


class AsyncResult:
    """The result of a task by id; reads the result store of ``app`` (default: current app)."""

    def __init__(self, id: str, app: App | None = None, parent: AsyncResult | None = None) -> None:
        self.id = id
        self.app = app or current_app()
        self.parent = parent

    @property
    def backend(self) -> Backend:
        return self.app.backend

    def _meta(self) -> dict[str, Any]:
        cache = self.app.result_cache
        meta = cache.get(self.id)
        if meta is None:
            meta = self.backend.get_task_meta(self.id)
            if meta["status"] in READY_STATES:
                cache.put(self.id, meta)
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

    @property
    def children(self) -> list[AsyncResult | GroupResult]:
        """Results of the tasks this one sent while it ran (stored with its result)."""
        return [result_from_tuple(c, self.app) for c in self._meta().get("children") or ()]

    def ready(self) -> bool:
        return self.state in READY_STATES

    def successful(self) -> bool:
        return self.state == SUCCESS

    def failed(self) -> bool:
        return self.state == FAILURE

    def get(self, timeout: float | None = None, propagate: bool = True, interval: float = 0.5,
            disable_sync_subtasks: bool = True) -> Any:
        """Wait for the result; raise the task's exception when it failed and ``propagate``."""
        if disable_sync_subtasks:
            _forbid_inside_task("result.get()")
        meta = self.app.result_cache.get(self.id)
        if meta is None:
            meta = self.backend.wait_for(self.id, timeout=timeout, interval=interval)
            self.app.result_cache.put(self.id, meta)
        if meta["status"] == SUCCESS or not propagate:
            return self.result
        if meta["status"] == REVOKED:
            raise TaskRevokedError(f"task {self.id} was revoked: {self.result}")
        raise self.result

    wait = get

    def forget(self) -> None:
        self.app.result_cache.discard(self.id)
        self.backend.forget(self.id)

    def as_tuple(self) -> tuple[Any, Any]:
        return (self.id, self.parent.as_tuple() if self.parent else None), None

    def __repr__(self) -> str:
        return f"<AsyncResult: {self.id}>"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, AsyncResult):
            return other.id == self.id
        return other == self.id if isinstance(other, str) else NotImplemented

    def __hash__(self) -> int:
        return hash(self.id)


class ResultSet:
    """Several results, waited on together."""

    def __init__(self, results: Iterable[AsyncResult | GroupResult],
                 app: App | None = None) -> None:
        self.results = list(results)
        self.app: App = app or (self.results[0].app if self.results else current_app())

    def __iter__(self) -> Iterator[AsyncResult | GroupResult]:
        return iter(self.results)

    def __len__(self) -> int:
        return len(self.results)

    def ready(self) -> bool:
        return all(r.ready() for r in self.results)

    def successful(self) -> bool:
        return all(r.successful() for r in self.results)

    def failed(self) -> bool:
        return any(r.failed() for r in self.results)

    def completed_count(self) -> int:
        return sum(1 for r in self.results if r.successful())

    def join(self, timeout: float | None = None, propagate: bool = True, interval: float = 0.5,
             disable_sync_subtasks: bool = True) -> list[Any]:
        """Every result's value, in order; ``timeout`` is for the whole set."""
        if disable_sync_subtasks:
            _forbid_inside_task("join()")
        deadline = None if timeout is None else time.monotonic() + timeout
        values = []
        for result in self.results:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"the results were not all ready after {timeout} s")
            values.append(result.get(timeout=remaining, propagate=propagate, interval=interval,
                                     disable_sync_subtasks=False))
        return values

    get = join

    def forget(self) -> None:
        for result in self.results:
            result.forget()


class GroupResult(ResultSet):
    """The results of a group, under the group's id; ``save()`` stores it for ``restore()``."""

    def __init__(self, id: str, results: Iterable[AsyncResult | GroupResult],
                 app: App | None = None, parent: AsyncResult | None = None) -> None:
        super().__init__(results, app)
        self.id = id
        self.parent = parent

    def as_tuple(self) -> tuple[Any, Any]:
        return ((self.id, self.parent.as_tuple() if self.parent else None),
                [r.as_tuple() for r in self.results])

    def save(self) -> GroupResult:
        self.app.backend.save_group(self.id, self.as_tuple())
        return self

    def forget(self) -> None:
        super().forget()
        self.app.backend.forget_group(self.id)

    @classmethod
    def restore(cls, group_id: str, app: App | None = None) -> GroupResult | None:
        app = app or current_app()
        stored = app.backend.restore_group(group_id)
        return result_from_tuple(stored, app) if stored is not None else None  # type: ignore[return-value]

    def __repr__(self) -> str:
        return f"<GroupResult: {self.id} [{', '.join(r.id for r in self.results)}]>"


def result_from_tuple(value: Any, app: App) -> AsyncResult | GroupResult:
    """Rebuild a result from Celery's tuple form: ((id, parent), children-or-None)."""
    head, nodes = value
    task_id, parent = head if isinstance(head, (list, tuple)) else (head, None)
    parent_result = result_from_tuple(parent, app) if parent else None
    if nodes is not None:
        return GroupResult(task_id, [result_from_tuple(n, app) for n in nodes], app=app,
                           parent=parent_result)  # type: ignore[arg-type]
    return AsyncResult(task_id, app=app, parent=parent_result)  # type: ignore[arg-type]
