"""RabbitMQ specifics: queues an operator declared with their own arguments are used as
they are, a queue's own dead-letter exchange receives workhorse's dead letters, and what
the server's redelivery marks say about lost deliveries."""
from __future__ import annotations

import pytest
from kombu import Exchange, Producer, Queue

from workhorse.broker.consumer import DEAD_REASON_HEADER, DEAD_TASK_HEADER
from workhorse.broker.counting import RabbitMQ, earlier_deliveries, parse_version
from workhorse.exceptions import NotRegistered
from workhorse.broker.queues import parse_refusal, rabbitmq_dead_letter_target

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


@pytest.mark.parametrize("queue_type, counted", [("quorum", 2), ("classic", 1)])
def test_two_lost_deliveries_count_as_the_servers_marks_allow(tmp_path, queue_type, counted):
    """What counting.RabbitMQ relies on, checked against the server the tests run on: two
    consumers take the message and lose their connection without settling it. On 3.x a
    quorum queue's x-delivery-count says both; a classic queue's redelivered flag only
    "at least one" (the worker then replaces the message by a copy carrying the count)."""
    broker = make_broker("amqp", tmp_path)
    try:
        with broker.connection() as conn:
            conn.default_channel.queue_declare(broker.queue, durable=True, auto_delete=False,
                                               arguments={"x-queue-type": queue_type})
            server = RabbitMQ(parse_version(conn.connection.server_properties.get("version")))
            Producer(conn).publish({"n": 1}, exchange="", routing_key=broker.queue)
        if queue_type == "quorum" and not server.counts_returns:
            pytest.skip(f"RabbitMQ {server.version}: x-delivery-count is not relied on")

        def take(conn):
            queue = Queue(broker.queue, no_declare=True)(conn.default_channel)
            return wait_until(lambda: queue.get(no_ack=False), 10, "the message")
        for _ in range(2):
            with broker.connection() as conn:
                take(conn)                    # and the connection closes: a loss
        with broker.connection() as conn:
            message = take(conn)
            assert message.delivery_info["redelivered"]
            assert earlier_deliveries(message.headers, message.delivery_info, server) == counted
            message.ack()
    finally:
        broker.cleanup()
