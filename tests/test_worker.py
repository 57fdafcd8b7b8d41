"""The real daemon as a subprocess, on each broker: tasks round-trip, bad input is
settled as docs/delivery.md says and the worker keeps running, signals stop it cleanly."""
from __future__ import annotations

import json
import signal
import time
import uuid

import psutil
import pytest
from kombu import Producer

from workhorse import TimeoutError as ResultTimeout
from workhorse.broker.queues import task_queue
from workhorse.broker.consumer import (
    DEAD_AT_HEADER,
    DEAD_QUEUE_HEADER,
    DEAD_REASON_HEADER,
    DEAD_TASK_HEADER,
)
from workhorse.exceptions import NotRegistered, ResultEncodeError, TaskRevokedError
from workhorse.protocol import build_message

from .conftest import process_gone, runs, wait_until


def publish_raw(broker, body, headers, content_type="application/json"):
    """Put a message on the test queue exactly as given, bypassing workhorse's client."""
    with broker.connection() as conn:
        Producer(conn).publish(body, exchange="", routing_key=broker.queue, headers=headers,
                               content_type=content_type, content_encoding="utf-8",
                               declare=[task_queue(broker.queue)])


def test_success_and_failure_round_trip(broker, client, start_worker):
    from tests.apps.basic import add, fail
    start_worker(broker)
    ok = add.delay(2, 3)
    bad = fail.delay("kaboom")
    assert ok.get(timeout=20) == 5
    assert ok.state == "SUCCESS" and ok.successful() and ok.ready()
    with pytest.raises(ValueError) as raised:
        bad.get(timeout=20)
    assert raised.value.args == ("kaboom", 42)
    assert bad.failed() and "ValueError" in bad.traceback
    assert isinstance(bad.get(propagate=False), ValueError)


def test_bound_task_sees_its_request(broker, client, start_worker):
    from tests.apps.basic import context
    start_worker(broker, hostname="w1@test")
    result = context.apply_async(task_id="fixed-id-1").get(timeout=20)
    assert result == {"id": "fixed-id-1", "retries": 0, "root_id": "fixed-id-1",
                      "parent_id": None, "hostname": "w1@test", "called_directly": False,
                      "routing_key": broker.queue, "correlation_id": "fixed-id-1"}


def test_unknown_task_is_dead_lettered_and_the_worker_goes_on(broker, client, start_worker):
    from tests.apps.basic import add
    worker = start_worker(broker)
    ghost = client.send_task("tests.apps.basic.no_such_task", (1,))
    with pytest.raises(NotRegistered):
        ghost.get(timeout=20)
    assert add.delay(1, 1).get(timeout=20) == 2
    # Settling is the broker thread's: it may come a moment after the next task's result.
    wait_until(lambda: broker.queue_size(broker.queue + ".dead") == 1, 20, "the dead letter")
    dead = broker.drain(broker.queue + ".dead")
    assert len(dead) == 1
    headers, _ = dead[0]
    assert headers["id"] == ghost.id and headers["task"] == "tests.apps.basic.no_such_task"
    assert headers[DEAD_TASK_HEADER] == ghost.id
    assert headers[DEAD_REASON_HEADER].startswith("unknown_task")
    assert headers[DEAD_QUEUE_HEADER] == broker.queue and headers[DEAD_AT_HEADER]
    assert broker.queue_size() == 0
    assert "unknown_task" in worker.log()


@pytest.mark.parametrize("body, headers, why", [
    (b"[[1, 2], {}, {}]", {}, "no 'task' header"),
    (b"[[1, 2], {}, {}]", {"task": "tests.apps.basic.add"}, "'id'"),
    (b"this is not json", {"task": "tests.apps.basic.add", "id": "m-1"}, "not valid"),
    (b'{"args": [1, 2]}', {"task": "tests.apps.basic.add", "id": "m-2"}, "triple"),
])
def test_malformed_message_is_dead_lettered_and_the_worker_goes_on(
        broker, client, start_worker, body, headers, why):
    from tests.apps.basic import add
    worker = start_worker(broker)
    publish_raw(broker, body, headers)
    worker.wait_for_log("malformed")
    assert add.delay(20, 22).get(timeout=20) == 42
    dead = wait_until(lambda: broker.drain(broker.queue + ".dead"), 10, "the dead letter")
    assert len(dead) == 1
    dead_headers, dead_body = dead[0]
    assert dead_body == body                       # the body travels unchanged
    assert why in dead_headers[DEAD_REASON_HEADER]
    assert broker.queue_size() == 0


