"""RabbitMQ frames read ahead (``ReadAheadTransport``): one ``recv`` for what the socket
holds, frames served from it whole and in order, py-amqp's errors kept, and frames read
ahead of a drain delivered before the broker thread waits (select() cannot see them)."""
from __future__ import annotations

import select
import socket
import struct
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from workhorse.broker.drivers.amqp import AmqpDriver
from workhorse.transport.rabbitmq import Connection, ReadAheadTransport

from .conftest import wait_until

pytestmark = pytest.mark.timeout(60)


def frame(payload: bytes, kind: int = 1, channel: int = 1) -> bytes:
    return struct.pack(">BHI", kind, channel, len(payload)) + payload + b"\xce"


class CountingSocket:
    """A socket whose recv and settimeout calls are counted."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.recvs = 0
        self.timeouts_set = 0

    def recv(self, n: int) -> bytes:
        self.recvs += 1
        return self.sock.recv(n)

    def settimeout(self, value: float | None) -> None:
        self.timeouts_set += 1
        self.sock.settimeout(value)

    def gettimeout(self) -> float | None:
        return self.sock.gettimeout()


@pytest.fixture
def pair() -> Iterator[tuple[ReadAheadTransport, CountingSocket, socket.socket]]:
    ours, server = socket.socketpair()
    ours.settimeout(0)          # as the broker thread drains: never waits
    transport = ReadAheadTransport("127.0.0.1:5672")    # not connected: the pair instead
    counting = CountingSocket(ours)
    transport.sock = counting   # type: ignore[assignment]
    yield transport, counting, server
    ours.close()
    server.close()


def test_frames_sent_together_are_read_with_one_recv_whole_and_in_order(pair):
    transport, sock, server = pair
    payloads = [b"method", b"header" * 10, b"body" * 1000]
    server.sendall(b"".join(frame(p) for p in payloads))
    got = []
    for n in range(3):
        assert transport.frame_buffered() is (n > 0)
        got.append(transport.read_frame()[2])
    assert got == payloads
    assert sock.recvs == 1
    assert not transport.frame_buffered()


def test_a_frame_cut_in_its_header_times_out_and_is_kept_for_the_next_read(pair):
    transport, _, server = pair
    whole = frame(b"payload")
    server.sendall(whole[:5])
    with pytest.raises(TimeoutError):       # py-amqp's socket.timeout: nothing to read yet
        transport.read_frame()
    assert not transport.frame_buffered()
    server.sendall(whole[5:] + frame(b"next"))
    assert transport.read_frame() == (1, 1, b"payload")
    assert transport.read_frame() == (1, 1, b"next")


def test_an_empty_socket_times_out_and_a_closed_one_is_an_error(pair):
    transport, _, server = pair
    with pytest.raises(TimeoutError):
        transport.read_frame()
    server.close()
    with pytest.raises(OSError, match="unexpectedly closed"):
        transport.read_frame()


def test_a_buffered_frame_is_read_without_setting_the_sockets_timeout(pair):
    """py-amqp sets the socket's timeout before and after every frame (two system calls);
    a frame already read ahead needs neither."""
    transport, sock, server = pair
    server.sendall(frame(b"one") + frame(b"two"))
    read: list[Any] = []
    connection = Connection.__new__(Connection)     # not connected: the pair instead
    connection._transport = transport
    connection.on_inbound_frame = read.append
    connection.blocking_read(5.0)
    assert sock.timeouts_set == 2             # set to 5 s for the socket read, then back
    connection.blocking_read(5.0)
    assert sock.timeouts_set == 2             # from the buffer
    assert [f[2] for f in read] == [b"one", b"two"]


def test_the_tick_drains_what_is_buffered_until_no_whole_frame_is_left():
    """Frames a drain read ahead of what it delivered (a wait for a publish confirm stops
    at its confirm) are delivered by the tick before the broker thread waits."""
    buffered = [True, True, False]
    drained = []

    def drain_events(timeout: float) -> None:
        drained.append(timeout)
        raise TimeoutError       # (each drain delivers what is buffered, then times out)

    driver = AmqpDriver.__new__(AmqpDriver)
    driver.connection = SimpleNamespace(    # type: ignore[assignment]
        connection=SimpleNamespace(transport=SimpleNamespace(
            frame_buffered=lambda: buffered.pop(0))),
        drain_events=drain_events)
    driver.tick()
    assert drained == [0, 0] and not buffered


@pytest.mark.parametrize("broker", ["amqp"], indirect=True)
def test_deliveries_read_ahead_are_handed_over_by_the_tick(broker, client):
    """Deliveries a drain or a wait for a publish confirm read on past what it delivered
    sit read ahead, where select() cannot see them: the tick, before every wait of the
    broker thread, delivers them."""
    from tests.apps import basic
    from workhorse.broker.consumer import BrokerConsumer
    received: list = []
    consumer = BrokerConsumer(client, [broker.queue], lambda q, m: received.append(m),
                              lambda exc: None)
    try:
        consumer.connect(5, lambda: 5)
        for _ in range(5):
            basic.record.delay()
        wait_until(lambda: broker.queue_size() == 0, 10, "all five sent to the consumer")
        transport = consumer.connection.connection.transport
        # Read ahead, as a drain reading on past its delivery would.
        wait_until(lambda: _read_ahead(transport) >= 5, 10, "the deliveries")
        # None left to see on the socket: all of them are read ahead.
        assert not received and not select.select([transport.sock], [], [], 0)[0]
        consumer.tick()
        assert len(received) == 5 and not transport.frame_buffered()
        for message in received:
            consumer.ack(message)
    finally:
        consumer.close()


def _read_ahead(transport: ReadAheadTransport) -> int:
    """Read what the socket holds into the transport's buffer; return the number of whole
    body frames (one a delivery) buffered."""
    try:
        transport._read_buffer += transport.sock.recv(65536, socket.MSG_DONTWAIT)
    except BlockingIOError:
        pass
    data, bodies = transport._read_buffer, 0
    while len(data) >= 7:
        kind, _, size = struct.unpack_from(">BHI", data)
        if len(data) < size + 8:
            break
        bodies += kind == 3
        data = data[size + 8:]
    return bodies
