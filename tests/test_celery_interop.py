"""Celery's own client against a workhorse worker: it sends with send_task and reads the
result with Celery's AsyncResult from a Redis result store (WIRE.md)."""
from __future__ import annotations

import uuid

import pytest

from .conftest import REDIS_URL, make_broker, require_service

RESULTS_URL = REDIS_URL.rsplit("/", 1)[0] + "/1"


@pytest.fixture(params=["redis", "amqp"])
def celery_setup(request, tmp_path, start_worker):
    require_service("Redis", 6379)
    broker = make_broker(request.param, tmp_path)
    celery = pytest.importorskip("celery")
    app = celery.Celery("interop", broker=broker.url, backend=RESULTS_URL)
    app.conf.task_default_queue = broker.queue
    worker = start_worker(broker, result_backend=RESULTS_URL)
    yield app, broker, worker
    app.close()
    broker.cleanup()


def test_celery_client_round_trips_through_a_workhorse_worker(celery_setup):
    app, broker, _ = celery_setup
    result = app.send_task("tests.apps.basic.add", (2, 40), queue=broker.queue)
    assert result.get(timeout=20) == 42
    assert result.state == "SUCCESS"


def test_celery_client_sees_a_failure_with_its_exception(celery_setup):
    app, broker, _ = celery_setup
    result = app.send_task("tests.apps.basic.fail", ("bad input",), queue=broker.queue)
    with pytest.raises(ValueError) as raised:
        result.get(timeout=20)
    assert raised.value.args == ("bad input", 42)
    assert "ValueError" in result.traceback


def test_celery_countdown_and_kwargs(celery_setup):
    app, broker, _ = celery_setup
    result = app.send_task("tests.apps.basic.add", kwargs={"x": 1, "y": 2}, countdown=0.5,
                           queue=broker.queue)
    assert result.get(timeout=20) == 3


def test_celery_sent_unknown_task_fails_with_not_registered(celery_setup):
    app, broker, _ = celery_setup
    result = app.send_task("tests.apps.basic.missing", queue=broker.queue)
    with pytest.raises(Exception) as raised:
        result.get(timeout=20)
    assert type(raised.value).__name__ == "NotRegistered"
    assert "tests.apps.basic.missing" in str(raised.value)


def test_workhorse_client_reads_the_same_redis_results(celery_setup, tmp_path, monkeypatch):
    app, broker, _ = celery_setup
    monkeypatch.setenv("WORKHORSE_BROKER_URL", broker.url)
    monkeypatch.setenv("WORKHORSE_RESULT_BACKEND", RESULTS_URL)
    monkeypatch.setenv("WORKHORSE_QUEUES", broker.queue)
    monkeypatch.setenv("WORKHORSE_STATE_DIR", str(tmp_path / "state"))
    from tests.apps import basic
    basic.app.configure()
    try:
        sent = app.send_task("tests.apps.basic.add", (5, 5), queue=broker.queue)
        assert basic.app.AsyncResult(sent.id).get(timeout=20) == 10
        mine = basic.add.delay(6, 6)
        assert app.AsyncResult(mine.id).get(timeout=20) == 12   # Celery reads workhorse's
    finally:
        basic.app.close()


def test_celery_sent_task_retries_on_workhorse_and_celery_sees_retry_then_success(celery_setup):
    import time
    app, broker, _ = celery_setup
    result = app.send_task("tests.apps.basic.flaky", (2, 0.4), queue=broker.queue)
    seen = []
    deadline = time.monotonic() + 30
    while result.state != "SUCCESS" and time.monotonic() < deadline:
        if not seen or seen[-1] != result.state:
            seen.append(result.state)
        time.sleep(0.02)
    assert result.get(timeout=1) == "ok after 2 retries"
    assert "RETRY" in seen          # then SUCCESS, which ended the loop
    assert result.state == "SUCCESS"


def test_celery_link_error_on_a_workhorse_worker(celery_setup, tmp_path):
    app, broker, _ = celery_setup
    errback = app.signature("tests.apps.basic.errback_old")
    result = app.send_task("tests.apps.basic.fail", ("x",), queue=broker.queue,
                           link_error=errback)
    with pytest.raises(ValueError):
        result.get(timeout=20)
    path = tmp_path / "grandchild.pid.errback"
    from .conftest import wait_until
    wait_until(lambda: path.exists() and path.read_text().strip(), 20, "Celery's errback")
    assert path.read_text().split() == ["old", result.id]


