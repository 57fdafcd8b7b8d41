"""Backlog signals and autoscaling on a real worker and a real broker: /scale and the
queue metrics say what waits and how long, and ``autoscale`` grows the pool on a backlog,
keeps every message's settlement, and shrinks it back once nothing waits."""
from __future__ import annotations

import json
import socket
import urllib.request
from collections import Counter
from typing import Any

import pytest

from .conftest import broker_fixture, BROKERS, runs, wait_until
from .test_metrics import samples

pytestmark = pytest.mark.timeout(150)

broker = broker_fixture(*BROKERS, "quorum")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scale(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/scale", timeout=10) as answer:
        return json.loads(answer.read())


def scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        return samples(answer.read().decode())


def test_scale_tells_the_backlog_its_age_and_the_busy_slots(broker, start_worker, client,
                                                            tmp_path):
    for _ in range(12):
        client.send_task("tests.apps.basic.record", (0.4,))
    port = _free_port()
    start_worker(broker, metrics_port=port, concurrency=1, prefetch_multiplier=1,
                 result_backend="disabled")
    queue = broker.queue

    def backlog_seen() -> bool:
        found = scale(port)
        q = found["queues"].get(queue) or {}
        return (found["backlog_known"] and (q.get("ready") or 0) >= 5
                and found["slots"] == {"busy": 1, "total": 1}
                and (q.get("oldest_age") or 0) >= 1.0)
    wait_until(backlog_seen, 60, "/scale to show the backlog, an age and the busy child")
    found = scale(port)
    q = found["queues"][queue]
    # SQLite and Redis read the oldest message's send time; RabbitMQ cannot show it, so
    # the age there is bounded by how long the queue was not seen empty.
    assert q["oldest_age_estimated"] is (broker.kind in ("amqp", "quorum"))
    assert found["load"] > 1.0 and found["ready"] == q["ready"]
    if broker.kind in ("amqp", "quorum"):
        assert q["consumers"] == 1
    metrics = scrape(port)
    assert metrics[("workhorse_queue_ready_messages", (("queue", queue),))] >= 1
    assert metrics[("workhorse_queue_oldest_ready_age_seconds", (("queue", queue),))] > 0
    assert metrics[("workhorse_slots", (("state", "busy"),))] == 1
    wait_until(lambda: len(runs(tmp_path)) == 12, 60, "every task to run")
    wait_until(lambda: (scale(port)["ready"] == 0), 30, "/scale to see the queue empty")
    metrics = scrape(port)
    # Sent by workhorse's client, which stamps the send time: every wait counted from it.
    assert metrics[("workhorse_task_wait_seconds_count", (("since", "sent"),))] == 12
    assert metrics[("workhorse_task_wait_seconds_sum", (("since", "sent"),))] > 12 * 0.4


def test_an_eta_message_waits_in_scheduled_not_in_the_backlog(broker, start_worker, client):
    port = _free_port()
    start_worker(broker, metrics_port=port, result_backend="disabled")
    # Under 10 s: on a quorum queue a longer one waits in RabbitMQ's delay levels instead.
    client.send_task("tests.apps.basic.record", countdown=8)

    def held() -> bool:
        found = scale(port)
        q = found["queues"].get(broker.queue) or {}
        return (q.get("scheduled") == 1 and q.get("ready") == 0 and found["scheduled"] == 1
                and found["load"] == 0.0)
    wait_until(held, 8, "the countdown task held as scheduled, the queue empty, no load")


def test_autoscale_grows_on_a_backlog_and_shrinks_back_losing_nothing(broker, start_worker,
                                                                     client, tmp_path):
    tasks = 45
    for _ in range(tasks):
        client.send_task("tests.apps.basic.record", (0.3,))
    port = _free_port()
    worker = start_worker(broker, metrics_port=port, autoscale="3,1", concurrency=1,
                          prefetch_multiplier=1, autoscale_target_age=0.5, autoscale_idle=2,
                          result_backend="disabled")
    windows: list[tuple[int, int]] = []

    def grown() -> bool:
        found = scrape(port)
        held = sum(v for (name, _), v in found.items() if name == "workhorse_messages_held")
        total = sum(v for (name, _), v in found.items() if name == "workhorse_slots")
        windows.append((int(held), int(total)))
        return "pool resized to 3 children" in worker.log()
    wait_until(grown, 60, "the pool to grow to its most, 3 children")
    assert "pool resized to 2 children" in worker.log()
    wait_until(lambda: len(runs(tmp_path)) == tasks, 60, "every task to run")
    worker.wait_for_log(r"autoscale .*pool resized to 2 children, prefetch window 2", 30)
    worker.wait_for_log(r"autoscale .*pool resized to 1 children, prefetch window 1", 30)
    counts = Counter(task_id for _, task_id, _ in runs(tmp_path))
    assert len(counts) == tasks and set(counts.values()) == {1}, "a task ran twice"
    # The window followed the pool (prefetch 1): never more held than the 3 children of
    # the largest pool allow, and the larger window was used.
    held = [h for h, _ in windows]
    assert max(held) <= 3, windows
    assert max(held) >= 2, f"the grown window was never used: a weak test ({windows})"