def test_pickle_is_refused(broker, client, start_worker):
    worker = start_worker(broker)
    headers = build_message("tests.apps.basic.add", "p-1", [1, 2]).headers
    publish_raw(broker, b"\x80\x04K\x01.", headers, content_type="application/x-python-serialize")
    worker.wait_for_log("malformed")
    dead = wait_until(lambda: broker.drain(broker.queue + ".dead"), 10, "the dead letter")
    assert "not accepted" in dead[0][0][DEAD_REASON_HEADER]


def test_expired_task_is_revoked_not_run(broker, client, start_worker, tmp_path):
    from tests.apps.basic import record
    result = record.apply_async(expires=0.01)
    time.sleep(0.05)  # let it expire before any worker exists: the point of the test
    start_worker(broker)
    with pytest.raises(TaskRevokedError):
        result.get(timeout=20)
    assert result.state == "REVOKED"
    assert runs(tmp_path) == []
    assert broker.queue_size() == 0


def test_countdown_runs_after_its_eta(broker, client, start_worker):
    from tests.apps.basic import add
    start_worker(broker)
    sent = time.monotonic()
    result = add.apply_async((1, 2), countdown=1.5)
    assert result.get(timeout=20) == 3
    assert time.monotonic() - sent >= 1.4


def test_unencodable_result_is_a_clear_failure(broker, client, start_worker):
    from tests.apps.basic import unencodable
    start_worker(broker)
    result = unencodable.delay()
    with pytest.raises(Exception) as raised:
        result.get(timeout=20)
    assert type(raised.value).__name__ == ResultEncodeError.__name__
    assert "cannot be encoded as JSON" in str(raised.value)


def test_sigterm_stops_cleanly_and_children_go_with_it(broker, client, start_worker):
    worker = start_worker(broker)
    def titled_children() -> list[int]:
        pids = worker.children()
        titles = [" ".join(psutil.Process(pid).cmdline()) for pid in pids]
        return pids if len(pids) == 2 and all(
            t.startswith("workhorse: child") and "idle" in t for t in titles) else []
    children = wait_until(titled_children, 10, "two children titled 'workhorse: child N idle'")
    worker.signal(signal.SIGTERM)
    assert worker.wait_exit(30) == 0
    for pid in children:
        assert process_gone(pid)
    assert "stopped" in worker.log()


def test_sigint_twice_is_a_cold_shutdown(broker, client, start_worker, tmp_path):
    from tests.apps.basic import record
    worker = start_worker(broker, concurrency=1)
    record.delay(60)
    wait_until(lambda: runs(tmp_path), 20, "the task to start")
    worker.signal(signal.SIGINT)
    worker.wait_for_log("warm shutdown")
    worker.signal(signal.SIGINT)
    assert worker.wait_exit(30) == 0
    # Killed by the shutdown, not lost: back in the queue, uncounted.
    assert "cold shutdown" in worker.log()
    wait_until(lambda: broker.queue_size() == 1, 20, "the killed task back in its queue")


def test_startup_names_the_state_directory(broker, start_worker, tmp_path):
    worker = start_worker(broker)
    assert f"state directory: {tmp_path / 'state'}" in worker.log()


def test_result_get_times_out_without_a_worker(broker, client):
    from tests.apps.basic import add
    result = add.delay(1, 2)
    with pytest.raises(ResultTimeout):
        result.get(timeout=0.3)
    assert result.state == "PENDING"


def test_task_arguments_are_checked_when_sending(client):
    from tests.apps.basic import add
    with pytest.raises(TypeError, match=r"tests.apps.basic.add\(\): missing a required argument"):
        add.delay(1)
    with pytest.raises(TypeError, match="args must be a list or tuple"):
        add.apply_async("12")
    with pytest.raises(TypeError, match="cannot be sent as JSON"):
        add.delay(object(), 1)


@pytest.fixture
def unused_queue_name():
    return f"t-{uuid.uuid4().hex[:8]}"


def test_body_json_is_celery_layout(broker, client, unused_queue_name):
    """What workhorse's client puts on the wire is Celery's v2 triple, headers included."""
    from tests.apps.basic import add
    broker.extra_queues.append(unused_queue_name)
    add.apply_async((4, 5), queue=unused_queue_name)
    [(headers, body)] = broker.drain(unused_queue_name)
    assert json.loads(body) == [[4, 5], {}, {"callbacks": None, "errbacks": None,
                                              "chain": None, "chord": None}]
    assert headers["task"] == "tests.apps.basic.add" and headers["lang"] == "py"
