"""Tier 2: schedules on a real worker: a reload (HUP) applies changed entries,
`workhorse schedules list` says what was sent and by whom, the metrics count it, and a
worker with schedules = false sends nothing."""
from __future__ import annotations

import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import ROOT, Worker, make_broker, wait_until, worker_env
from tests.servers import free_port

pytestmark = pytest.mark.timeout(120)


def entry(name: str, sink: str) -> str:
    return (f'[[schedule]]\nname = "{name}"\ntask = "tests.apps.basic.add"\nevery = "1s"\n'
            f'args = [1, 1]\nqueue = "{sink}"\n')


def sent_to(broker, sink: str) -> int:
    return broker.queue_size(sink)


def test_reload_list_and_metrics(tmp_path: Path):
    broker = make_broker("sqlite", tmp_path)
    config = tmp_path / "workhorse.toml"
    config.write_text(entry("first", "sink-a"))
    port = free_port()
    env = worker_env(broker, tmp_path, metrics_port=port, hostname="sender@test")
    env["WORKHORSE_CONFIG"] = str(config)
    worker = Worker(tmp_path, env, ["-A", "tests.apps.basic"])
    try:
        worker.wait_ready()
        wait_until(lambda: sent_to(broker, "sink-a") >= 2, 20, "two due times sent")
        listed = subprocess.run([sys.executable, "-m", "workhorse", "schedules", "list"],
                                cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
        assert listed.returncode == 0, listed.stderr
        assert "first: tests.apps.basic.add, every 1 s" in listed.stdout
        assert "by sender@test" in listed.stdout
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        assert b'workhorse_schedule_sent_total{schedule="first"}' in metrics

        config.write_text(entry("second", "sink-b"))
        worker.signal(signal.SIGHUP)
        worker.wait_for_log(r"reloaded: ")
        wait_until(lambda: sent_to(broker, "sink-b") >= 2, 20, "the new entry's due times")
        before = sent_to(broker, "sink-a")
        wait_until(lambda: sent_to(broker, "sink-b") >= 4, 20, "two more of them")
        assert sent_to(broker, "sink-a") == before         # the old entry is gone
    finally:
        worker.kill()


def test_a_worker_with_schedules_off_sends_none(tmp_path: Path):
    """Its due times pass while another worker's entry is sent three times: none of its."""
    broker = make_broker("sqlite", tmp_path)
    quiet, ticking = tmp_path / "quiet.toml", tmp_path / "ticking.toml"
    quiet.write_text(entry("quiet", "sink-q"))
    ticking.write_text(entry("ticking", "sink-t"))
    workers = []
    try:
        for config, on in ((quiet, False), (ticking, True)):
            env = worker_env(broker, tmp_path, schedules=on, hostname=f"{config.stem}@test")
            env["WORKHORSE_CONFIG"] = str(config)
            workers.append(Worker(tmp_path, env, ["-A", "tests.apps.basic"]))
        for worker in workers:
            worker.wait_ready()
        wait_until(lambda: sent_to(broker, "sink-t") >= 3, 20, "three due times of the other")
        assert sent_to(broker, "sink-q") == 0
        assert all(worker.proc.poll() is None for worker in workers)
    finally:
        for worker in workers:
            worker.kill()
