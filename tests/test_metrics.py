"""Prometheus metrics: the exposition of the counts (pure), then a real worker scraped
while it runs tasks, a stuck scraper that must not hold up anything, and a port that is
taken."""
from __future__ import annotations

import socket
import urllib.request
import uuid

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from workhorse.daemon.metrics import BUCKETS, Metrics, _Collector

from .conftest import wait_until

pytestmark = pytest.mark.timeout(120)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_counts_are_exposed_in_prometheus_format():
    metrics = Metrics(lambda: {"buffered": 2, "running": 1}, lambda: 7)
    metrics.settled("t.add", "succeeded")
    metrics.settled("t.add", "succeeded")
    metrics.settled("t.add", "failed")
    metrics.ran("t.add", 0.003)
    metrics.ran("t.add", 0.2)
    metrics.ran("t.add", 5000.0)                  # above every bucket
    for reason in ("time_limit", "crashed", "time_limit"):
        metrics.child_exited(reason)
    metrics.dead_lettered, metrics.broker_connections, metrics.loop_lag = 4, 2, 0.125
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(metrics))
    found = samples(generate_latest(registry).decode())
    assert found[("workhorse_tasks_total", (("outcome", "succeeded"), ("task", "t.add")))] == 2
    assert found[("workhorse_tasks_total", (("outcome", "failed"), ("task", "t.add")))] == 1
    bucket = "workhorse_task_runtime_seconds_bucket"
    assert found[(bucket, (("le", "0.005"), ("task", "t.add")))] == 1
    assert found[(bucket, (("le", "0.25"), ("task", "t.add")))] == 2
    assert found[(bucket, (("le", str(BUCKETS[-1])), ("task", "t.add")))] == 2
    assert found[(bucket, (("le", "+Inf"), ("task", "t.add")))] == 3
    assert found[("workhorse_task_runtime_seconds_count", (("task", "t.add"),))] == 3
    assert found[("workhorse_task_runtime_seconds_sum", (("task", "t.add"),))] == (
        pytest.approx(5000.203))
    assert found[("workhorse_messages_held", (("stage", "buffered"),))] == 2
    assert found[("workhorse_child_restarts_total", (("reason", "time_limit"),))] == 2
    assert found[("workhorse_dead_lettered_total", ())] == 4
    assert found[("workhorse_broker_connections_total", ())] == 2
    assert found[("workhorse_lease_renewals_total", ())] == 7
    assert found[("workhorse_loop_lag_seconds", ())] == 0.125


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return samples(response.read().decode())


def test_a_worker_counts_what_it_ran_and_a_stuck_scraper_holds_nothing_up(
        broker, start_worker, client):
    port = _free_port()
    worker = start_worker(broker, metrics_port=port, concurrency=1)
    for n in range(3):
        assert client.send_task("tests.apps.basic.add", (n, n)).get(timeout=30) == 2 * n
    failed = client.send_task("tests.apps.basic.fail", ("boom",))
    with pytest.raises(Exception, match="boom"):
        failed.get(timeout=30)
    limited = client.send_task("tests.apps.basic.sleeper", (30,), time_limit=1)
    wait_until(lambda: client.AsyncResult(limited.id).state == "FAILURE", 30,
               "the hard limit to fail the task")

    add = (("outcome", "succeeded"), ("task", "tests.apps.basic.add"))
    restarts = ("workhorse_child_restarts_total", (("reason", "time_limit"),))

    def counted() -> dict | None:
        found = _scrape(port)
        return found if found.get(("workhorse_tasks_total", add)) == 3 and found.get(
            restarts) == 1 else None
    found = wait_until(counted, 20, "three adds and the killed child counted")
    assert found[("workhorse_tasks_total", (("outcome", "failed"),
                                            ("task", "tests.apps.basic.fail")))] == 1
    assert found[("workhorse_tasks_total", (("outcome", "time_limit"),
                                            ("task", "tests.apps.basic.sleeper")))] == 1
    assert found[("workhorse_task_runtime_seconds_count",
                  (("task", "tests.apps.basic.add"),))] == 3
    assert found[("workhorse_broker_connections_total", ())] >= 1
    assert found[("workhorse_messages_held", (("stage", "running"),))] == 0
    assert 0 <= found[("workhorse_loop_lag_seconds", ())] < 1

    # A scraper that connects and never finishes its request holds up neither the tasks
    # nor the next scrape.
    stuck = socket.create_connection(("127.0.0.1", port))
    try:
        stuck.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")      # no blank line: waits
        assert client.send_task("tests.apps.basic.add", (5, 5)).get(timeout=30) == 10
        # (The child stores the result before it tells the supervisor, which counts then.)
        wait_until(lambda: _scrape(port)[("workhorse_tasks_total", add)] == 4, 10,
                   "the fourth add counted, scraped past the stuck scraper")
    finally:
        stuck.close()
    assert worker.proc.poll() is None


@pytest.mark.parametrize("broker", ["sqlite"], indirect=True)
def test_a_taken_port_is_said_and_the_worker_runs_on(broker, start_worker, client):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        worker = start_worker(broker, metrics_port=port, hostname=f"m-{uuid.uuid4().hex[:6]}")
        worker.wait_for_log(f"metrics: cannot serve on 127.0.0.1:{port}")
        assert client.send_task("tests.apps.basic.add", (1, 2)).get(timeout=30) == 3
