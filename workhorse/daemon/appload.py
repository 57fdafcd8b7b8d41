"""Finding the user's App from ``module`` or ``module:attribute``."""
from __future__ import annotations

import importlib
import os
import sys
import sysconfig
from pathlib import Path

from ..app import App
from ..celeryapp import from_celery, is_celery_app
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
        if is_celery_app(obj):
            return from_celery(obj)
        if not isinstance(obj, App):
            raise AppImportError(
                f"{module_name}:{attribute} is {'missing' if obj is None else type(obj).__name__}, "
                "not a workhorse App or a Celery app")
        return obj
    named = getattr(module, "app", None)
    if isinstance(named, App):
        return named
    found = [value for value in vars(module).values() if isinstance(value, App)]
    if len(found) == 1:
        return found[0]
    if not found and is_celery_app(named):
        return from_celery(named)
    raise AppImportError(
        f"module {module_name!r} holds {len(found) or 'no'} workhorse App objects; "
        f"name one as {module_name}:<attribute>")


def _installed_roots() -> tuple[str, ...]:
    """Where the standard library and installed packages live: not the user's code."""
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots.add(str(Path(__file__).resolve().parents[1]))     # workhorse itself
    return tuple(str(Path(root).resolve()) + os.sep for root in roots)


def user_modules(names: set[str]) -> list[str]:
    """Of the modules ``names``, those that are the user's own code (imported from files
    outside the standard library, site-packages and workhorse): what a reload imports anew."""
    roots = _installed_roots()
    found = []
    for name in sorted(names):
        path = getattr(sys.modules.get(name), "__file__", None)
        if path and not str(Path(path).resolve()).startswith(roots):
            found.append(name)
    return found


class AppModules:
    """The task module and the modules it imported, so that a reload can import the code on
    disk again: drop them from ``sys.modules`` and import the task module anew."""

    def __init__(self) -> None:
        self.spec: str | None = None
        self.modules: list[str] = []

    def load(self, spec: str) -> App:
        """The first import; later ones are reloads of the same spec."""
        if self.spec is not None:
            return self.reload()
        app = self._import(spec)
        self.spec = spec
        return app

    def _import(self, spec: str) -> App:
        before = set(sys.modules)
        app = load_app(spec)
        self.modules = user_modules(set(sys.modules) - before)
        return app

    def reload(self) -> App:
        """Import the task module from disk again. If that fails, the modules in use stay
        as they were (and AppImportError says why)."""
        assert self.spec is not None, "reload() before load()"
        saved = {name: sys.modules.pop(name) for name in self.modules if name in sys.modules}
        importlib.invalidate_caches()
        before, previous = set(sys.modules), self.modules
        try:
            return self._import(self.spec)
        except BaseException:
            for name in user_modules(set(sys.modules) - before):
                del sys.modules[name]
            sys.modules.update(saved)
            self.modules = previous
            raise
