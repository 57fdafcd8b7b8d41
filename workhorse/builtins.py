"""Celery's built-in tasks, registered in every App, so the messages Celery clients send
for them run on workhorse workers: ``celery.map``, ``celery.starmap``, ``celery.chunks``
(``task.map(…)``, ``task.starmap(…)``, ``task.chunks(…)``), ``celery.accumulate`` (used by
``Task.replace`` with a group) and ``celery.backend_cleanup`` (scheduled by beat).

``celery.chord_unlock`` is the chord of a Celery client whose result store keeps no
count of the header's parts (the database store, ``db+…``): it polls the header's
results, retrying every ``interval`` seconds (1 s), and once they are all ready applies
the body, or fails it as a counted chord's is failed. The body is applied once: a claim in
the result store (``Backend.claim``) is held while it is sent and marked done after, so a
second copy of the unlock (the first's worker killed after sending its retry, before its
ack) finds it done. workhorse's own clients count chord parts in every store and never
send it.
"""
from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator, Mapping
from itertools import islice
from typing import TYPE_CHECKING, Any

from .backends import ChordCompletion, ChordPart, Claim
from .canvas import Signature, group, signature
from .result import GroupResult
from .states import READY_STATES

if TYPE_CHECKING:
    from .app import App

NAMES = ("celery.map", "celery.starmap", "celery.chunks", "celery.accumulate",
         "celery.backend_cleanup", "celery.chord_unlock")
#: How long celery.chord_unlock's claim holds while it applies the body: past it (the
#: worker died meanwhile) another copy may apply it.
UNLOCK_CLAIM_SECONDS = 60.0


def register_builtins(app: App) -> None:
    def local(task: Mapping[str, Any]) -> Any:
        """The task a signature names, to call here (as Celery's ``signature.type``)."""
        return app.tasks[signature(task, app).name]

    @app.task(name="celery.map")
    def xmap(task: Mapping[str, Any], it: Iterable[Any]) -> list[Any]:
        function = local(task)
        return [function(item) for item in it]

    @app.task(name="celery.starmap")
    def xstarmap(task: Mapping[str, Any], it: Iterable[Iterable[Any]]) -> list[Any]:
        function = local(task)
        return [function(*item) for item in it]

    @app.task(name="celery.chunks")
    def chunks(task: Mapping[str, Any], it: Iterable[Any], n: int) -> GroupResult:
        """A group of ``celery.starmap`` tasks, ``n`` items each."""
        parts = (Signature("celery.starmap", (dict(task), part), app=app)
                 for part in _in_chunks(iter(it), int(n)))
        return group(*parts, app=app).apply_async()

    @app.task(name="celery.accumulate")
    def accumulate(*args: Any, index: int | None = None) -> Any:
        return args[index] if index is not None else list(args)

    @app.task(name="celery.backend_cleanup")
    def backend_cleanup() -> None:
        purge = getattr(app.backend, "purge_expired", None)
        if purge is not None:      # Redis expires its keys by itself
            purge()

    @app.task(name="celery.chord_unlock", bind=True, max_retries=None, ignore_result=True)
    def unlock_chord(self: Any, group_id: str, callback: Mapping[str, Any],
                     interval: float | None = None, max_retries: int | None = None,
                     result: Iterable[Any] | None = None, **_routing: Any) -> None:
        from .chords import finish_chord
        delay = 1.0 if interval is None else float(interval)
        nodes = list(result or ())
        parts = _chord_parts(app, nodes)
        if parts is None:
            raise self.retry(countdown=delay, max_retries=max_retries)
        key, owner = f"celery.chord_unlock:{group_id}", f"{self.request.id}:{uuid.uuid4().hex}"
        claim = app.backend.claim(key, owner, UNLOCK_CLAIM_SECONDS)
        if claim is Claim.DONE:
            return
        if claim is Claim.HELD:       # another copy is applying it now
            raise self.retry(countdown=delay, max_retries=max_retries)
        if any(children is not None for _, children in nodes):
            # The body gets the results nested as the header is (chords._header_results
            # reads the shape from the saved group).
            app.backend.save_group(group_id, [[group_id, None], nodes])
        try:
            finish_chord(app, group_id, signature(callback, app),
                         ChordCompletion(parts, owner), inline_errbacks=True)
        except BaseException:
            app.backend.release_claim(key, owner)
            raise
        app.backend.finish_claim(key, owner)


def _chord_parts(app: App, nodes: Iterable[Any]) -> list[ChordPart] | None:
    """The header's parts in order (nodes in Celery's tuple form, a group's nested), or
    None while one of them is not ready."""
    parts: list[ChordPart] = []
    for head, children in nodes:
        if children is not None:
            inner = _chord_parts(app, children)
            if inner is None:
                return None
            parts += inner
            continue
        task_id = head[0] if isinstance(head, (list, tuple)) else head
        meta = app.backend.get_task_meta(task_id)
        if meta["status"] not in READY_STATES:
            return None
        parts.append(ChordPart(task_id, meta["status"], meta["result"]))
    return parts


def _in_chunks(it: Iterator[Any], n: int) -> Iterator[list[Any]]:
    while part := list(islice(it, n)):
        yield part
