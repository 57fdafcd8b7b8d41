"""The documentation: the site builds, every page is in its navigation, the README stays a
short entry point, and the commands the pages show are ones the real parsers accept.

Commands are read from the ```sh and ```console blocks of docs/*.md and README.md. In a
``sh`` block every line is a command line (a ``\\`` at the end joins the next line; a
``# comment`` is dropped; ``&&``, ``||``, ``;`` and ``|`` separate commands); in a
``console`` block only the lines that start with ``$ ``. Leading ``NAME=value`` words are
skipped. Then:

- ``workhorse ARGS``: ``build_parser().parse_args(ARGS)``, the parser the ``workhorse``
  command uses; nothing runs. Placeholders such as ``<id>`` need no substitute: the parser
  takes them as the plain strings a real id would be.
- ``python FILE.py ARGS``: FILE exists; if it uses argparse, it is run with
  ``ArgumentParser.parse_args`` made to stop right after parsing (so ARGS are checked by
  the script's own parser and nothing else runs), else ARGS must be empty.

A block whose fence is preceded by the line ``<!-- docs-test: skip -->`` is not read: for
commands not meant to be run as shown.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from workhorse.daemon.cli import build_parser

from .conftest import IN_CI, ROOT

#: It builds the site and parses commands; it only names workers (tests/conftest.py).
TIER = "pure"
DOCS = ROOT / "docs"
README = ROOT / "README.md"
MAX_README_LINES = 400
SKIP_MARK = "<!-- docs-test: skip -->"
SEPARATORS = {"&&", "||", ";", "|"}

#: Run as ``python -c PARSE_ONLY FILE ARGS...``: the script's own parser checks ARGS, and
#: the script stops as soon as they parse (exit 0) or not (argparse's exit 2).
PARSE_ONLY = """
import argparse, os, runpy, sys
path, args = sys.argv[1], sys.argv[2:]
original = argparse.ArgumentParser.parse_args
def parse_only(self, args=None, namespace=None):
    original(self, args, namespace)
    raise SystemExit(0)
argparse.ArgumentParser.parse_args = parse_only
sys.argv = [path, *args]
sys.path[0] = os.path.dirname(os.path.abspath(path))
runpy.run_path(path, run_name="__main__")
raise SystemExit("the script never parsed its arguments")
"""


@dataclass(frozen=True)
class Shown:
    """A command as a page shows it."""
    page: str
    line: int
    argv: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {shlex.join(self.argv)}"


def pages() -> list[Path]:
    return sorted([README, *DOCS.rglob("*.md")])


def _blocks(path: Path) -> list[tuple[str, int, list[str]]]:
    """(language, line number of its first line, lines) of each fenced block."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        start, body = i + 1, []
        i += 1
        while i < len(lines) and lines[i].rstrip() != "```":
            body.append(lines[i])
            i += 1
        skipped = start >= 2 and lines[start - 2].strip() == SKIP_MARK
        if not skipped:
            blocks.append((fence.group(1), start + 1, body))
        i += 1
    return blocks


