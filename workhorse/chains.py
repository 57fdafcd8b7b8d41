"""A failing chain step fails the rest of its chain, as Celery 5.7 does.

Each later step with a task id gets the step's FAILURE stored under its own id, so a client
waiting on the chain's result (its last step's) gets the exception instead of waiting for
ever; a later step that is itself a chord header member still counts toward its chord, and
a chord step's body is failed too. The chain's error callbacks are set on every step, so
the failed step's own errbacks are the chain's.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from .chords import chord_part_return
from .states import FAILURE

if TYPE_CHECKING:
    from .app import App


def fail_chain(app: App, chain: Iterable[Mapping[str, Any]] | None, exc: BaseException,
               traceback: str | None) -> None:
    """Store ``exc`` as the FAILURE of every later step of ``chain`` (the failed step's
    ``chain`` field: the steps after it, last first)."""
    steps: deque[Mapping[str, Any]] = deque(chain or ())
    while steps:
        step = steps.popleft()
        options = step.get("options") or {}
        task_id = options.get("task_id")
        if task_id:
            app.backend.mark_as_failure(task_id, exc, traceback,
                                        request={"task": step.get("task")})
        if options.get("chord") and options.get("group_id") and task_id:
            chord_part_return(app, options["group_id"], task_id, options.get("group_index"),
                              FAILURE, exc, options["chord"], inline_errbacks=False)
        if step.get("subtask_type") == "chord":
            body = (step.get("kwargs") or {}).get("body")
            if body:
                steps.append(body)
