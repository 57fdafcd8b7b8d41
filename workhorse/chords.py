"""Finishing a chord: the one header task whose result completes it applies the body.

The count is kept atomically in the result store (``Backend.chord_part_return``), so
exactly one caller gets the completed parts; it applies the body with the header results
in header order, or — when a header task failed — fails the body and calls its errbacks.
"""
from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .backends import ChordCompletion, decode_exception
from .canvas import Signature, signature
from .exceptions import ChordError
from .states import SUCCESS
from .task import Context

if TYPE_CHECKING:
    from .app import App

log = logging.getLogger("workhorse.chord")


def chord_part_return(app: App, group_id: str, task_id: str, index: int | None, state: str,
                      result: Any, body: Mapping[str, Any], *, inline_errbacks: bool) -> None:
    """Count one header task's final outcome; complete the chord if it was the last."""
    completion = app.backend.chord_part_return(group_id, task_id, index, state, result)
    if completion is None:
        return
    finish_chord(app, group_id, signature(body, app), completion, inline_errbacks=inline_errbacks)


def finish_chord(app: App, group_id: str, body: Signature, completion: ChordCompletion, *,
                 inline_errbacks: bool) -> None:
    failed = next((p for p in completion.parts if p.state != SUCCESS), None)
    body_id = body.options.get("task_id")
    if failed is None:
        log.info("chord %s complete: applying %s", group_id, body.name)
        body.apply_async(([p.result for p in completion.parts],))
    else:
        cause = decode_exception(failed.result)
        error = ChordError(f"Dependency {failed.task_id} raised {cause!r}")
        log.error("chord %s failed: %s; %s will not run", group_id, error, body.name)
        if body_id:
            app.backend.mark_as_failure(body_id, error, request={"task": body.name})
        call_errbacks(app, body.options.get("link_error") or (),
                      Context(id=body_id, task=body.name, group=group_id, called_directly=False),
                      error, None, inline=inline_errbacks)
    app.backend.chord_finished(group_id, completion.token)


def call_errbacks(app: App, errbacks: Any, request: Context, exc: BaseException,
                  traceback: str | None, *, inline: bool) -> None:
    """Errbacks taking (request, exc, traceback) are called here when ``inline`` (in a
    child, as Celery does); others, and all when not inline, are sent as tasks with the
    failed task's id. A failing errback is logged and goes no further."""
    for data in errbacks:
        errback = signature(data, app)
        local = app.tasks.get(errback.name)
        try:
            if inline and local is not None and _free_positional(local, errback) > 1:
                errback(request, exc, traceback)
            else:
                errback.apply_async((request.id,), parent_id=request.id,
                                    root_id=request.root_id or request.id)
        except Exception:  # an errback never takes the worker down
            log.exception("%s[%s]: its errback %s failed", request.task, request.id,
                          errback.name)


def _free_positional(task: Any, sig: Signature) -> int:
    """How many positional arguments the errback still takes beyond its signature's own."""
    try:
        params = list(inspect.signature(task.run).parameters.values())
    except (TypeError, ValueError):
        return 0
    if task.bind:
        params = params[1:]
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 1 << 16
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) - len(sig.args)
