"""Messages that are not plain protocol v2, on every broker: malformed ones fail their
result under their id (when they have one) and are dead-lettered; protocol v1 messages
(Celery 3 producers) run like v2 ones."""
from __future__ import annotations

import base64
import json
import sys
import uuid

import pytest
from kombu import Producer

from workhorse.broker.consumer import DEAD_REASON_HEADER, DEAD_TASK_HEADER
from workhorse.exceptions import MalformedMessage
from workhorse.protocol import RAW_HEADERS_HEADER, build_message
from workhorse.broker.queues import task_queue

from .conftest import BROKERS, broker_fixture, runs, wait_until

#: (quorum: the same on a RabbitMQ quorum queue)
broker = broker_fixture(*BROKERS, "quorum")

pytestmark = pytest.mark.timeout(90)

COUNTING = "tests.apps.basic:CountingBackend"


def publish_raw(broker, body, headers, content_type="application/json"):
    """Put a message on the test queue exactly as given, bypassing workhorse's client."""
    with broker.connection() as conn:
        Producer(conn).publish(body, exchange="", routing_key=broker.queue, headers=headers,
                               content_type=content_type, content_encoding="utf-8",
                               declare=[task_queue(broker.queue, broker.queue_type)])


def stores_of(tmp_path, task_id: str) -> list[str]:
    """The results CountingBackend stored under ``task_id``, in order."""
    return [name for name, tid, _ in runs(tmp_path)
            if name.startswith("stored:") and tid == task_id]


def v1_body(task: str, task_id: str, args: list, **fields) -> bytes:
    """A protocol v1 body as Celery 3 (and Celery 5 with task_protocol = 1) lays it out."""
    body = {"task": task, "id": task_id, "args": args, "kwargs": {}, "retries": 0,
            "eta": None, "expires": None, "utc": True, "callbacks": None, "errbacks": None,
            "chord": None, "taskset": None, "timelimit": [None, None], **fields}
    return json.dumps(body).encode()


@pytest.mark.parametrize("body, content_type, why", [
    (b"this is not json", "application/json", "not valid"),
    (b"\x80\x04K\x01.", "application/x-python-serialize", "not accepted"),
    (b'{"args": [1, 2]}', "application/json", "triple"),
], ids=["not-json", "pickle", "wrong-shape"])
def test_a_body_that_cannot_be_read_fails_its_result_with_malformed_message(
        broker, client, start_worker, tmp_path, body, content_type, why):
    start_worker(broker, result_backend=COUNTING)
    task_id = f"bad-{uuid.uuid4()}"
    headers = build_message("tests.apps.basic.add", task_id, [1, 2]).headers
    publish_raw(broker, body, headers, content_type=content_type)
    with pytest.raises(MalformedMessage, match=why):
        client.AsyncResult(task_id).get(timeout=15)
    dead = wait_until(lambda: broker.drain(broker.queue + ".dead"), 10, "the dead letter")
    assert len(dead) == 1
    dead_headers, dead_body = dead[0]
    assert dead_headers[DEAD_TASK_HEADER] == task_id and dead_body == body
    assert why in dead_headers[DEAD_REASON_HEADER]
    assert stores_of(tmp_path, task_id) == ["stored:FAILURE"]
    assert broker.queue_size() == 0


def test_headers_that_cannot_be_read_fail_the_result_of_the_id_they_give(
        broker, client, start_worker, tmp_path):
    start_worker(broker, result_backend=COUNTING)
    task_id = f"bad-{uuid.uuid4()}"
    headers = {**build_message("tests.apps.basic.add", task_id, [1, 2]).headers,
               "retries": "many"}
    publish_raw(broker, b"[[1, 2], {}, {}]", headers)
    with pytest.raises(MalformedMessage, match="retries"):
        client.AsyncResult(task_id).get(timeout=15)
    dead = wait_until(lambda: broker.drain(broker.queue + ".dead"), 10, "the dead letter")
    assert [h[DEAD_TASK_HEADER] for h, _ in dead] == [task_id]
    assert stores_of(tmp_path, task_id) == ["stored:FAILURE"]


