"""RabbitMQ specifics: queues an operator declared with their own arguments are used as
they are, and a queue's own dead-letter exchange receives workhorse's dead letters."""
from __future__ import annotations

import pytest
from kombu import Exchange, Queue

from workhorse.daemon.consumer import DEAD_REASON_HEADER, DEAD_TASK_HEADER
from workhorse.exceptions import NotRegistered
from workhorse.queues import parse_refusal, rabbitmq_dead_letter_target

from .conftest import make_broker, wait_until


@pytest.mark.parametrize("text, expected", [
    ("inequivalent arg 'x-dead-letter-exchange' for queue 'q' in vhost '/': received ' p' "
     "but current is 'dlx'", ("x-dead-letter-exchange", "dlx")),
    ("inequivalent arg 'x-dead-letter-exchange' for queue 'q' in vhost '/': received none "
     "but current is the value 'my-dlx' of type 'longstr'", ("x-dead-letter-exchange", "my-dlx")),
    ("inequivalent arg 'x-message-ttl' for queue 'q' in vhost '/': received none but current "
     "is the value '600000' of type 'signedint'", ("x-message-ttl", 600000)),
    ("inequivalent arg 'x-dead-letter-exchange' for queue 'q' in vhost '/': received the "
     "value ' p' of type 'longstr' but current is none", ("x-dead-letter-exchange", None)),
    ("invalid property 'auto-delete' for queue 'q'", None),
])
def test_the_refusal_text_is_read_for_the_current_value(text, expected):
    assert parse_refusal(text) == expected


@pytest.fixture
def amqp_with_dlx(tmp_path):
    broker = make_broker("amqp", tmp_path)
    dlx, parking = f"{broker.queue}-dlx", f"{broker.queue}-parking"
    parked = Queue(parking, Exchange(dlx, type="fanout"), routing_key="#")
    with broker.connection() as conn:
        parked(conn.default_channel).declare()
        conn.default_channel.queue_declare(
            broker.queue, durable=True, auto_delete=False,
            arguments={"x-dead-letter-exchange": dlx, "x-message-ttl": 600000})
    broker.extra_queues.append(parking)
    yield broker, parking, dlx
    with broker.connection() as conn:
        try:
            conn.default_channel.exchange_delete(dlx)
        except Exception:  # noqa: BLE001 - cleanup is best effort
            pass
    broker.cleanup()


def test_the_probe_finds_the_queues_dead_letter_exchange(amqp_with_dlx):
    broker, _, dlx = amqp_with_dlx
    with broker.connection() as conn:
        target = rabbitmq_dead_letter_target(conn, broker.queue)
        assert target is not None and target.exchange == dlx and target.routing_key is None
        assert rabbitmq_dead_letter_target(conn, broker.queue + "-nope") is None


def test_a_predeclared_queue_is_consumed_and_dead_letters_to_its_exchange(
        amqp_with_dlx, start_worker, tmp_path, monkeypatch):
    broker, parking, _ = amqp_with_dlx
    worker = start_worker(broker)
    assert "dead-letters to its RabbitMQ exchange" in worker.log()
    for key in ("BROKER_URL", "QUEUES"):
        monkeypatch.setenv(f"WORKHORSE_{key}", {"BROKER_URL": broker.url,
                                                "QUEUES": broker.queue}[key])
    monkeypatch.setenv("WORKHORSE_RESULT_BACKEND", f"sqlite:///{tmp_path / 'results.sqlite3'}")
    monkeypatch.setenv("WORKHORSE_STATE_DIR", str(tmp_path / "state"))
    from tests.apps import basic
    basic.app.configure()
    try:
        assert basic.add.delay(1, 2).get(timeout=20) == 3     # publishing did not re-declare
        ghost = basic.app.send_task("tests.apps.basic.ghost")
        with pytest.raises(NotRegistered):
            ghost.get(timeout=20)
    finally:
        basic.app.close()
    dead = wait_until(lambda: broker.drain(parking), 20, "the dead letter in the DLX's queue")
    assert len(dead) == 1
    headers, _ = dead[0]
    assert headers[DEAD_TASK_HEADER] == ghost.id
    assert headers[DEAD_REASON_HEADER].startswith("unknown_task")
    assert broker.queue_size(broker.queue + ".dead") == 0
