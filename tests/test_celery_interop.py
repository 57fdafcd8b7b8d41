"""Celery's own client against a workhorse worker: it sends with send_task and reads the
result with Celery's AsyncResult from a Redis result store (WIRE.md)."""
from __future__ import annotations

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
