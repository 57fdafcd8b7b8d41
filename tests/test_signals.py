"""Tier 2: the operator's signals on a real daemon. HUP reloads config and code, TTIN/TTOU
resize the pool, USR2 and TSTP are logged and ignored; none of them kills or stops it."""
from __future__ import annotations

import signal
import textwrap
from pathlib import Path

import psutil
import pytest

from tests.conftest import ROOT, Worker, make_broker, runs, wait_until, worker_env
from workhorse import App

pytestmark = pytest.mark.timeout(120)

TASKS = '''
import os
import time
from workhorse import App

app = App("reloadable")

@app.task(bind=True)
def version(self, seconds=0.0):
    with open(os.environ["WH_TEST_RUNLOG"], "a") as f:
        f.write(f"version {{self.request.id}} {{os.getpid()}}\\n")
    time.sleep(seconds)
    return "{version}"
'''


def write_tasks(directory: Path, version: str, broken: bool = False) -> None:
    source = TASKS.format(version=version) + ("\nthis is not python\n" if broken else "")
    (directory / "reloadable_tasks.py").write_text(source)


def write_config(path: Path, concurrency: int, time_limit: float | None = None) -> None:
    limits = f"time_limit = {time_limit}\n" if time_limit else ""
    path.write_text(textwrap.dedent(f"""\
        [worker]
        concurrency = {concurrency}
        [tasks]
        """) + limits)


def children(worker: Worker) -> list[int]:
    return sorted(worker.children())


def start(tmp_path: Path, concurrency: int = 1) -> tuple[Worker, App, Path]:
    broker = make_broker("sqlite", tmp_path)
    code = tmp_path / "code"
    code.mkdir()
    write_tasks(code, "v1")
    config = tmp_path / "workhorse.toml"
    write_config(config, concurrency)
    env = worker_env(broker, tmp_path)
    del env["WORKHORSE_CONCURRENCY"]          # from the config file, so a reload can change it
    env["PYTHONPATH"] = f"{code}:{ROOT}"
    worker = Worker(tmp_path, env, ["-A", "reloadable_tasks", "--config", str(config)])
    worker.wait_ready()
    client = App("client", broker_url=broker.url, result_backend=env["WORKHORSE_RESULT_BACKEND"],
                 queues=[broker.queue])
    return worker, client, config


@pytest.fixture
def reloadable(tmp_path: Path):
    started: list[Worker] = []

    def make(concurrency: int = 1) -> tuple[Worker, App, Path]:
        worker, client, config = start(tmp_path, concurrency)
        started.append(worker)
        return worker, client, config
    yield make
    for worker in started:
        worker.kill()


def test_sighup_reloads_config_and_code_without_losing_or_rerunning_a_task(
        reloadable, tmp_path):
    worker, client, config = reloadable(concurrency=1)
    assert client.send_task("reloadable_tasks.version").get(timeout=20) == "v1"
    old_children = children(worker)
    running = client.send_task("reloadable_tasks.version", kwargs={"seconds": 2.0})
    wait_until(lambda: len(runs(tmp_path)) == 2, 20, "the long task to start")
    buffered = client.send_task("reloadable_tasks.version")
    write_tasks(tmp_path / "code", "v2")
    write_config(config, concurrency=2)
    worker.signal(signal.SIGHUP)
    worker.wait_for_log(r"reloaded: 2 children")
    assert running.get(timeout=20) == "v1"          # the running task finished on old code
    assert buffered.get(timeout=20) == "v2"         # the buffered one waited, ran new code
    assert client.send_task("reloadable_tasks.version").get(timeout=20) == "v2"
    wait_until(lambda: len(children(worker)) == 2 and not set(children(worker)) & set(old_children),
               20, "two children, all forked after the reload")
    task_ids = [task_id for _, task_id, _ in runs(tmp_path)]
    assert len(task_ids) == len(set(task_ids)) == 4     # nothing ran twice
    assert worker.proc.poll() is None


def test_sighup_with_a_broken_module_or_config_keeps_the_running_code(reloadable, tmp_path):
    worker, client, config = reloadable()
    write_tasks(tmp_path / "code", "v2", broken=True)
    worker.signal(signal.SIGHUP)
    worker.wait_for_log(r"reload failed, still running")
    assert client.send_task("reloadable_tasks.version").get(timeout=20) == "v1"
    write_tasks(tmp_path / "code", "v3")
    config.write_text("[worker]\nconcurency = 3\n")
    worker.signal(signal.SIGHUP)
    worker.wait_for_log(r"reload failed, still running", count=2)
    assert "concurency" in worker.log()
    assert client.send_task("reloadable_tasks.version").get(timeout=20) == "v1"


def test_ttin_and_ttou_grow_and_shrink_the_pool_within_bounds(reloadable):
    worker, client, _ = reloadable(concurrency=1)
    worker.signal(signal.SIGTTIN)
    wait_until(lambda: len(children(worker)) == 2, 20, "a second child")
    worker.wait_for_log(r"pool resized to 2 children, prefetch window 8")
    worker.signal(signal.SIGTTOU)
    wait_until(lambda: len(children(worker)) == 1, 20, "back to one child")
    worker.signal(signal.SIGTTOU)
    worker.wait_for_log(r"the pool stays at 1 children")
    assert len(children(worker)) == 1
    assert client.send_task("reloadable_tasks.version").get(timeout=20) == "v1"


def test_a_shrinking_pool_lets_a_running_task_finish(reloadable, tmp_path):
    worker, client, _ = reloadable(concurrency=1)
    result = client.send_task("reloadable_tasks.version", kwargs={"seconds": 2.0})
    wait_until(lambda: runs(tmp_path), 20, "the task to start")
    worker.signal(signal.SIGTTIN)
    wait_until(lambda: len(children(worker)) == 2, 20, "a second child")
    busy = runs(tmp_path)[0][2]
    worker.signal(signal.SIGTTOU)
    worker.wait_for_log(r"pool resized to 1 children")
    wait_until(lambda: children(worker) == [busy], 20, "the idle child retired, not the busy one")
    assert result.get(timeout=20) == "v1"
    assert children(worker) == [busy]


@pytest.mark.parametrize("sig", [signal.SIGUSR2, signal.SIGTSTP])
def test_usr2_and_tstp_are_logged_and_ignored(reloadable, sig):
    worker, client, _ = reloadable()
    worker.signal(sig)
    worker.wait_for_log(rf"{sig.name} received")
    assert psutil.Process(worker.pid).status() != psutil.STATUS_STOPPED
    assert client.send_task("reloadable_tasks.version").get(timeout=20) == "v1"
    assert worker.proc.poll() is None
