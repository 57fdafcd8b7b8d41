"""`workhorse dead list|requeue|purge` on each broker."""
from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from kombu import Producer

from workhorse.broker.consumer import (
    DEAD_AT_HEADER,
    DEAD_QUEUE_HEADER,
    DEAD_REASON_HEADER,
    DEAD_TASK_HEADER,
    DEAD_WORKER_HEADER,
)
from workhorse.protocol import DELIVERIES_HEADER
from workhorse.broker.queues import ensure_queue

from .conftest import ROOT, wait_until, worker_env

pytestmark = pytest.mark.timeout(120)

#: An entry no transport can read: not JSON, not UTF-8.
RAW = b"\xff\x00not a message{"


def dead(broker, tmp_path, *args):
    env = worker_env(broker, tmp_path)
    return subprocess.run([sys.executable, "-m", "workhorse", "dead", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def listed(broker, tmp_path) -> list[dict]:
    result = dead(broker, tmp_path, "list", "--json")
    assert result.returncode == 0 and not result.stderr, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def reported(result) -> dict[str, str]:
    """One line per dead letter: dead queue, id, what was done."""
    return {line.split("\t")[1]: line.split("\t")[2] for line in result.stdout.splitlines()}


def put_dead_letter(broker, task_id: str) -> None:
    """A dead letter as a worker writes one."""
    with broker.connection() as conn:
        dead_queue = broker.queue + ".dead"
        ensure_queue(conn, dead_queue)
        Producer(conn.default_channel).publish(
            json.dumps([["x"], {}, {}]), exchange="", routing_key=dead_queue,
            content_type="application/json", content_encoding="utf-8", delivery_mode=2,
            headers={"id": task_id, "task": "tests.apps.basic.fail", "argsrepr": "('x',)",
                     DEAD_REASON_HEADER: "failed: ValueError('x')", DEAD_TASK_HEADER: task_id,
                     DEAD_QUEUE_HEADER: broker.queue, DEAD_AT_HEADER: "2024-01-01T00:00:00",
                     DEAD_WORKER_HEADER: "test"})


def put_raw(broker, queue: str, data: bytes) -> None:
    """An entry no worker could read: a raw Redis list entry, a SQLite row that is not
    kombu's JSON, a RabbitMQ message with a body that is not JSON and no headers."""
    if broker.kind == "sqlite":
        from workhorse.transport.store import Store
        store = Store(Path(broker.url.removeprefix("sqlite:///")))
        store.put(queue, data)          # type: ignore[arg-type]  (bytes, as strangers write)
        store.close()
    elif broker.kind == "redis":
        import redis
        redis.Redis.from_url(broker.url).lpush(queue, data)
    else:
        import amqp
        with broker.connection() as conn:
            ensure_queue(conn, queue)
            conn.default_channel.basic_publish(amqp.Message(data), exchange="",
                                               routing_key=queue)


def test_list_requeue_purge(broker, client, start_worker, tmp_path):
    from tests.apps.basic import fail
    worker = start_worker(broker, acks_on_failure=False, concurrency=1)   # in order
    failed = [fail.delay(f"n{i}") for i in range(3)]
    for r in failed:
        r.get(timeout=20, propagate=False)
    wait_until(lambda: broker.queue_size(broker.queue + ".dead") == 3, 20, "three dead letters")
    worker.stop()

    rows = listed(broker, tmp_path)
    assert [r["task_id"] for r in rows] == [r.id for r in failed]
    assert [r["id"] for r in rows] == [r.id for r in failed]
    assert rows[0]["task"] == "tests.apps.basic.fail" and rows[0]["reason"].startswith("failed")
    assert rows[0]["queue"] == broker.queue and rows[0]["dead_queue"] == broker.queue + ".dead"
    assert not rows[0]["unreadable"]
    assert [r["task_id"] for r in listed(broker, tmp_path)] == [r.id for r in failed]

    assert dead(broker, tmp_path, "requeue").returncode == 2  # ids or --all, never a guess
    replayed = dead(broker, tmp_path, "requeue", failed[1].id)
    assert replayed.returncode == 0
    assert reported(replayed) == {failed[1].id: f"requeued to {broker.queue}"}
    [(headers, _)] = broker.drain(broker.queue)
    assert headers["id"] == failed[1].id and headers[DELIVERIES_HEADER] == 0
    assert DEAD_REASON_HEADER not in headers
    assert [r["task_id"] for r in listed(broker, tmp_path)] == [failed[0].id, failed[2].id]

    purged = dead(broker, tmp_path, "purge", "--all")
    assert purged.returncode == 0
    assert reported(purged) == {failed[0].id: "purged", failed[2].id: "purged"}
    assert broker.queue_size(broker.queue + ".dead") == 0


def test_listing_leaves_every_dead_letter_in_place_and_in_order(broker, tmp_path):
    """Even an entry no transport can read, left raw in the dead-letter queue (as earlier
    versions left them on Redis): listed as unreadable, never taken away."""
    dead_queue = broker.queue + ".dead"
    first, last = str(uuid.uuid4()), str(uuid.uuid4())
    put_dead_letter(broker, first)
    put_raw(broker, dead_queue, RAW)
    put_dead_letter(broker, last)
    assert broker.queue_size(dead_queue) == 3

    listings = []
    for _ in range(2):
        rows = listed(broker, tmp_path)
        assert broker.queue_size(dead_queue) == 3
        listings.append([r["id"] for r in rows])
    assert listings[0] == listings[1]
    assert listings[0][0] == first and listings[0][2] == last
    raw = rows[1]
    assert raw["unreadable"] and raw["id"].startswith("unreadable-") and raw["task_id"] is None
    assert "not a message" in raw["raw"]
    if broker.kind != "amqp":    # (on RabbitMQ it is a message, with no headers at all)
        assert raw["reason"].startswith("unreadable: not JSON")


def test_an_unreadable_entry_is_dead_lettered_in_an_envelope_by_a_worker_and_listed(
        broker, client, start_worker, tmp_path):
    from tests.apps.basic import add
    dead_queue = broker.queue + ".dead"
    put_raw(broker, broker.queue, RAW)
    start_worker(broker)
    assert add.delay(2, 3).get(timeout=30) == 5          # the worker goes on working
    wait_until(lambda: broker.queue_size(dead_queue) == 1, 20, "the entry to be dead-lettered")
    assert broker.queue_size() == 0

    for _ in range(2):
        [row] = listed(broker, tmp_path)
        assert broker.queue_size(dead_queue) == 1
    assert row["unreadable"] and row["id"].startswith("unreadable-")
    assert row["queue"] == broker.queue and row["dead_at"]
    # RabbitMQ hands over a readable message with no task headers: read as protocol v1,
    # whose body is not JSON. SQLite and Redis cannot even read it as a kombu message.
    assert row["reason"].startswith("malformed: body is not valid" if broker.kind == "amqp"
                                    else "unreadable: not JSON")
    assert "not a message" in row["raw"]
    [(headers, body)] = broker.drain(dead_queue)
    assert body == RAW and headers[DEAD_REASON_HEADER] == row["reason"]


def test_requeue_and_purge_report_each_dead_letter_and_keep_the_unreadable(broker, tmp_path):
    dead_queue = broker.queue + ".dead"
    a, b, c = (str(uuid.uuid4()) for _ in range(3))
    put_dead_letter(broker, a)
    put_raw(broker, dead_queue, RAW)
    put_dead_letter(broker, b)
    # RabbitMQ routes a publish after it returns: list once all three are in the queue.
    wait_until(lambda: broker.queue_size(dead_queue) == 3, 10, "three dead letters")
    [raw_id] = [r["id"] for r in listed(broker, tmp_path) if r["unreadable"]]

    requeued = dead(broker, tmp_path, "requeue", "--all")
    assert requeued.returncode == 0, requeued.stdout + requeued.stderr
    assert reported(requeued) == {a: f"requeued to {broker.queue}",
                                  b: f"requeued to {broker.queue}",
                                  raw_id: "skipped: unreadable, left in place"}
    assert broker.queue_size() == 2 and broker.queue_size(dead_queue) == 1

    put_dead_letter(broker, c)
    purged = dead(broker, tmp_path, "purge", c, "no-such-task")
    assert purged.returncode == 1           # something named could not be done
    assert reported(purged) == {c: "purged", "no-such-task": "not found"}

    purged_all = dead(broker, tmp_path, "purge", "--all")
    assert purged_all.returncode == 0
    assert reported(purged_all) == {
        raw_id: "skipped: unreadable, left in place (name it to purge it)"}
    assert [r["id"] for r in listed(broker, tmp_path)] == [raw_id]

    named = dead(broker, tmp_path, "requeue", raw_id)
    assert named.returncode == 1
    assert reported(named) == {raw_id: "skipped: unreadable, left in place"}
    named = dead(broker, tmp_path, "purge", raw_id)
    assert named.returncode == 0 and reported(named) == {raw_id: "purged"}
    assert broker.queue_size(dead_queue) == 0 and broker.queue_size() == 2


@pytest.mark.parametrize("broker", ["sqlite"], indirect=True)
def test_dead_list_into_a_closed_pipe_exits_quietly(broker, tmp_path):
    for _ in range(3):
        put_dead_letter(broker, str(uuid.uuid4()))
    proc = subprocess.Popen([sys.executable, "-m", "workhorse", "dead", "list", "--json"],
                            env=worker_env(broker, tmp_path), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()         # the reader is gone before the first line is written
    _, err = proc.communicate(timeout=60)
    assert err == b"" and proc.returncode == 0
    assert broker.queue_size(broker.queue + ".dead") == 3


@pytest.mark.parametrize("broker", ["sqlite"], indirect=True)
def test_dead_list_json_piped_to_head_prints_no_traceback(broker, tmp_path):
    with broker.connection() as conn:      # more than a pipe holds, so the writer sees EPIPE
        dead_queue = broker.queue + ".dead"
        ensure_queue(conn, dead_queue)
        producer = Producer(conn.default_channel)
        for n in range(400):
            producer.publish([["x" * 200], {}, {}], exchange="", routing_key=dead_queue,
                             headers={"id": f"t{n}", "task": "t",
                                      DEAD_REASON_HEADER: "failed: x" * 20})
    result = subprocess.run(
        f"{sys.executable} -m workhorse dead list --json --limit 1000 | head -1", shell=True,
        env=worker_env(broker, tmp_path), cwd=ROOT, capture_output=True, text=True,
        timeout=60)
    assert json.loads(result.stdout)["task_id"] == "t0"
    assert result.stderr == ""
