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
        if self["subtask_type"] in ("chain", "group", "chord") and not args and not kwargs:
            copied = copy_signature(self, self._app)    # keeps its kind: apply_async differs
            copied.options.update(options)
            return copied
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
        self.options["link"] = [*as_list(self.options.get("link")), callback]
        return callback

    def link_error(self, errback: Signature) -> Signature:
        """Call ``errback`` when this task fails."""
        # One signature or a list (Celery's ``.set(link_error=sig)``) becomes a list.
        self.options["link_error"] = [*as_list(self.options.get("link_error")), errback]
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
        stamped = merged.get("stamped_headers")
        if isinstance(stamped, (list, tuple)) and stamped:
            # Celery's stamping keeps each stamp as an option of its own, named by
            # stamped_headers; its messages carry them as the stamps header (which
            # revoke_by_stamped_headers matches).
            merged["headers"] = {**(merged.get("headers") or {}),
                                 "stamped_headers": list(stamped),
                                 "stamps": {name: merged.get(name) for name in stamped
                                            if isinstance(name, str)}}
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

    def freeze_result(self, parent: AsyncResult | GroupResult | None = None
                      ) -> AsyncResult | GroupResult:
        """Fix every step's id in place (groups upgraded to chords as when sent); the
        chain's result is its last step's (a GroupResult when that is a group)."""
        steps = _upgrade_groups([signature(t, self._app) for t in self.tasks], self._app)
        if self.options.get("task_id"):
            steps[-1].options["task_id"] = self.options["task_id"]
        result = parent
        for step in steps:
            result = step.freeze_result(result)
        assert result is not None
        self.kwargs["tasks"] = steps
        self.options["task_id"] = result.id
        return result

    def apply_async(self, args: Sequence[Any] = (),  # type: ignore[override]
                    kwargs: Mapping[str, Any] | None = None,
                    **options: Any) -> AsyncResult | GroupResult:
        options = {**self.options, **options}
        errbacks = as_list(options.pop("link_error", None))
        steps = _upgrade_groups([copy_signature(t, self._app) for t in self.tasks], self._app)
        # What follows the chain when it is itself a step (a chord body, ...): its steps.
        steps += [signature(s, self._app) for s in reversed(as_list(options.pop("chain", None)))]
        # As in Celery: the chain's id, its place in a group or chord and its callbacks are
        # its last step's; the rest of the options go to the first step's message.
        last = steps[-1].options
        for name in ("task_id", "group_id", "group_index", "chord"):
            if options.get(name) is not None:
                last[name] = options.pop(name)
            options.pop(name, None)
        for callback in as_list(options.pop("link", None)):
            steps[-1].link(signature(callback, self._app))
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
        for index, task in enumerate(_unrolled(self.tasks, self._app)):
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
        # As Celery: the group's own options (its errbacks among them, which replace
        # those of its tasks) go to every member; its id and place are its own.
        options = {**{k: v for k, v in self.options.items() if k not in _OWN_PLACE},
                   **options}
        enclosing = _enclosing_chord(self, options)
        if enclosing:
            # A part of an enclosing chord's header (a chain's last step there): each
            # member counts toward that chord, in the group's place.
            group_id, members = self.freeze()
            results = [member.apply_async(args, kwargs, **enclosing, **options)
                       for member in members]
        else:
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
        body_result = body.freeze_result()    # a group body: its members' ids too
        # As in Celery: what comes after the chord (the rest of a chain it is a step of, its
        # callbacks) follows its body, not each header task.
        rest = options.pop("chain", None) or self.options.get("chain")
        if rest:
            body.options["chain"] = rest
        for callback in [*as_list(self.options.get("link")),
                         *as_list(options.pop("link", None))]:
            body.link(signature(callback, self._app))
        for errback in [*as_list(self.options.get("link_error")),
                        *as_list(options.pop("link_error", None))]:
            body.link_error(errback)
        if options.get("root_id"):
            body.options.setdefault("root_id", options["root_id"])
        # A chord inside an enclosing chord's header: its body counts toward that chord.
        body.options.update(_enclosing_chord(self, options))
        group_id, members = header.freeze()
        if not members:
            return body.apply_async(([],))
        # A member whose result is a group's (a chain ending in a group) makes the body's
        # argument nested: the header's shape is saved for the body, as Celery saves it.
        shapes = [m.freeze_result() for m in members]
        if any(isinstance(shape, GroupResult) for shape in shapes):
            GroupResult(group_id, shapes, app=self.app).save()
        self.app.backend.set_chord_size(group_id, sum(_parts(m) for m in members))
        results = [m.apply_async(args, kwargs, chord=body, **options) for m in members]
        header_result = GroupResult(group_id, results, app=self.app)
        body_result.parent = header_result
        return body_result


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
    upgraded: list[Signature] = []       # last first: a group's body may be a chord
    for step in reversed(steps):
        if upgraded and isinstance(step, group):
            upgraded[-1] = chord(step, upgraded[-1], app=app)
        else:
            upgraded.append(step)
    return upgraded[::-1]


_OWN_PLACE = frozenset({"task_id", "group_id", "group_index", "chord", "chain"})


def result_node(sig: Signature) -> Signature:
    """The signature whose result stands for ``sig``'s: a chord's body, a chain's last
    step (descending), else ``sig``."""
    while True:
        if isinstance(sig, chord) and sig.kwargs["body"] is not None:
            sig = signature(sig.kwargs["body"], sig._app)
        elif isinstance(sig, chain):
            sig = signature(sig.tasks[-1], sig._app)
        else:
            return sig


def _unrolled(tasks: Iterable[Any], app: App | None) -> list[Signature]:
    """A group's members with nested groups' members in their place, as Celery unrolls
    them (a group inside a group is not a result of its own)."""
    flat: list[Signature] = []
    for task in tasks:
        member = signature(task, app)
        if isinstance(member, group):
            flat.extend(_unrolled(member.tasks, app))
        else:
            flat.append(member)
    return flat


def _parts(sig: Signature) -> int:
    """How many results a chord header member returns to its chord (Celery's _descend):
    a group each of its members', a chain its last step's, a chord its body's, a task 1."""
    if isinstance(sig, group):
        return sum(_parts(t) for t in _unrolled(sig.tasks, sig._app))
    if isinstance(sig, chain):
        return next((n for n in (_parts(t) for t in reversed(sig.tasks)) if n), 0)
    if isinstance(sig, chord):
        body = sig.kwargs["body"]
        return _parts(signature(body, sig._app)) if body is not None else 0
    return 1


def _enclosing_chord(sig: Signature, options: dict[str, Any]) -> dict[str, Any]:
    """The enclosing chord's body, id and place given to a group or chord that is a part
    of its header (popped from ``options``, or set on the signature); empty if none."""
    found = {name: options.pop(name, None) for name in ("chord", "group_id", "group_index")}
    if found["chord"] is None and sig.options.get("chord") is not None:
        found = {name: sig.options.get(name) for name in found}
    if found["chord"] is None:
        return {}
    return {name: value for name, value in found.items() if value is not None}


def as_list(value: Any) -> list[Any]:
    """An option that holds one signature or a list of them, as a list."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
