"""Results and exceptions across the wire, in Celery's layout."""
from __future__ import annotations

import os

import pytest

from workhorse.backends.encoding import build_meta, decode_exception, encode_exception
from workhorse.exceptions import TimeLimitExceeded
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