def test_a_celery_client_sees_malformed_message_for_a_pickled_task(celery_setup):
    """An old producer pickling its messages: refused, and the client is told so."""
    app, broker, _ = celery_setup
    result = app.send_task("tests.apps.basic.add", (1, 2), queue=broker.queue,
                           serializer="pickle")
    with pytest.raises(Exception) as raised:
        result.get(timeout=20)
    assert type(raised.value).__name__ == "MalformedMessage"
    assert "not accepted" in str(raised.value)
    assert result.state == "FAILURE"


def test_a_celery_client_sending_protocol_v1_runs_on_workhorse(celery_setup):
    app, broker, _ = celery_setup
    app.conf.task_protocol = 1
    callback_id = f"v1-cb-{uuid.uuid4()}"
    callback = app.signature("tests.apps.basic.mul", (10,)).set(task_id=callback_id)
    result = app.send_task("tests.apps.basic.add", (2, 40), queue=broker.queue,
                           link=callback)
    assert result.get(timeout=20) == 42
    assert app.AsyncResult(callback_id).get(timeout=20) == 420


def test_a_celery_client_sending_protocol_v1_gets_its_link_error_called(celery_setup, tmp_path):
    app, broker, _ = celery_setup
    app.conf.task_protocol = 1
    errback = app.signature("tests.apps.basic.errback_old")
    result = app.send_task("tests.apps.basic.fail", ("x",), queue=broker.queue,
                           link_error=errback)
    with pytest.raises(ValueError):
        result.get(timeout=20)
    path = tmp_path / "grandchild.pid.errback"
    from .conftest import wait_until
    wait_until(lambda: path.exists() and path.read_text().strip(), 20, "Celery's errback")
    assert path.read_text().split() == ["old", result.id]


@pytest.mark.parametrize("shape", ["group last", "chord last", "group then task",
                                   "chord then task"])
def test_celery_canvases_with_groups_and_chords_inside_chains_run_on_workhorse(
        celery_setup, shape):
    """Celery sends the rest of a chain, groups and chords included, in the first message;
    the worker applies each step as Celery's own would (before: 'celery.group' and
    'celery.chord' were sent as task names, and dead-lettered as unknown)."""
    import celery
    app, broker, _ = celery_setup
    app.conf.task_default_queue = broker.queue

    def sig(name: str, *args: object):
        return app.signature(f"tests.apps.basic.{name}", args, queue=broker.queue)
    header = [sig("add", 10), sig("add", 20)]
    canvas, expected = {
        "group last": (celery.chain(sig("add", 1, 1), celery.group(header)), [12, 22]),
        "chord last": (celery.chain(sig("add", 1, 1), celery.chord(header, sig("collect"))),
                       [12, 22]),
        "group then task": (sig("add", 1, 1) | celery.group(header) | sig("collect"), [12, 22]),
        "chord then task": (celery.chain(sig("add", 1, 1), celery.chord(header, sig("collect")),
                                         sig("mul", 2)), [12, 22, 12, 22]),
    }[shape]
    result = canvas.apply_async()
    outcome = result.get(timeout=30)
    assert outcome == expected


def test_celerys_builtin_tasks_run_on_workhorse(celery_setup):
    """celery.map, celery.starmap (task.map/starmap), celery.chunks, celery.accumulate."""
    from celery.canvas import chunks, xmap, xstarmap
    from celery.result import result_from_tuple
    app, broker, _ = celery_setup
    add = app.signature("tests.apps.basic.add")
    collect = app.signature("tests.apps.basic.collect")
    queue = broker.queue
    assert xstarmap(add, [(1, 2), (3, 4)], app=app).apply_async(queue=queue).get(
        timeout=20) == [3, 7]
    assert xmap(collect, [1, 2], app=app).apply_async(queue=queue).get(timeout=20) == [1, 2]
    grouped = chunks(add, [(i, i) for i in range(5)], 2, app=app).apply_async(queue=queue)
    assert grouped.get(timeout=20) == [[0, 2], [4, 6], [8]]
    sent = app.send_task("celery.chunks", (add, [(1, 1), (2, 2), (3, 3)], 2), queue=queue)
    assert result_from_tuple(sent.get(timeout=20), app).get(timeout=20) == [[2, 4], [6]]
    assert app.send_task("celery.accumulate", (5, 6, 7), {"index": 1},
                         queue=queue).get(timeout=20) == 6
