"""Signatures and chains: a task call as data, in Celery's wire layout.

A signature is a dict ``{task, args, kwargs, options, subtask_type, immutable, chord_size}``
so it travels as JSON in a message's ``callbacks``, ``errbacks`` and ``chain`` fields and
Celery reads it unchanged.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ._state import current_app, new_task_id
from .result import AsyncResult, GroupResult

if TYPE_CHECKING:
    from .app import App
    from .task import Task


class Signature(dict[str, Any]):
    """``add.s(2)`` → call later with more arguments; ``add.si(2, 3)`` → call exactly so."""

    def __init__(self, task: str | Task | Mapping[str, Any], args: Sequence[Any] = (),
                 kwargs: Mapping[str, Any] | None = None, options: Mapping[str, Any] | None = None,
                 *, immutable: bool = False, subtask_type: str | None = None,
                 app: App | None = None) -> None:
        if isinstance(task, Mapping):     # from the wire
            data = dict(task)
            super().__init__(task=data["task"], args=list(data.get("args") or ()),
                             kwargs=dict(data.get("kwargs") or {}),
                             options=dict(data.get("options") or {}),
                             subtask_type=data.get("subtask_type"),
                             immutable=bool(data.get("immutable")),
                             chord_size=data.get("chord_size"))
        else:
            name = task if isinstance(task, str) else task.name
            app = app or (None if isinstance(task, str) else task.app)
            super().__init__(task=name, args=list(args), kwargs=dict(kwargs or {}),
                             options=dict(options or {}), subtask_type=subtask_type,
                             immutable=immutable, chord_size=None)
        self._app = app

    # -- fields
    @property
    def name(self) -> str:
        return self["task"]

    @property
    def args(self) -> list[Any]:
        return self["args"]

    @property
    def kwargs(self) -> dict[str, Any]:
        return self["kwargs"]

    @property
    def options(self) -> dict[str, Any]:
        return self["options"]

    @property
    def immutable(self) -> bool:
        return self["immutable"]

    @property
    def app(self) -> App:
        if self._app is None:
            self._app = current_app()
        return self._app

    # -- building
    def clone(self, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
              **options: Any) -> Signature:
        """A copy with ``args`` prepended (unless immutable) and kwargs/options merged."""
        merged_args, merged_kwargs = self._merge(args, kwargs)
        return Signature(self.name, merged_args, merged_kwargs, {**self.options, **options},
                         immutable=self.immutable, subtask_type=self["subtask_type"],
                         app=self._app)

    def _merge(self, args: Sequence[Any], kwargs: Mapping[str, Any] | None
               ) -> tuple[list[Any], dict[str, Any]]:
        if self.immutable:
            return list(self.args), dict(self.kwargs)
        return [*args, *self.args], {**self.kwargs, **(kwargs or {})}

    def set(self, **options: Any) -> Signature:
        self.options.update(options)
        return self

    def link(self, callback: Signature) -> Signature:
        """Apply ``callback`` to this task's result when it succeeds."""
        self.options.setdefault("link", []).append(callback)
        return callback

    def link_error(self, errback: Signature) -> Signature:
        """Call ``errback`` when this task fails."""
        self.options.setdefault("link_error", []).append(errback)
        return errback

    def on_error(self, errback: Signature) -> Signature:
        """Like link_error, but returns this signature (for chaining calls)."""
        self.link_error(errback)
        return self

    # ``|`` chains tasks (Celery's meaning), it does not merge dicts.
    def __or__(self, other: Signature) -> chain:  # type: ignore[override]
        if isinstance(other, chain):
            return chain(self, *other.tasks, app=self._app)
        return chain(self, other, app=self._app)

    def freeze_result(self, parent: AsyncResult | GroupResult | None = None
                      ) -> AsyncResult | GroupResult:
        """Fix the id its result will have (a chain step's, known before it is sent)."""
        self.options.setdefault("task_id", new_task_id())
        return AsyncResult(self.options["task_id"], app=self.app,
                           parent=parent)  # type: ignore[arg-type]

    # -- calling
    def apply_async(self, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
                    **options: Any) -> AsyncResult:
        merged_args, merged_kwargs = self._merge(args, kwargs)
        merged = {**self.options, **options}
        if merged.get("queue") is None and merged.get("routing_key"):
            merged["queue"] = merged["routing_key"]   # Celery routing by key = queue name
        # Signatures made by Celery carry options workhorse has no use for (exchange, ...).
        return self.app.send_task(self.name, merged_args, merged_kwargs,
                                  **{k: v for k, v in merged.items()
                                     if k in self.app.SEND_OPTIONS})

    def delay(self, *args: Any, **kwargs: Any) -> AsyncResult:
        return self.apply_async(args, kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the task here and now, as a function call."""
        merged_args, merged_kwargs = self._merge(args, kwargs)
        return self.app.tasks[self.name](*merged_args, **merged_kwargs)

    def __repr__(self) -> str:
        args = ", ".join([*(repr(a) for a in self.args),
                          *(f"{k}={v!r}" for k, v in self.kwargs.items())])
        return f"{self.name}{'!' if self.immutable else ''}({args})"


class chain(Signature):  # Celery's name
    """Run tasks one after another, each getting the previous one's result; ``apply_async``
    returns the last task's AsyncResult.

    On the wire the first task's message carries the rest, in reverse order, in its
    ``chain`` field; an error callback set on the chain is set on every task of it.
    """

    def __init__(self, *tasks: Signature | Iterable[Signature], app: App | None = None) -> None:
        flat: list[Signature] = []
        for task in tasks:
            if isinstance(task, chain):
                flat.extend(task.tasks)
            elif isinstance(task, Signature):
                flat.append(task)
            else:
                flat.extend(Signature(t) if not isinstance(t, Signature) else t for t in task)
        if not flat:
            raise ValueError("a chain needs at least one task")
        super().__init__("celery.chain", (), {"tasks": flat}, subtask_type="chain",
                         app=app or flat[0]._app)

    @property
    def tasks(self) -> list[Signature]:
        return self.kwargs["tasks"]

    def __or__(self, other: Signature) -> chain:  # type: ignore[override]
        return chain(*self.tasks, other, app=self._app)

    def apply_async(self, args: Sequence[Any] = (),  # type: ignore[override]
                    kwargs: Mapping[str, Any] | None = None,
                    **options: Any) -> AsyncResult | GroupResult:
        errbacks = [*self.options.get("link_error", ()), *_as_list(options.pop("link_error", None))]
        steps = _upgrade_groups([copy_signature(t, self._app) for t in self.tasks], self._app)
        result: AsyncResult | GroupResult | None = None
        for step in steps:
            for errback in errbacks:
                step.link_error(errback)
            # Known now, as Celery freezes a chain: each step's result has the previous
            # one as its parent, and the chain's result is its last step's.
            result = step.freeze_result(result)
        first, rest = steps[0], steps[1:]
        first.apply_async(args, kwargs, chain=list(reversed(rest)) or None, **options)
        assert result is not None
        return result

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = self.tasks[0](*args, **kwargs)
        for step in self.tasks[1:]:
            result = step(result)
        return result

    def __repr__(self) -> str:
        return " | ".join(repr(t) for t in self.tasks)


class group(Signature):  # Celery's name
    """Run tasks in parallel; ``apply_async`` returns a GroupResult (not yet saved)."""

    def __init__(self, *tasks: Signature | Iterable[Signature], app: App | None = None) -> None:
        flat: list[Signature] = []
        for task in tasks:
            if isinstance(task, Signature):
                flat.append(task)
            else:
                flat.extend(t if isinstance(t, Signature) else Signature(t) for t in task)
        super().__init__("celery.group", (), {"tasks": flat}, subtask_type="group",
                         app=app or (flat[0]._app if flat else None))

    @property
    def tasks(self) -> list[Signature]:
        return self.kwargs["tasks"]

    def freeze(self, group_id: str | None = None) -> tuple[str, list[Signature]]:
        """Fix the group's id and each member's task id and place, before sending."""
        group_id = group_id or self.options.get("task_id") or new_task_id()
        members = []
        for index, task in enumerate(self.tasks):
            member = task.clone(group_id=group_id, group_index=index)
            member.options.setdefault("task_id", new_task_id())
            members.append(member)
        return group_id, members

    def freeze_result(self, parent: AsyncResult | GroupResult | None = None) -> GroupResult:
        """Fix the group's and its members' ids in place (a chain step, sent later)."""
        group_id, members = self.freeze()
        self.options["task_id"] = group_id
        self.kwargs["tasks"] = members
        return GroupResult(group_id, [AsyncResult(m.options["task_id"], app=self.app)
                                      for m in members], app=self.app)

    # A group's result is a GroupResult, as in Celery.
    def apply_async(self, args: Sequence[Any] = (),  # type: ignore[override]
                    kwargs: Mapping[str, Any] | None = None, **options: Any) -> GroupResult:
        group_id, members = self.freeze(options.pop("group_id", None))
        results = [member.apply_async(args, kwargs, **options) for member in members]
        return GroupResult(group_id, results, app=self.app)

    def __call__(self, *args: Any, **kwargs: Any) -> list[Any]:
        return [task(*args, **kwargs) for task in self.tasks]


class chord(Signature):  # Celery's name
    """A group (the header) whose results, in order, go to one task (the body) once all
    header tasks have finished. The count is kept in the result store, so the body runs
    once; a header task that fails fails the body (ChordError) and calls its errbacks.
    ``apply_async`` returns the body's AsyncResult, whose parent is the header's
    GroupResult."""

    def __init__(self, header: Iterable[Signature] | group, body: Signature | None = None,
                 app: App | None = None) -> None:
        header_group = header if isinstance(header, group) else group(*header, app=app)
        super().__init__("celery.chord", (), {"header": header_group, "body": body},
                         subtask_type="chord", app=app or header_group._app)

    def __call__(self, body: Signature | None = None, **options: Any) -> Any:
        """``chord(header)(body)``: apply with this body, as Celery spells it."""
        if body is not None:
            self.kwargs["body"] = body
        return self.apply_async(**options)

    def freeze_result(self, parent: AsyncResult | GroupResult | None = None) -> AsyncResult:
        """A chord's result is its body's: fix the body's id in place."""
        body = self.kwargs["body"]
        if body is None:
            raise ValueError("a chord needs a body: chord(header, body) or chord(header)(body)")
        return body.freeze_result(parent)

    def apply_async(self, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
                    **options: Any) -> AsyncResult:
        header: group = self.kwargs["header"]
        body = self.kwargs["body"]
        if body is None:
            raise ValueError("a chord needs a body: chord(header, body) or chord(header)(body)")
        body = body.clone()
        body.options.setdefault("task_id", new_task_id())
        # As in Celery: what comes after the chord (the rest of a chain it is a step of, its
        # callbacks) follows its body, not each header task.
        rest = options.pop("chain", None)
        if rest:
            body.options["chain"] = rest
        for callback in _as_list(options.pop("link", None)):
            body.link(signature(callback, self._app))
        for errback in [*self.options.get("link_error", ()),
                        *_as_list(options.pop("link_error", None))]:
            body.link_error(errback)
        if options.get("root_id"):
            body.options.setdefault("root_id", options["root_id"])
        group_id, members = header.freeze()
        if not members:
            return body.apply_async(([],))
        self.app.backend.set_chord_size(group_id, len(members))
        results = [m.apply_async(args, kwargs, chord=body, **options) for m in members]
        header_result = GroupResult(group_id, results, app=self.app)
        return AsyncResult(body.options["task_id"], app=self.app,
                           parent=header_result)  # type: ignore[arg-type]


def signature(value: Mapping[str, Any], app: App | None = None) -> Signature:
    """A Signature from its wire dict (or return it if it already is one)."""
    if isinstance(value, Signature):
        return value
    kind = value.get("subtask_type")
    fields = value.get("kwargs") or {}
    made: Signature
    if kind == "chain":
        made = chain(*(signature(t, app) for t in fields.get("tasks", ())), app=app)
    elif kind == "group":
        made = group(*(signature(t, app) for t in fields.get("tasks", ())), app=app)
    elif kind == "chord":
        # Celery's wire form: the header a group (or a list of signatures), the body one.
        header = fields.get("header") or []
        read = (signature(header, app) if isinstance(header, Mapping)
                else group(*(signature(t, app) for t in header), app=app))
        made = chord(read if isinstance(read, group) else group(read, app=app),
                     signature(fields["body"], app) if fields.get("body") else None, app=app)
    else:
        return Signature(value, app=app)
    made.options.update(value.get("options") or {})
    made["immutable"] = bool(value.get("immutable"))
    return made


def copy_signature(value: Mapping[str, Any], app: App | None = None) -> Signature:
    """A deep copy of a signature of any kind (group, chord and chain included): its
    options can be changed without touching the original's."""
    return signature(_plain(value), app or getattr(value, "_app", None))


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _upgrade_groups(steps: list[Signature], app: App | None) -> list[Signature]:
    """``… | group | step …`` becomes ``… | chord(group, step) …``, as Celery upgrades
    it: the step after a group gets the group's results, once they are all in."""
    upgraded: list[Signature] = []
    for step in steps:
        if upgraded and isinstance(upgraded[-1], group):
            upgraded[-1] = chord(upgraded[-1], step, app=app)
        else:
            upgraded.append(step)
    return upgraded


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
