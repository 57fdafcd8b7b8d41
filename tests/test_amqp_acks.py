"""RabbitMQ acks written at once (``Channel.ack_tags``): the same ``basic.ack`` frames
py-amqp's ``basic_ack`` writes, one write for a turn's acks, the server taking each, and a
lost connection an error for every message of the batch."""
from __future__ import annotations

import errno
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
from amqp.exceptions import RecoverableConnectionError
from amqp.method_framing import frame_writer

from workhorse.transport.rabbitmq import Channel, ReadAheadTransport

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


@contextmanager
def delivered(client: Any, broker: Any, count: int,
              lost: Callable[[BaseException], None] = lambda exc: None,
              ) -> Iterator[tuple[Any, list]]:
    """A BrokerConsumer on the test's queue (window 5) that received ``count`` records,
    and what it received; closed at the end."""
    from tests.apps import basic
    from workhorse.broker.consumer import BrokerConsumer
    received: list = []
    consumer = BrokerConsumer(client, [broker.queue], lambda q, m: received.append(m), lost)
    try:
        consumer.connect(5, lambda: 5)
        for n in range(count):
            basic.record.delay(n)
        wait_until(lambda: _drained(consumer, received) == count, 10, f"{count} deliveries")
        yield consumer, received
    finally:
        consumer.close()


@pytest.mark.parametrize("broker", ["amqp"], indirect=True)
def test_the_server_takes_a_batch_and_gives_back_only_what_was_not_acked(broker, client):
    """Three of five deliveries acked in one write: after the connection closes, the two
    others come back, and only they."""
    with delivered(client, broker, 5) as (consumer, received):
        transport = consumer.connection.connection.transport
        write, writes = transport.write, []
        transport.write = lambda data: (writes.append(bytes(data)), write(data))[1]
        acked = received[:3]
        assert consumer.ack_many(acked) == [None, None, None]
        assert len(writes) == 1 and all(m.acknowledged for m in acked)
        # An acknowledged message is refused, per message, and nothing is written for it.
        errors = consumer.ack_many(received[2:4])
        assert errors[0] is not None and errors[1] is None and len(writes) == 2
    wait_until(lambda: broker.queue_size() == 1, 10, "the one never acked back in the queue")
    left = broker.drain(broker.queue)
    assert len(left) == 1 and left[0][0]["argsrepr"] == "(4,)"


@pytest.mark.parametrize("broker", ["amqp"], indirect=True)
def test_a_lost_connection_is_an_error_for_every_message_of_the_batch(broker, client):
    lost: list = []
    with delivered(client, broker, 3, lost.append) as (consumer, received):
        consumer.connection.connection.transport.sock.close()
        errors = consumer.ack_many(received)
        assert all(isinstance(e, Exception) for e in errors) and len(errors) == 3
        assert not any(m.acknowledged for m in received)
        assert lost, "the consumer counts the connection lost"
    wait_until(lambda: broker.queue_size() == 3, 10, "all three back in the queue")


def _drained(consumer: Any, received: list) -> int:
    """Deliver what the consumer's socket holds; the number received so far."""
    for fd in consumer.fds():
        consumer.on_readable(fd)
    return len(received)


# -- acks written on the loop thread (Channel.ack_tags_now, BrokerConsumer.ack_now)


class FakeSocket:
    """A socket whose ``send`` takes ``room`` bytes at most (0: none, as a full buffer);
    what it took is kept, with what ``sendall`` wrote, in order."""

    def __init__(self, room: int, timeout: float | None = None) -> None:
        self.room, self.timeout, self.sent = room, timeout, b""
        self.fail: OSError | None = None

    def gettimeout(self) -> float | None:
        return self.timeout

    def send(self, data: bytes, flags: int = 0) -> int:
        assert flags & socket.MSG_DONTWAIT, "a send that would wait"
        if self.fail is not None:
            raise self.fail
        if self.room == 0:
            raise BlockingIOError(errno.EAGAIN, "full")
        taken = bytes(data[:self.room])
        self.room -= len(taken)
        self.sent += taken
        return len(taken)

    def sendall(self, data: bytes) -> None:
        self.sent += bytes(data)


def read_ahead_on(sock: Any) -> ReadAheadTransport:
    transport = ReadAheadTransport.__new__(ReadAheadTransport)
    transport.sock, transport._write, transport.connected = sock, sock.sendall, True
    return transport


def frames_of(tags: list[int], channel_id: int = 7) -> bytes:
    reference = Writes()
    for tag in tags:
        channel_on(reference, channel_id).basic_ack(tag)
    return b"".join(reference.writes)


def test_acks_written_at_once_are_basic_acks_frames_sent_without_waiting():
    sock = FakeSocket(room=10_000)
    channel = channel_on(read_ahead_on(sock))
    assert channel.ack_tags_now([1, 2, 2**40]) is True
    assert sock.sent == frames_of([1, 2, 2**40])
    assert channel.connection.bytes_sent == 1


def test_a_full_socket_takes_no_ack_and_nothing_is_kept_for_later():
    sock = FakeSocket(room=0)
    transport = read_ahead_on(sock)
    channel = channel_on(transport)
    assert channel.ack_tags_now([1, 2]) is None
    assert sock.sent == b"" and transport._unsent == b""
    assert channel.connection.bytes_sent == 0
    channel.ack_tags([3])       # the owner's write, as ever
    assert sock.sent == frames_of([3])


def test_a_socket_with_a_timeout_of_its_own_is_not_written_so():
    """Python waits for such a socket to be writable before it sends, MSG_DONTWAIT or not."""
    sock = FakeSocket(room=10_000, timeout=5.0)
    assert channel_on(read_ahead_on(sock)).ack_tags_now([1]) is None
    assert sock.sent == b""


