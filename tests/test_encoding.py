"""Results and exceptions across the wire, in Celery's layout."""
from __future__ import annotations

import os

import pytest

from workhorse.backends import Backend, RetryPolicy
from workhorse.backends.encoding import (
    build_meta,
    decode_exception,
    describe_exception,
    encode_exception,
)
from workhorse import exceptions
from workhorse.exceptions import ResultEncodeError, TimeLimitExceeded
from workhorse.states import FAILURE, STARTED, SUCCESS


def test_success_meta_layout():
    meta = build_meta("id1", SUCCESS, 5)
    assert set(meta) == {"status", "result", "traceback", "children", "date_done", "task_id"}
    assert meta["date_done"] is not None and meta["result"] == 5


def test_started_meta_has_no_date_done():
    assert build_meta("id1", STARTED, {})["date_done"] is None


def test_failure_meta_holds_the_exception_as_celery_does():
    meta = build_meta("id1", FAILURE, ValueError("kaboom", 42), "tb")
    assert meta["result"] == {"exc_type": "ValueError", "exc_message": ["kaboom", 42],
                              "exc_module": "builtins"}


def test_known_exception_is_rebuilt_as_its_class():
    exc = decode_exception(encode_exception(TimeLimitExceeded(3.0)))
    assert type(exc) is TimeLimitExceeded and exc.args == (3.0,)


def test_unknown_exception_becomes_a_synthesized_class_of_that_name():
    exc = decode_exception({"exc_type": "PaymentDeclined", "exc_message": ["card"],
                            "exc_module": "shop.errors"})
    assert type(exc).__name__ == "PaymentDeclined"
    assert isinstance(exc, Exception) and exc.args == ("card",)
    again = decode_exception({"exc_type": "PaymentDeclined", "exc_message": [],
                              "exc_module": "shop.errors"})
    assert type(again) is type(exc)


@pytest.mark.parametrize("module, name", [("os", "system"), ("builtins", "eval"),
                                          ("subprocess", "Popen")])
def test_a_non_exception_name_is_never_called(module, name, monkeypatch):
    calls = []
    monkeypatch.setattr(os, "system", lambda *a: calls.append(a))
    exc = decode_exception({"exc_type": name, "exc_message": ["echo pwned"],
                            "exc_module": module})
    assert isinstance(exc, Exception) and type(exc).__name__ == name
    assert calls == []


def test_unencodable_exception_args_become_reprs():
    encoded = encode_exception(ValueError(object.__new__(object)))
    assert isinstance(encoded["exc_message"][0], str)


# ---------------------------------------------------------------- what cannot be encoded
class MemoryBackend(Backend):
    """A result store in a dict, to see what reaches storage."""

    def __init__(self, fail_with: Exception | None = None) -> None:
        super().__init__("memory://", retry=RetryPolicy(always_retry=False))
        self.stored: dict[str, tuple[str, str]] = {}
        self.fail_with = fail_with

    def _set(self, task_id: str, state: str, payload: str) -> None:
        if self.fail_with is not None:
            raise self.fail_with
        self.stored[task_id] = (state, payload)

    def _get(self, task_id: str) -> str | None:
        return self.stored[task_id][1] if task_id in self.stored else None

    def _forget(self, task_id: str) -> None:
        self.stored.pop(task_id, None)


class RaisesWhenEncoded:
    """Its JSON encoding (kombu's ``__json__`` hook) raises ``exc``."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def __json__(self) -> object:
        raise self.exc

    def __repr__(self) -> str:
        return f"RaisesWhenEncoded({self.exc!r})"


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def circular() -> list:
    value: list = []
    value.append(value)
    return value


UNENCODABLE = {
    "too deep (RecursionError)": lambda: nested(100_000),
    "not JSON (TypeError)": object,
    "circular (ValueError)": circular,
    "OverflowError": lambda: RaisesWhenEncoded(OverflowError("too big")),
    "anything else": lambda: RaisesWhenEncoded(KeyError("the encoder's own bug")),
}


@pytest.mark.parametrize("make", UNENCODABLE.values(), ids=UNENCODABLE.keys())
def test_a_result_that_cannot_be_encoded_is_a_result_encode_error_and_stores_nothing(make):
    backend = MemoryBackend()
    with pytest.raises(ResultEncodeError, match="cannot be encoded as JSON"):
        backend.mark_as_done("id1", make())
    assert backend.stored == {}


@pytest.mark.parametrize("make", UNENCODABLE.values(), ids=UNENCODABLE.keys())
def test_an_exception_whose_args_cannot_be_encoded_is_stored_with_their_reprs(make):
    backend = MemoryBackend()
    backend.mark_as_failure("id1", ValueError(make(), 42), "tb")
    meta = backend.get_task_meta("id1")
    exc = decode_exception(meta["result"])
    assert meta["status"] == FAILURE and type(exc) is ValueError
    assert isinstance(exc.args[0], str) and exc.args[1] == 42


def test_a_store_error_is_not_taken_for_an_encoding_error():
    backend = MemoryBackend(fail_with=TypeError("a bug in the store's driver"))
    with pytest.raises(TypeError, match="driver"):
        backend.mark_as_done("id1", 5)


@pytest.mark.parametrize("make", [*UNENCODABLE.values(), lambda: BadRepr()],
                         ids=[*UNENCODABLE.keys(), "a raising __repr__"])
def test_describing_an_exception_never_fails(make):
    text = describe_exception(ValueError(make(), 42))
    assert text.startswith("ValueError(") and "42" in text and len(text) <= 2000


class BadRepr:
    def __repr__(self) -> str:
        raise RuntimeError("no repr for you")


@pytest.mark.parametrize("exc", [
    exceptions.Reject("no", requeue=False), exceptions.Ignore(), exceptions.Retry("again"),
    exceptions.MaxRetriesExceededError("too many"), exceptions.TaskRevokedError("revoked"),
    exceptions.NotRegistered("x.y"), exceptions.ChordError("part failed"),
    exceptions.TimeoutError("late"), exceptions.SoftTimeLimitExceeded("soft"),
    exceptions.TimeLimitExceeded("hard"), exceptions.WorkerLostError("lost")])
def test_exceptions_celery_has_are_stored_under_celery_names_and_read_back_as_ours(exc):
    import celery
    import celery.exceptions
    from celery.backends.base import BaseBackend
    stored = encode_exception(exc)
    assert stored["exc_module"] in ("celery.exceptions", "billiard.exceptions")
    theirs = BaseBackend(celery.Celery("reader")).exception_to_python(stored)
    assert type(theirs) is getattr(celery.exceptions, type(exc).__name__)   # Celery's class
    assert type(decode_exception(stored)) is type(exc)                      # ours
