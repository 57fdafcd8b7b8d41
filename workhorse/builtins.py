"""Celery's built-in tasks, registered in every App, so the messages Celery clients send
for them run on workhorse workers: ``celery.map``, ``celery.starmap``, ``celery.chunks``
(``task.map(…)``, ``task.starmap(…)``, ``task.chunks(…)``), ``celery.accumulate`` (used by
``Task.replace`` with a group) and ``celery.backend_cleanup`` (scheduled by beat).

``celery.chord_unlock`` (the polling chord of result stores without counters) is not one
of them: both of workhorse's stores count chord parts, so a chord never needs it.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from itertools import islice
from typing import TYPE_CHECKING, Any

from .canvas import Signature, group, signature
from .result import GroupResult

if TYPE_CHECKING:
    from .app import App

NAMES = ("celery.map", "celery.starmap", "celery.chunks", "celery.accumulate",
         "celery.backend_cleanup")


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


def _in_chunks(it: Iterator[Any], n: int) -> Iterator[list[Any]]:
    while part := list(islice(it, n)):
        yield part
