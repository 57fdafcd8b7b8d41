"""Redis Sentinel on a set of its own (tests/redis_sentinel.py: a master, a replica, three
sentinels with quorum 2, apart from the shared Redis): a worker whose broker and results
are on the set drains tasks while the master is SIGKILLed; every task completes, none is
lost, the worker consumes from the new master on its own, results are read after the
failover. Also: the first sentinel listed is down at start, and remote control answers
``workhorse inspect ping`` and Celery's ``inspect().ping()`` through the sentinels; every
sentinel down for 10 s.

By hand: ``CI=true pytest tests/test_redis_sentinel.py -s`` (it prints its figures)."""
from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections import Counter

import pytest

from .conftest import IN_CI, ROOT, BrokerEnv, runs, wait_until, worker_env
from .redis_sentinel import SentinelSet, available

pytestmark = [pytest.mark.timeout(300), pytest.mark.broker("redis")]

TASKS = 2000


@pytest.fixture
def sentinel_set(tmp_path):
    why = available()
    if why:
        if IN_CI:
            pytest.fail(f"{why}, and CI=true makes the Sentinel tests mandatory")
        pytest.skip(why)
    found = SentinelSet(tmp_path / "sentinel")
    try:
        yield found.up()
    finally:
        found.down()


def urls(found: SentinelSet, db: int) -> str:
    return f"{found.urls(db)}?master_name={found.master_name}"


def client_for(monkeypatch, broker: BrokerEnv, results: str, tmp_path):
    for key, value in worker_env(broker, tmp_path, result_backend=results).items():
        if key.startswith(("WORKHORSE_", "WH_TEST_")):
            monkeypatch.setenv(key, value)
    from tests.apps import basic
    basic.app.configure()
    return basic


def test_the_master_killed_mid_drain_loses_no_task(sentinel_set, start_worker, monkeypatch,
                                                    tmp_path):
    broker = BrokerEnv("redis", urls(sentinel_set, 0), f"s-{uuid.uuid4().hex[:8]}")
    results = urls(sentinel_set, 1)
    basic = client_for(monkeypatch, broker, results, tmp_path)
    try:
        sent = [basic.record.delay() for _ in range(TASKS)]
        worker = start_worker(broker, result_backend=results)
        wait_until(lambda: len(runs(tmp_path)) >= TASKS // 3, 120, "a third of the tasks")
        old_master = sentinel_set.master()
        sentinel_set.kill_master()
        done_at_kill = len(runs(tmp_path))
        failover = sentinel_set.wait_failover(30)
        new_master = sentinel_set.master()
        assert new_master != old_master
        wait_until(lambda: len(runs(tmp_path)) > done_at_kill + 50, 15,
                   "tasks taken from the new master within 15 s of the kill")
        resumed = time.monotonic() - sentinel_set.killed_at
        for result in sent:                         # read after the failover
            assert result.get(timeout=120) == result.id
        started = Counter(task_id for _, task_id, _ in runs(tmp_path))
        assert set(started) == {r.id for r in sent}, "a task never ran"
        twice = sorted(t for t, n in started.items() if n > 1)
        assert worker.proc.poll() is None
        assert "Traceback" not in worker.log()
        print(f"\nSentinel failover: {TASKS} tasks, 0 lost, {len(twice)} ran twice; "
              f"{done_at_kill} had run at the kill; new master after {failover:.1f} s, "
              f"tasks from it {resumed:.1f} s after the kill")
        # With results on the same set (replicated in order with the broker's keys), a task
        # whose ack the failover lost finds its result stored and is not run again.
        assert twice == [], twice
    finally:
        basic.app.close()


def test_the_first_sentinel_down_at_start_is_passed_over(sentinel_set, start_worker,
                                                          monkeypatch, tmp_path):
    sentinel_set.kill(sentinel_set.sentinels[0])
    broker = BrokerEnv("redis", urls(sentinel_set, 0), f"s-{uuid.uuid4().hex[:8]}")
    results = urls(sentinel_set, 1)
    basic = client_for(monkeypatch, broker, results, tmp_path)
    try:
        hostname = f"snt-{uuid.uuid4().hex[:8]}@test"
        start_worker(broker, result_backend=results, hostname=hostname)
        assert basic.add.delay(2, 3).get(timeout=30) == 5
        env = worker_env(broker, tmp_path, result_backend=results)
        ping = subprocess.run([sys.executable, "-m", "workhorse", "inspect", "ping", "-d",
                               hostname, "--timeout", "10"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)
        assert ping.returncode == 0 and "pong" in ping.stdout, ping.stderr
        celery = pytest.importorskip("celery")
        app = celery.Celery("inspector", broker=sentinel_set.urls(0))
        app.conf.broker_transport_options = {"master_name": sentinel_set.master_name}
        try:
            replies = app.control.inspect(destination=[hostname], timeout=10).ping()
            assert replies == {hostname: {"ok": "pong"}}
        finally:
            app.close()
    finally:
        basic.app.close()


def test_every_sentinel_down_for_10_s_stops_nothing_that_needs_no_new_connection(
        sentinel_set, start_worker, monkeypatch, tmp_path):
    """The sentinels only name the master: while all three are down (a 10 s outage, the
    fault injected) the worker goes on with the connections it has to the master, which is
    up; once they are back, everything sent before and after runs, none lost."""
    broker = BrokerEnv("redis", urls(sentinel_set, 0), f"s-{uuid.uuid4().hex[:8]}")
    results = urls(sentinel_set, 1)
    basic = client_for(monkeypatch, broker, results, tmp_path)
    try:
        sent = [basic.record.delay(0.02) for _ in range(400)]
        worker = start_worker(broker, result_backend=results)
        wait_until(lambda: len(runs(tmp_path)) >= 50, 60, "the drain to start")
        for sentinel in sentinel_set.sentinels:
            sentinel_set.kill(sentinel)
        down_at = time.monotonic()
        ran = len(runs(tmp_path))
        wait_until(lambda: len(runs(tmp_path)) > ran + 50, 10,
                   "tasks to go on running while the sentinels are down")
        time.sleep(max(0.0, 10 - (time.monotonic() - down_at)))   # the outage: 10 s
        for i in range(len(sentinel_set.sentinels)):
            sentinel_set.start_sentinel(i)
        sentinel_set.settle()
        later = [basic.record.delay() for _ in range(5)]
        for result in sent + later:
            assert result.get(timeout=120) == result.id
        started = Counter(task_id for _, task_id, _ in runs(tmp_path))
        assert set(started) == {r.id for r in sent + later}
        assert worker.proc.poll() is None
        assert "Traceback" not in worker.log()
    finally:
        basic.app.close()
