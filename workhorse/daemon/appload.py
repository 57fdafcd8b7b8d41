"""Finding the user's App from ``module`` or ``module:attribute``."""
from __future__ import annotations

import importlib
import os
import sys

from ..app import App
from ..exceptions import AppImportError


def load_app(spec: str) -> App:
    """Import the task module named by the ``app`` setting and return its App."""
    module_name, _, attribute = spec.partition(":")
    if not module_name:
        raise AppImportError(f"app {spec!r}: expected module or module:attribute")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())   # as `python -m` does: the current directory's modules
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise AppImportError(
            f"cannot import task module {module_name!r}: {type(exc).__name__}: {exc}") from exc
    if attribute:
        obj = getattr(module, attribute, None)
        if not isinstance(obj, App):
            raise AppImportError(
                f"{module_name}:{attribute} is {'missing' if obj is None else type(obj).__name__}, "
                "not a workhorse App")
        return obj
    named = getattr(module, "app", None)
    if isinstance(named, App):
        return named
    found = [value for value in vars(module).values() if isinstance(value, App)]
    if len(found) == 1:
        return found[0]
    raise AppImportError(
        f"module {module_name!r} holds {len(found) or 'no'} workhorse App objects; "
        f"name one as {module_name}:<attribute>")
