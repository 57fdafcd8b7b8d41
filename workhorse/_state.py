"""Ambient state of this process: the current App, the contexts of the tasks running here,
and new task ids.

It imports nothing of workhorse at run time, so every module can import it without
creating an import cycle (tests/test_import_graph.py).
"""
from __future__ import annotations

import uuid
from contextvars import ContextVar
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .app import App
    from .task import Context

#: Apps in the order they were created; the last is the current one.
_apps: list[App] = []

#: Contexts (``self.request``) of the tasks running in this process, innermost last: a
#: context variable, so that each async task (an asyncio task of its own) has its own
#: stack; a sync child runs one task at a time (the stack is for tasks called from tasks).
_contexts: ContextVar[tuple[Context, ...]] = ContextVar("workhorse.contexts", default=())


def set_current_app(app: App) -> None:
    """Make ``app`` the current App (every new App does this)."""
    _apps.append(app)


def current_app() -> App:
    """The most recently created App (what ``AsyncResult(id)`` uses without ``app=``)."""
    if not _apps:
        raise RuntimeError("no workhorse App has been created in this process")
    return _apps[-1]


def push_context(context: Context) -> None:
    _contexts.set((*_contexts.get(), context))


def pop_context() -> None:
    _contexts.set(_contexts.get()[:-1])


def current_context() -> Context | None:
    """The request of the task running in this process, if any: the parent of what it sends."""
    contexts = _contexts.get()
    return contexts[-1] if contexts else None


def clear_contexts() -> None:
    """Forget every running task's context (for tests that play a child's part)."""
    _contexts.set(())


def new_task_id() -> str:
    return str(uuid.uuid4())
