"""Finishing a chord, and failing what comes after a failed workflow step.

The count is kept atomically in the result store (``Backend.chord_part_return``), so
exactly one caller gets the completed parts; it applies the body with the header results
in header order, or — when a header task failed — fails the body (each member of a group
body), calls its errbacks and fails the rest of the chain the chord is a step of, as
Celery 5.7 does.

A failing chain step fails the rest of its chain (``fail_chain``): each later step with a
task id gets the step's FAILURE stored under its own id, so a client waiting on the chain's
result (its last step's) gets the exception instead of waiting for ever; a later step that
is itself a chord header member still counts toward its chord, and a chord step's body is
failed too. The chain's error callbacks are set on every step, so the failed step's own
errbacks are the chain's.
"""
from __future__ import annotations

import inspect
import logging
from collections import deque
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from .backends import ChordCompletion, decode_exception
from .canvas import Signature, as_list, group, result_node, signature
from .exceptions import ChordError
from .states import FAILURE, SUCCESS
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
        body.apply_async((_header_results(app, group_id, completion),))
    else:
        cause = decode_exception(failed.result)
        error = ChordError(f"Dependency {failed.task_id} raised {cause!r}")
        log.error("chord %s failed: %s; %s will not run", group_id, error, body.name)
        # A group body: each member fails (and calls its errbacks and the group's), as
        # its results are what a client waits on; a member chord's result is its body's.
        members = isinstance(body, group)
        parts = body.tasks if isinstance(body, group) else [body]
        group_errbacks = as_list(body.options.get("link_error")) if members else []
        stored = (cause if members and isinstance(cause, BaseException) else error)
        nodes = [result_node(signature(part, app)) if members else part for part in parts]
        # Every result first, then the errbacks: an errback (run by another child at once)
        # or a client woken by one member's failure finds all of them failed already.
        for node in nodes:
            if node.options.get("task_id"):
                app.backend.mark_as_failure(node.options["task_id"], stored,
                                            request={"task": node.name})
        if members and body_id:
            app.backend.mark_as_failure(body_id, error, request={"task": body.name})
        for node in nodes:
            own = as_list(node.options.get("link_error"))
            call_errbacks(app, own + [e for e in group_errbacks if e not in own],
                          Context(id=node.options.get("task_id"), task=node.name,
                                  group=group_id, called_directly=False),
                          stored, None, inline=inline_errbacks)
        fail_chain(app, body.options.get("chain"), error, None,
                   inline_errbacks=inline_errbacks)
    app.backend.chord_finished(group_id, completion.token)


def _header_results(app: App, group_id: str, completion: ChordCompletion) -> list[Any]:
    """The body's argument: the parts' results in header order, nested as the header is
    when a saved shape says a member's result is a group's (Celery saves complex headers,
    and so does workhorse)."""
    flat = [p.result for p in completion.parts]
    shape = app.backend.restore_group(group_id)
    if not shape or not any(node[1] is not None for node in shape[1]):
        return flat
    by_id = {p.task_id: p.result for p in completion.parts}

    def value(node: Any) -> Any:
        head, children = node
        if children is not None:
            return [value(child) for child in children]
        task_id = head[0] if isinstance(head, (list, tuple)) else head
        return by_id[task_id] if task_id in by_id else app.AsyncResult(task_id).result

    return [value(node) for node in shape[1]]


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
    # As Celery counts (a partial of the signature's own arguments): a positional parameter
    # the signature's keyword arguments name is taken too.
    positional = [p for p in params if p.kind is p.POSITIONAL_ONLY or (
        p.kind is p.POSITIONAL_OR_KEYWORD and p.name not in sig.kwargs)]
    return len(positional) - len(sig.args)


def fail_chain(app: App, chain: Iterable[Mapping[str, Any]] | None, exc: BaseException,
               traceback: str | None, *, inline_errbacks: bool) -> None:
    """Store ``exc`` as the FAILURE of every later step of ``chain`` (the failed step's
    ``chain`` field: the steps after it, last first). ``inline_errbacks``: in a child,
    where a chord this completes may call its errbacks as Celery does.

    The steps are stored in the order they would have run, a chord's body right after
    the chord, so the chain's own result (its last step) is written last: a client that
    sees it fail and then reads ``result.parent`` finds the earlier steps failed too."""
    steps: deque[Mapping[str, Any]] = deque(reversed(list(chain or ())))
    while steps:
        step = steps.popleft()
        options = step.get("options") or {}
        task_id = options.get("task_id")
        if task_id:
            app.backend.mark_as_failure(task_id, exc, traceback,
                                        request={"task": step.get("task")})
        if options.get("chord") and options.get("group_id") and task_id:
            chord_part_return(app, options["group_id"], task_id, options.get("group_index"),
                              FAILURE, exc, options["chord"], inline_errbacks=inline_errbacks)
        if step.get("subtask_type") == "chord":
            body = (step.get("kwargs") or {}).get("body")
            if body:
                steps.appendleft(body)
