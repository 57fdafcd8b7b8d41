"""The README's quick start: CI runs its test command verbatim, and its worker command
processes the example tasks on the embedded default with no other setup."""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys

import pytest

from .conftest import ROOT, wait_until

README = (ROOT / "README.md").read_text()


def quickstart(name: str) -> str:
    match = re.search(rf"<!-- quickstart:{name} -->\n```sh\n(.+?)\n```", README)
    assert match, f"README has no quickstart:{name} block"
    return match.group(1)


def test_ci_runs_the_readme_test_command_verbatim():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert quickstart("tests") in ci


def test_the_test_command_installs_test_extras_and_runs_pytest():
    command = quickstart("tests")
    assert "pip install -e '.[test]'" in command and command.endswith("pytest")


@pytest.mark.timeout(90)
def test_the_worker_command_runs_the_examples_on_the_embedded_default(tmp_path):
    """Everything after the install step, as written, in a fresh per-user state dir."""
    command = quickstart("worker")
    steps = [step.strip() for step in command.split("&&")]
    assert steps[2] == "pip install ."            # what CI's fresh install stands for here
    send, worker = steps[3], steps[4]
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKHORSE_")}
    state, cwd = tmp_path / "state", tmp_path / "cwd"
    cwd.mkdir()
    env.update(XDG_STATE_HOME=str(state), PYTHONUNBUFFERED="1")
    env.pop("STATE_DIRECTORY", None)
    python = [sys.executable if word == "python" else word for word in shlex.split(send)]
    subprocess.run(python, env=env, cwd=cwd, check=True, timeout=60, capture_output=True)
    argv = shlex.split(worker)
    assert argv[:2] == ["workhorse", "worker"]
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "workhorse", *argv[1:]], env=env,
                                cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        def finished() -> bool:
            text = log.read_text()
            return text.count("succeeded in") == 3 and "raised ValueError" in text
        wait_until(finished, 60, "the four example tasks in the worker's log")
        text = log.read_text()
        assert f"state directory: {state / 'workhorse'}" in text
        assert f"broker: sqlite:///{state / 'workhorse' / 'broker.sqlite3'}" in text
        proc.send_signal(signal.SIGINT)   # the README says: stop it with Ctrl-C
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