def test_a_part_taken_leaves_the_rest_first_in_the_next_write():
    sock = FakeSocket(room=30)
    transport = read_ahead_on(sock)
    channel = channel_on(transport)
    assert channel.ack_tags_now([1, 2, 3]) is False
    assert len(sock.sent) == 30
    # Nothing more is written without waiting while the rest waits: it would overtake it.
    sock.room = 10_000
    assert channel.ack_tags_now([4]) is None
    channel.ack_tags([5])               # any write: the rest goes first
    assert sock.sent == frames_of([1, 2, 3, 5])
    transport.finish_write()            # nothing left: nothing written
    assert sock.sent == frames_of([1, 2, 3, 5])


def test_finish_write_sends_the_rest_alone():
    sock = FakeSocket(room=21)
    transport = read_ahead_on(sock)
    assert channel_on(transport).ack_tags_now([1, 2]) is False
    transport.finish_write()
    assert sock.sent == frames_of([1, 2]) and transport._unsent == b""


def test_a_broken_socket_raises_and_counts_the_connection_down():
    sock = FakeSocket(room=10_000)
    sock.fail = ConnectionResetError(errno.ECONNRESET, "reset")
    transport = read_ahead_on(sock)
    with pytest.raises(ConnectionResetError):
        channel_on(transport).ack_tags_now([1])
    assert transport.connected is False and sock.sent == b""


def test_a_closed_connection_raises_as_basic_ack_does_when_written_at_once():
    channel = channel_on(Writes())
    channel.connection.transport = None
    with pytest.raises(RecoverableConnectionError):
        channel.ack_tags_now([1])


def test_a_transport_that_cannot_write_without_waiting_leaves_the_acks_to_the_owner():
    transport = Writes()            # (TLS: py-amqp's SSL transport has no write_now)
    assert channel_on(transport).ack_tags_now([1]) is None and transport.writes == []


@pytest.mark.parametrize("broker", ["amqp"], indirect=True)
def test_acks_made_at_once_are_taken_by_the_server(broker, client):
    """Three of five deliveries acked by ``ack_now``: the server gives back the two
    others, and only them, when the connection closes; what cannot be acked at once
    (a message settled already) is left to the broker thread, untouched."""
    with delivered(client, broker, 5) as (consumer, received):
        assert consumer.acks_at_once
        assert consumer.ack_now(received[:3]) is True
        assert all(m.acknowledged for m in received[:3])
        assert consumer.ack_now(received[2:4]) is None         # one acked already
        assert not received[3].acknowledged
    wait_until(lambda: broker.queue_size() == 2, 10, "the two not acked back in the queue")
    left = sorted(headers["argsrepr"] for headers, _ in broker.drain(broker.queue))
    assert left == ["(3,)", "(4,)"]


@pytest.mark.parametrize("broker", ["amqp"], indirect=True)
def test_acks_written_in_part_before_a_reconnect_are_not_made(broker, client):
    """The rest of a part-written batch belongs to its connection: after a reconnect,
    finishing it is an error (the messages come back from the server), never a
    success."""
    from workhorse.broker.consumer import BrokerUnavailable
    with delivered(client, broker, 1) as (consumer, received):
        old = received[0].channel
        consumer.close()
        consumer.connect(5, lambda: 5)
        with pytest.raises(BrokerUnavailable):
            consumer.finish_write(old)
        wait_until(lambda: _drained(consumer, received) == 2, 10, "the delivery again")
        assert received[1].delivery_info["redelivered"]
        consumer.finish_write(received[1].channel)      # nothing left: nothing to do


@pytest.mark.parametrize("broker", ["amqp"], indirect=True)
def test_a_connection_check_reads_past_the_last_heartbeats_to_the_close(broker, client):
    """After a freeze, the last heartbeats RabbitMQ sent wait in the socket ahead of its
    close: the check (``BrokerConsumer.check_alive``) reads on to the close and reports
    the loss. (One read would stop at the heartbeats, whose bytes pass the heartbeat
    check.) The socket is swapped for one end of a pair, the broker's side played by the
    other."""
    losses: list[BaseException] = []
    with delivered(client, broker, 0, lost=losses.append) as (consumer, _):
        transport = consumer.connection.connection.transport
        real, (ours, theirs) = transport.sock, socket.socketpair()
        ours.settimeout(real.gettimeout())
        transport.sock = ours
        try:
            theirs.sendall(b"\x08\x00\x00\x00\x00\x00\x00\xce" * 2)   # heartbeat frames
            theirs.close()
            consumer.check_alive()
            assert len(losses) == 1 and consumer.connection is None
        finally:
            real.close()
            ours.close()


@pytest.mark.parametrize("broker", ["amqp"], indirect=True)
@pytest.mark.parametrize("asked", [7, 0])
def test_the_consuming_connection_has_the_heartbeat_broker_heartbeat_asks(
        broker, client, monkeypatch, asked):
    """RabbitMQ takes the lower of its own (60 s) and the worker's; 0 turns them off."""
    monkeypatch.setenv("WORKHORSE_BROKER_HEARTBEAT", str(asked))
    client.configure()
    assert client.settings.broker_heartbeat == asked
    with delivered(client, broker, 0) as (consumer, _):
        assert consumer.connection.get_heartbeat_interval() == asked
        # The loop's heartbeat checks: a quarter of it apart, none when it is off.
        checks = [interval for interval, _ in consumer.driver.periodic()
                  if interval == asked / 4]
        assert len(checks) == (1 if asked else 0)
