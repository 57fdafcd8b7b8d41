"""Every ``workhorse`` command the documentation shows, run for real: against a worker on
an SQLite broker started here (named ``workhorse@host1``, as the pages name one), with the
pages' placeholders made real (``<id>``: tasks sent here; ``7d0c…``: dead letters put
here under those ids; ``proj.tasks.slow``: a task of the test app; the config file: the
periodic-tasks page's own TOML). Each must exit 0; a ``console`` block's shown output must
be what the command prints. (``tests/test_docs.py`` parses every command, benchmarks
included; this runs those that ask or steer a worker, and the worker commands.)"""
from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from .conftest import ROOT, BrokerEnv, Worker, wait_until, worker_env
from .test_dead_cli import put_dead_letter

pytestmark = pytest.mark.timeout(300)

DOCS = ROOT / "docs"
HOST = "workhorse@host1"
#: A page's names for what does not exist here, and what the test runs instead.
STANDS_FOR = {"proj.tasks.slow": "tests.apps.basic.sleeper", "proj": "tests.apps.basic",
              "myproject.tasks": "tests.apps.basic"}


def shown_commands() -> list[tuple[str, str, list[str]]]:
    """(page, command line, the output shown under it) for every ``workhorse`` command in
    the pages' sh and console blocks, in page order."""
    found = []
    for page in sorted(DOCS.glob("*.md")):
        for kind, block in re.findall(r"```(sh|console)\n(.*?)```", page.read_text(), re.S):
            lines = block.splitlines()
            for n, line in enumerate(lines):
                text = line.removeprefix("$ ").split("  #")[0].strip()
                if not text.startswith("workhorse "):
                    continue
                output = []
                if kind == "console":
                    for after in lines[n + 1:]:
                        if after.startswith("$ "):
                            break
                        output.append(after)
                found.append((page.name, text, output))
    return found


def periodic_toml() -> str:
    text = (DOCS / "periodic.md").read_text()
    return re.search(r"```toml\n(\[\[schedule\]\].*?)```", text, re.S).group(1)


@pytest.fixture
def host1(tmp_path):
    """A worker named workhorse@host1 on an SQLite broker, queue ``celery``."""
    broker = BrokerEnv("sqlite", f"sqlite:///{tmp_path / 'broker.sqlite3'}", "celery")
    env = worker_env(broker, tmp_path, hostname=HOST, concurrency=1)
    worker = Worker(tmp_path, env, ["-A", "tests.apps.basic"])
    worker.wait_ready()
    worker.wait_for_log(r"remote control: answering")
    yield broker, env
    worker.kill()


def test_the_pages_show_workhorse_commands():
    commands = [text.split()[1] for _, text, _ in shown_commands()]
    assert {"inspect", "control", "dead", "config", "schedules", "worker"} <= set(commands)


def test_every_command_the_pages_show_runs(host1, tmp_path):
    broker, env = host1
    config = tmp_path / "workhorse.toml"
    config.write_text(periodic_toml())
    ran: list[str] = []
    shutdown = None
    for page, text, output in shown_commands():
        argv = shlex.split(text)[1:]
        if argv[0] == "worker":
            continue                        # below: each started, ready, stopped
        if argv[:2] == ["control", "shutdown"]:
            shutdown = argv                 # last: it stops the worker
            continue
        argv = concrete(argv, broker, env, config, tmp_path)
        done = subprocess.run([sys.executable, "-m", "workhorse", *argv], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{page}: {text}\n{done.stdout}{done.stderr}"
        if output:
            assert done.stdout.splitlines() == output, f"{page}: {text}"
        ran.append(text)
    assert shutdown is not None
    done = subprocess.run([sys.executable, "-m", "workhorse", *shutdown], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    others = [text for _, text, _ in shown_commands() if shlex.split(text)[1] != "worker"]
    assert len(ran) + 1 == len(others) >= 20, ran


def concrete(argv: list[str], broker: BrokerEnv, env: dict[str, str], config: Path,
             tmp_path: Path) -> list[str]:
    """The command with the page's placeholders made real."""
    if argv[0] in ("config", "schedules"):
        return [str(config) if word.endswith(".toml") else word for word in argv]
    if argv[0] == "dead":
        ids = [word for word in argv[2:] if not word.startswith("-") and "…" in word]
        for task_id in ids:
            put_dead_letter(broker, task_id)
        return argv
    out = []
    for word in argv:
        if word == "<id>":
            word = send(env, countdown=600)
        out.append(STANDS_FOR.get(word, word))
    return out


def send(env: dict[str, str], countdown: int) -> str:
    """A task sent to the worker (held as scheduled): its id."""
    task_id = str(uuid.uuid4())
    code = ("from tests.apps import basic; basic.app.configure(); "
            f"basic.add.apply_async((1, 2), task_id={task_id!r}, countdown={countdown})")
    subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, check=True, timeout=60)
    return task_id


@pytest.mark.parametrize("text", [text for _, text, _ in shown_commands()
                                  if text.split()[1] == "worker" and "&&" not in text])
def test_every_worker_command_the_pages_show_starts_a_worker(text, tmp_path):
    argv = [STANDS_FOR.get(word, word) for word in shlex.split(text)[2:]]
    broker = BrokerEnv("sqlite", f"sqlite:///{tmp_path / 'broker.sqlite3'}", "celery")
    env = worker_env(broker, tmp_path)
    env.pop("WORKHORSE_QUEUES")             # the command's -Q, if it has one
    worker = Worker(tmp_path, env, argv)
    try:
        worker.wait_ready()
        worker.signal(signal.SIGTERM)
        wait_until(lambda: worker.proc.poll() is not None, 60, "the worker to stop")
        assert worker.proc.returncode == 0, worker.log()[-2000:]
    finally:
        worker.kill()
