"""A RabbitMQ that blocks publishers (memory or disk alarm, ``connection.blocked``): a publish
fails at once, or once its confirm is overdue, with an error that says so; it never hangs
and is never sent twice. The server's block is played by py-amqp's own handler of the
``connection.blocked`` frame: raising a real alarm would block every test on the server."""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from workhorse import App
from workhorse.transport.rabbitmq import BrokerBlocked, PublishNotConfirmed

from .conftest import BrokerEnv, make_broker


@pytest.fixture
def rabbitmq(tmp_path: Path) -> Iterator[BrokerEnv]:
    env = make_broker("amqp", tmp_path)
    yield env
    env.cleanup()


@pytest.fixture
def app(rabbitmq: BrokerEnv) -> Iterator[App]:
    app = App("blocked", broker_url=rabbitmq.url, result_backend="disabled",
              queues=[rabbitmq.queue])
    yield app
    app.close()


def _amqp_connection(app: App):  # type: ignore[no-untyped-def]
    assert app._producer_connection is not None
    return app._producer_connection.connection


def test_a_publish_on_a_blocked_connection_fails_at_once_and_sends_nothing(app, rabbitmq):
    app.send_task("t")
    _amqp_connection(app)._on_blocked()           # the server's connection.blocked
    started = time.monotonic()
    with pytest.raises(BrokerBlocked, match="blocks publishing on this connection .*memory or "
                                            "disk alarm.*nothing was sent"):
        app.send_task("t")
    assert time.monotonic() - started < 1
    assert rabbitmq.queue_size() == 1


def test_publishing_resumes_when_rabbitmq_unblocks(app, rabbitmq):
    app.send_task("t")
    connection = _amqp_connection(app)
    connection._on_blocked()
    with pytest.raises(BrokerBlocked):
        app.send_task("t")
    connection._on_unblocked()
    app.send_task("t")
    assert _amqp_connection(app) is connection     # the blocked connection was kept
    assert rabbitmq.queue_size() == 2


def test_a_block_while_awaiting_the_confirm_fails_the_send_without_sending_it_again(
        app, rabbitmq, monkeypatch):
    app.send_task("t")
    connection = _amqp_connection(app)
    channel = app._producer_connection.default_channel
    wait = channel.wait

    def blocked_meanwhile(*args, **kwargs):  # type: ignore[no-untyped-def]
        connection._on_blocked()
        return wait(*args, **kwargs)
    monkeypatch.setattr(channel, "wait", blocked_meanwhile)
    with pytest.raises(PublishNotConfirmed, match="may still be delivered"):
        app.send_task("t")
    assert rabbitmq.queue_size() == 2              # sent once, not retried by kombu
    assert app._producer_connection is None        # a confirm is owed on it: dropped
    app.send_task("t")
    assert rabbitmq.queue_size() == 3


def test_a_confirm_that_never_comes_fails_the_send_without_sending_it_again(
        app, rabbitmq, monkeypatch):
    app.send_task("t")
    channel = app._producer_connection.default_channel

    def silent(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise TimeoutError("timed out")
    monkeypatch.setattr(channel, "wait", silent)
    with pytest.raises(PublishNotConfirmed, match="did not confirm a published message within"):
        app.send_task("t")
    assert rabbitmq.queue_size() == 2


def test_the_worker_counts_an_unconfirmed_publish_as_a_lost_connection_not_a_block(app):
    """What the consumer (``BrokerConsumer.is_connection_error``) and kombu's retries see."""
    with app.connection() as conn:
        lost = conn.connection_errors + conn.channel_errors
        assert issubclass(PublishNotConfirmed, lost)
        assert not issubclass(PublishNotConfirmed, conn.recoverable_connection_errors)
        assert not issubclass(BrokerBlocked, lost)
        assert not issubclass(BrokerBlocked, conn.recoverable_connection_errors)
