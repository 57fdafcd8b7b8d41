"""What the database store reads from a pickle Celery left in its tables: plain values and
exceptions, never code (workhorse.backends.pickles)."""
from __future__ import annotations

import datetime
import decimal
import os
import pickle
import sys
import types
import uuid
from collections import OrderedDict

import pytest

from workhorse.backends.database import UnreadableResult, decode_value
from workhorse.backends.pickles import RefusedPickle, loads


def test_plain_values_come_back_as_they_were():
    value = {"n": 1, "f": 2.5, "s": "é", "b": b"\x00", "l": [1, (2, 3)], "set": {1, 2},
             "frozen": frozenset({"a"}), "none": None, "c": complex(1, 2),
             "when": datetime.datetime(2026, 11, 27, 12, 0, tzinfo=datetime.UTC),
             "day": datetime.date(2026, 1, 2), "span": datetime.timedelta(seconds=3),
             "money": decimal.Decimal("1.10"), "id": uuid.UUID(int=7),
             "ordered": OrderedDict(a=1)}
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        assert loads(pickle.dumps(value, protocol=protocol)) == value


def test_exceptions_are_rebuilt_from_loaded_classes():
    error = loads(pickle.dumps(KeyError("missing")))
    assert type(error) is KeyError and error.args == ("missing",)
    from workhorse.exceptions import SoftTimeLimitExceeded
    soft = loads(pickle.dumps(SoftTimeLimitExceeded("slow")))
    assert isinstance(soft, SoftTimeLimitExceeded)


def test_an_exception_class_no_loaded_module_defines_is_synthesized_not_imported():
    module = types.ModuleType("wh_not_installed_anywhere")
    error_class = type("PaymentDeclined", (Exception,), {"__module__": module.__name__})
    module.PaymentDeclined = error_class  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    try:
        data = pickle.dumps(error_class("card 4242", 12))
    finally:
        del sys.modules[module.__name__]
    error = loads(data)
    assert type(error).__name__ == "PaymentDeclined" and type(error) is not error_class
    assert isinstance(error, Exception) and error.args == ("card 4242", 12)
    assert module.__name__ not in sys.modules


class _RunsCode:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.path}",))


class _Plain:
    pass


class _CallsEval:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (eval, ("1 + 1",))


def test_a_pickle_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(RefusedPickle, match=r"names posix\.system|names os\.system"):
        loads(pickle.dumps(_RunsCode(str(marker))))
    assert not marker.exists()
    with pytest.raises(RefusedPickle, match=r"builtins\.eval"):
        loads(pickle.dumps(_CallsEval()))
    # A loaded class that is not an exception (this module's own) is refused too.
    with pytest.raises(RefusedPickle, match=r"names tests\.test_pickles\._Plain"):
        loads(pickle.dumps(_Plain()))
    # Protocol 2 writes bytes through _codecs.encode: only as latin-1.
    forged = pickle.dumps(b"x", protocol=2).replace(b"latin1", b"rot_13")
    with pytest.raises(RefusedPickle, match="rot_13"):
        loads(forged)


def test_a_persistent_id_is_refused():
    class Persisting(pickle.Pickler):
        def persistent_id(self, obj):  # type: ignore[no-untyped-def]
            return "ref" if obj == "secret" else None

    import io
    buffer = io.BytesIO()
    Persisting(buffer, protocol=2).dump(["secret"])
    with pytest.raises(RefusedPickle, match="persistent id"):
        loads(buffer.getvalue())


def test_a_column_value_is_json_or_pickle_and_anything_else_is_named():
    assert decode_value(b'{"a": [1, 2]}', "x") == {"a": [1, 2]}
    assert decode_value(pickle.dumps({"a": 1}, protocol=2), "x") == {"a": 1}
    assert decode_value(None, "x") is None
    with pytest.raises(UnreadableResult, match="the stored result of task t1 is neither"):
        decode_value(b"\xff\xfe msgpack", "the stored result of task t1")
