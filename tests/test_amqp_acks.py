"""RabbitMQ acks written at once (``Channel.ack_tags``): the same ``basic.ack`` frames
py-amqp's ``basic_ack`` writes, one write for a turn's acks, the server taking each, and a
lost connection an error for every message of the batch."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from amqp.exceptions import RecoverableConnectionError
from amqp.method_framing import frame_writer

from workhorse.transport.rabbitmq import Channel

from .conftest import wait_until

pytestmark = pytest.mark.timeout(60)


class Writes:
    """A transport that keeps what is written to it, one entry a write."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))


def channel_on(transport: Any, channel_id: int = 7) -> Any:
    """Our Channel on a stand-in connection that writes frames as py-amqp does."""
    connection = SimpleNamespace(transport=transport, bytes_sent=0, frame_max=131072)
    connection.frame_writer = frame_writer(connection, transport)
    channel = Channel.__new__(Channel)
    channel.connection = connection
    channel.channel_id = channel_id
    return channel


@pytest.mark.parametrize("tags", [[1], [1, 2, 3], [2**40 + 5, 9, 2**64 - 1]])
def test_the_frames_are_those_basic_ack_writes_in_one_write(tags):
    ours, theirs = Writes(), Writes()
    channel_on(ours).ack_tags(tags)
    reference = channel_on(theirs)
    for tag in tags:
        reference.basic_ack(tag)
    assert len(ours.writes) == 1
    assert ours.writes[0] == b"".join(theirs.writes)
    assert len(theirs.writes) == len(tags)


def test_a_write_counts_as_sent_for_the_heartbeat_and_nothing_is_written_for_no_tags():
    transport = Writes()
    channel = channel_on(transport)
    channel.ack_tags([])
    assert transport.writes == [] and channel.connection.bytes_sent == 0
    channel.ack_tags([4, 5])
    assert channel.connection.bytes_sent == 1


def test_a_closed_channel_or_connection_raises_as_basic_ack_does():
    channel = channel_on(Writes())
    channel.connection.transport = None      # py-amqp's Connection after collect()
    with pytest.raises(RecoverableConnectionError):
        channel.ack_tags([1])
    channel.connection = None                 # py-amqp's Channel after collect()
    with pytest.raises(RecoverableConnectionError):
        channel.ack_tags([1])
    with pytest.raises(RecoverableConnectionError):
        channel.basic_ack(1)


@pytest.mark.parametrize("broker", ["amqp"], indirect=True)
def test_the_server_takes_a_batch_and_gives_back_only_what_was_not_acked(broker, client):
    """Three of five deliveries acked in one write: after the connection closes, the two
    others come back, and only they."""
    from tests.apps import basic
    from workhorse.broker.consumer import BrokerConsumer
    received: list = []
    consumer = BrokerConsumer(client, [broker.queue], lambda q, m: received.append(m),
                              lambda exc: None)
    try:
        consumer.connect(5, lambda: 5)
        for n in range(5):
            basic.record.delay(n)
        wait_until(lambda: _drained(consumer, received) == 5, 10, "five deliveries")
        transport = consumer.connection.connection.transport
        write, writes = transport.write, []
        transport.write = lambda data: (writes.append(bytes(data)), write(data))[1]
        acked = received[:3]
        assert consumer.ack_many(acked) == [None, None, None]
        assert len(writes) == 1 and all(m.acknowledged for m in acked)
        # An acknowledged message is refused, per message, and nothing is written for it.
        errors = consumer.ack_many(received[2:4])
        assert errors[0] is not None and errors[1] is None and len(writes) == 2
    finally:
        consumer.close()
    wait_until(lambda: broker.queue_size() == 1, 10, "the one never acked back in the queue")
    left = broker.drain(broker.queue)
    assert len(left) == 1 and left[0][0]["argsrepr"] == "(4,)"


@pytest.mark.parametrize("broker", ["amqp"], indirect=True)
def test_a_lost_connection_is_an_error_for_every_message_of_the_batch(broker, client):
    from tests.apps import basic
    from workhorse.broker.consumer import BrokerConsumer
    received: list = []
    lost: list = []
    consumer = BrokerConsumer(client, [broker.queue], lambda q, m: received.append(m),
                              lost.append)
    try:
        consumer.connect(5, lambda: 5)
        for n in range(3):
            basic.record.delay(n)
        wait_until(lambda: _drained(consumer, received) == 3, 10, "three deliveries")
        consumer.connection.connection.transport.sock.close()
        errors = consumer.ack_many(received)
        assert all(isinstance(e, Exception) for e in errors) and len(errors) == 3
        assert not any(m.acknowledged for m in received)
        assert lost, "the consumer counts the connection lost"
    finally:
        consumer.close()
    wait_until(lambda: broker.queue_size() == 3, 10, "all three back in the queue")


def _drained(consumer: Any, received: list) -> int:
    """Deliver what the consumer's socket holds; the number received so far."""
    for fd in consumer.fds():
        consumer.on_readable(fd)
    return len(received)