def test_a_malformed_message_without_an_id_is_dead_lettered_and_nothing_stored(
        broker, client, start_worker, tmp_path):
    from tests.apps.basic import add
    worker = start_worker(broker, result_backend=COUNTING)
    publish_raw(broker, b"[[1, 2], {}, {}]", {"task": "tests.apps.basic.add"})
    worker.wait_for_log("malformed")
    assert add.delay(20, 22).get(timeout=20) == 42     # the worker goes on
    dead = wait_until(lambda: broker.drain(broker.queue + ".dead"), 10, "the dead letter")
    assert len(dead) == 1 and dead[0][0].get(DEAD_TASK_HEADER) is None
    assert "'id'" in dead[0][0][DEAD_REASON_HEADER]
    stored = [name for name, _, _ in runs(tmp_path) if name.startswith("stored:")]
    assert stored == ["stored:SUCCESS"]                 # add's, nothing for the bad one


def test_a_message_nested_too_deeply_to_read_is_dead_lettered_and_the_worker_goes_on(
        broker, client, start_worker, tmp_path):
    """Headers nested 3,000 tables deep: no decoder here reads them (each raises
    RecursionError). On RabbitMQ the message is dead-lettered as malformed, its body as it
    was and its headers' bytes kept in base64; on SQLite and Redis the whole entry cannot
    be read, and its envelope keeps it. Either way the message behind it runs: the worker
    does not fail on it again each time the broker gives it back."""
    from tests.apps.basic import add
    start_worker(broker, result_backend=COUNTING)
    deep: dict = {}
    for _ in range(3000):
        deep = {"x": deep}
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20000)        # (the producer's encoders recurse as well)
    try:
        publish_raw(broker, b"[[1, 2], {}, {}]",
                    {"task": "tests.apps.basic.add", "id": "too-deep", "deep": deep})
    finally:
        sys.setrecursionlimit(limit)
    assert add.delay(20, 22).get(timeout=20) == 42
    dead = wait_until(lambda: broker.drain(broker.queue + ".dead"), 10, "the dead letter")
    assert len(dead) == 1
    headers, body = dead[0]
    assert "nested too deeply to read" in headers[DEAD_REASON_HEADER]
    if broker.rabbitmq:
        assert body == b"[[1, 2], {}, {}]"
        assert base64.b64decode(headers[RAW_HEADERS_HEADER]).count(b"\x01xF") == 3000
    else:
        assert b'"too-deep"' in body            # the whole entry, as it was
    stored = [name for name, _, _ in runs(tmp_path) if name.startswith("stored:")]
    assert stored == ["stored:SUCCESS"]                 # add's, nothing for the bad one


def test_a_protocol_v1_message_runs_and_its_result_is_readable(broker, client, start_worker):
    start_worker(broker)
    task_id = f"v1-{uuid.uuid4()}"
    publish_raw(broker, v1_body("tests.apps.basic.add", task_id, [4, 5]), {})
    assert client.AsyncResult(task_id).get(timeout=20) == 9
    assert broker.queue_size() == 0
    assert broker.drain(broker.queue + ".dead") == []


def test_a_protocol_v1_message_runs_its_link_callbacks(broker, client, start_worker):
    start_worker(broker)
    task_id, callback_id = f"v1-{uuid.uuid4()}", f"v1-cb-{uuid.uuid4()}"
    callback = {"task": "tests.apps.basic.mul", "args": [10], "kwargs": {},
                "options": {"task_id": callback_id}, "subtask_type": None,
                "immutable": False}
    publish_raw(broker, v1_body("tests.apps.basic.add", task_id, [1, 2],
                                callbacks=[callback]), {})
    assert client.AsyncResult(task_id).get(timeout=20) == 3
    assert client.AsyncResult(callback_id).get(timeout=20) == 30


def test_a_protocol_v1_message_with_an_unreadable_field_fails_its_result(
        broker, client, start_worker, tmp_path):
    start_worker(broker, result_backend=COUNTING)
    task_id = f"v1-{uuid.uuid4()}"
    publish_raw(broker, v1_body("tests.apps.basic.add", task_id, [1, 2], eta="tomorrow"), {})
    with pytest.raises(MalformedMessage, match="ISO-8601"):
        client.AsyncResult(task_id).get(timeout=15)
    dead = wait_until(lambda: broker.drain(broker.queue + ".dead"), 10, "the dead letter")
    assert [h[DEAD_TASK_HEADER] for h, _ in dead] == [task_id]
    assert stores_of(tmp_path, task_id) == ["stored:FAILURE"]