def _split(text: str) -> list[list[str]]:
    """A shell line's commands, as argument lists (comments dropped)."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars="&|;")
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in SEPARATORS:
            commands.append([])
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


def shown_commands() -> list[Shown]:
    found = []
    for path in pages():
        page = str(path.relative_to(ROOT))
        for language, first, body in _blocks(path):
            if language not in ("sh", "console"):
                continue
            pending, at = "", first
            for number, raw in enumerate(body, first):
                if language == "console":
                    if not raw.startswith("$ "):
                        continue
                    raw = raw[2:]
                if not pending:
                    at = number
                if raw.rstrip().endswith("\\"):
                    pending += raw.rstrip()[:-1] + " "
                    continue
                text, pending = pending + raw, ""
                for argv in _split(text):
                    while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):
                        argv = argv[1:]
                    if argv:
                        found.append(Shown(page, at, tuple(argv)))
    return found


SHOWN = shown_commands()
WORKHORSE = [c for c in SHOWN if c.argv[0] == "workhorse"]
SCRIPTS = [c for c in SHOWN
           if c.argv[0] in ("python", "python3") and len(c.argv) > 1
           and c.argv[1].endswith(".py")]


@pytest.mark.timeout(120)
def test_the_site_builds_strict(tmp_path):
    """``mkdocs build --strict``: a broken link or anchor fails it (mkdocs.yml)."""
    missing = [name for name in ("mkdocs", "material")
               if importlib.util.find_spec(name) is None]
    if missing:
        message = (f"{' and '.join(missing)} not installed: pip install -e '.[docs]' to "
                   "build the documentation site")
        if IN_CI:
            pytest.fail(f"{message} (CI=true makes the docs build mandatory)")
        pytest.skip(message)
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
         str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True, timeout=110,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout}\n{run.stderr}"
    assert (tmp_path / "site" / "index.html").exists()


@pytest.mark.timeout(30)
def test_every_page_is_in_the_navigation():
    text = (ROOT / "mkdocs.yml").read_text()
    nav = text.split("\nnav:\n", 1)[1]
    nav = nav.split("\n\n", 1)[0]
    listed = re.findall(r"^\s+-\s+(?:[^:\n]+:\s+)?(\S+\.md)\s*$", nav, re.M)
    assert len(listed) == len(set(listed)), f"a page is listed twice in mkdocs.yml: {listed}"
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert set(listed) - on_disk == set(), "mkdocs.yml's nav lists pages that do not exist"
    assert on_disk - set(listed) == set(), "pages under docs/ missing from mkdocs.yml's nav"


def _anchors(page: Path) -> set[str]:
    """The heading ids MkDocs gives a page (its toc extension's default slugify)."""
    ids = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", page.read_text(), re.M):
        text = re.sub(r"`", "", heading)
        text = re.sub(r"[^\w\s-]", "", text).strip().lower()
        ids.add(re.sub(r"[-\s]+", "-", text))
    return ids


@pytest.mark.timeout(30)
def test_the_readme_is_short_and_links_only_to_docs_pages_that_exist():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES, (
        f"README.md has {len(text.splitlines())} lines; at most {MAX_README_LINES}: "
        "move the detail into docs/")
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links, "the README links to no docs page"
    for link in links:
        if re.match(r"^[a-z]+://", link):
            continue
        target, _, anchor = link.partition("#")
        assert target.startswith("docs/") and target.endswith(".md"), (
            f"README links to {link}: link to docs pages only")
        page = ROOT / target
        assert page.is_file(), f"README links to {link}, which does not exist"
        if anchor:
            assert anchor in _anchors(page), f"README links to {link}: no such heading"


@pytest.mark.timeout(30)
def test_the_shown_commands_are_found():
    """The reader below finds what the pages show (else the next two tests check nothing)."""
    assert any(c.argv[:2] == ("workhorse", "worker") and c.page == "README.md"
               for c in WORKHORSE)
    assert any(c.argv[:2] == ("workhorse", "dead") for c in WORKHORSE)
    assert any(c.argv[1] == "benchmarks/throughput.py" for c in SCRIPTS)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shown", WORKHORSE, ids=str)
def test_each_workhorse_command_shown_parses(shown):
    parser = build_parser()
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args(list(shown.argv[1:]))
        except SystemExit as exc:
            assert exc.code == 0, f"{shown}\n{errors.getvalue()}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shown", SCRIPTS, ids=str)
def test_each_script_command_shown_exists_and_parses(shown):
    script = ROOT / shown.argv[1]
    assert script.is_file(), f"{shown}: no such file"
    args = list(shown.argv[2:])
    if "argparse" not in script.read_text():
        assert not args, f"{shown}: the script takes no arguments"
        return
    run = subprocess.run([sys.executable, "-c", PARSE_ONLY, str(script), *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=50)
    assert run.returncode == 0, f"{shown}\n{run.stdout}{run.stderr}"


@pytest.mark.parametrize(("module", "fixtures", "marker", "expected"), [
    ("test_config", (), None, {"pure"}),
    ("test_schedule_timing", (), None, {"pure"}),
    ("test_worker", ("broker", "start_worker"), None, {"daemon", "broker"}),
    ("test_sqlite_transport", (), None, {"broker"}),
    ("test_schedules_exactly_once", ("broker",), "chaos", {"daemon", "broker", "chaos"}),
])
def test_tests_carry_their_tiers(module, fixtures, marker, expected):
    """The tiers conftest gives (``pytest -m pure`` etc.), on modules whose tier is known."""
    import importlib

    from .conftest import tiers
    item = SimpleNamespace(module=importlib.import_module(f"tests.{module}"),
                           fixturenames=fixtures,
                           get_closest_marker=lambda name: name if name == marker else None)
    assert tiers(item) == expected  # type: ignore[arg-type]
