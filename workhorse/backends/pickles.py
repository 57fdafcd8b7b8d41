"""Reading the pickles Celery may have left in a result store, without running their code.

Celery's database store writes the ``result`` column with the app's result serializer:
JSON by default, a pickle where the app set ``result_serializer = "pickle"`` and in rows
written before Celery 5.7 (SQLAlchemy's PickleType). workhorse writes JSON only, and reads
a pickle through :func:`loads`, which gives back:

- plain values: the pickle opcodes' own (None, booleans, numbers, strings, bytes, lists,
  tuples, dicts) and the classes in :data:`VALUES` (sets, dates and times, Decimal, UUID,
  OrderedDict...), whose constructors take only such values;
- exceptions: a class a loaded module defines (as ``decode_exception`` resolves a name in
  the JSON form) or, for a name no loaded module defines, a synthesized exception class of
  that name. Nothing is imported, and calling an exception class runs no stored code.

Anything else a pickle names (a function, a class that is not an exception: ``os.system``,
``builtins.eval``, a loaded app's own classes) is refused with :class:`RefusedPickle`, and
so are persistent ids.
"""
from __future__ import annotations

import _compat_pickle
import io
import pickle
from typing import Any

from .encoding import resolve_exception

__all__ = ["VALUES", "RefusedPickle", "loads"]

#: The classes a stored pickle may name besides exceptions: (module, name).
VALUES: frozenset[tuple[str, str]] = frozenset({
    *(("builtins", name) for name in ("set", "frozenset", "complex", "bytearray", "bytes",
                                      "slice", "range", "list", "dict", "tuple", "str",
                                      "int", "float", "bool")),
    *(("datetime", name) for name in ("datetime", "date", "time", "timedelta", "timezone")),
    ("decimal", "Decimal"),
    ("uuid", "UUID"),
    ("collections", "OrderedDict"),
    ("collections", "deque"),
})


class RefusedPickle(pickle.UnpicklingError):
    """A stored pickle names something that is neither a plain value nor an exception."""


def _latin1(text: str, encoding: str = "latin1") -> bytes:
    """How protocol 2 pickles bytes (``_codecs.encode(text, "latin1")``), and nothing else."""
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise RefusedPickle(f"a stored pickle encodes with {encoding!r}: refused")
    return text.encode("latin1")


class _Restricted(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # Python 2's names, which protocol 2 writes (__builtin__.set), as pickle maps them.
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        else:
            module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        if (module, name) in VALUES:
            return super().find_class(module, name)
        if (module, name) == ("_codecs", "encode"):
            return _latin1
        cls = resolve_exception(module, name, refuse_loaded=True)
        if cls is None:
            raise RefusedPickle(
                f"a stored pickle names {module}.{name}, which is neither a plain value nor "
                "an exception class: refused (workhorse never runs code from a result store)")
        return cls

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedPickle("a stored pickle holds a persistent id: refused")


def loads(data: bytes) -> Any:
    """The value pickled in ``data``, read as the module docstring says."""
    return _Restricted(io.BytesIO(data)).load()
