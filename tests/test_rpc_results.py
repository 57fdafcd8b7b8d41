"""``result_backend = "rpc://"``: each state of a task is a message to the sender's reply
queue, as Celery's RPC backend sends it; a Celery 5.7 client and workhorse's own read
them, on RabbitMQ and on Redis."""
from __future__ import annotations

import uuid

import pytest

from .conftest import (AMQP_URL, check_celery_results, make_broker, require_service, runs,
                       wait_until)

RPC = "rpc://"


@pytest.fixture(params=["amqp", "redis"])
def rpc_setup(request, tmp_path, start_worker):
    require_service("RabbitMQ" if request.param == "amqp" else "Redis",
                    5672 if request.param == "amqp" else 6379)
    celery = pytest.importorskip("celery")
    broker = make_broker(request.param, tmp_path)
    app = celery.Celery("rpcinterop", broker=broker.url, backend=RPC)
    app.conf.task_default_queue = broker.queue
    worker = start_worker(broker, result_backend=RPC, track_started=True)
    yield app, broker, worker
    app.close()
    broker.cleanup()


def test_a_celery_client_gets_results_and_failures_by_rpc(rpc_setup):
    app, broker, _ = rpc_setup
    check_celery_results(app)
    retried = app.send_task("tests.apps.basic.flaky", (2,), {"countdown": 0.2})
    assert retried.get(timeout=30) == "ok after 2 retries"
    # Several at once, read in any order from the one reply queue.
    many = [app.send_task("tests.apps.basic.add", (n, n)) for n in range(20)]
    assert [r.get(timeout=30) for r in reversed(many)] == [2 * n for n in reversed(range(20))]


def test_the_states_before_the_result_reach_the_client(rpc_setup):
    app, broker, _ = rpc_setup
    result = app.send_task("tests.apps.basic.sleeper", (1.0,))
    wait_until(lambda: result.state == "STARTED", 20, "STARTED sent to the reply queue")
    result.get(timeout=20)
    assert result.state == "SUCCESS"


def test_a_reply_queue_that_is_gone_is_said_once_and_costs_the_task_nothing(
        rpc_setup, tmp_path):
    app, broker, worker = rpc_setup
    gone = f"gone-{uuid.uuid4().hex[:8]}"
    for _ in range(3):
        app.send_task("tests.apps.basic.record", reply_to=gone)
    wait_until(lambda: len(runs(tmp_path)) == 3, 20, "the three tasks run")
    # Each ran once, and was acked: nothing left in the queue, nothing requeued.
    wait_until(lambda: broker.queue_size() == 0, 20, "the queue empty")
    assert len(runs(tmp_path)) == 3
    if broker.rabbitmq:
        worker.wait_for_log(rf"reply queue {gone} is gone")
        assert worker.log().count(f"reply queue {gone} is gone") <= 2   # once a process
    # The client's own queue still gets its results.
    assert app.send_task("tests.apps.basic.add", (1, 2)).get(timeout=20) == 3


def test_a_workhorse_client_reads_its_own_results_and_is_refused_a_chord(
        rpc_setup, monkeypatch):
    app, broker, _ = rpc_setup
    from workhorse import App, Signature, chord
    client = App("rpcclient", broker_url=broker.url, result_backend=RPC,
                 queues=[broker.queue])
    try:
        sent = client.send_task("tests.apps.basic.add", (20, 22))
        assert sent.get(timeout=20) == 42
        failing = client.send_task("tests.apps.basic.fail", ("no",))
        with pytest.raises(ValueError):
            failing.get(timeout=20)
        # Another process (here: another App, with its own queue) cannot read them.
        other = App("other", broker_url=broker.url, result_backend=RPC, queues=[broker.queue])
        assert other.AsyncResult(sent.id).state == "PENDING"
        header = [Signature("tests.apps.basic.add", (1, 1), app=client)]
        with pytest.raises(NotImplementedError, match='"rpc" result backend does not '
                                                      "support chords"):
            chord(header)(Signature("tests.apps.basic.collect", app=client))
    finally:
        client.close()


def test_rpc_is_a_valid_result_backend_and_names_what_it_cannot_do():
    from workhorse.backends import backend_from_url
    from workhorse.config.settings import _check_backend
    assert _check_backend("rpc://") is None
    backend = backend_from_url("rpc://", connection=lambda: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(NotImplementedError, match="save_group is not supported"):
        backend.save_group("g", [])
    with pytest.raises(NotImplementedError, match="claims idempotent tasks need"):
        backend.claim("k", "owner", 5)


AMQP = AMQP_URL     # named for the tier detection: this module talks to the brokers
