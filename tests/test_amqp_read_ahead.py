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

from amqp.exceptions import UnexpectedFrame

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

    def recv(self, n: int, flags: int = 0) -> bytes:
        self.recvs += 1
        return self.sock.recv(n, flags)

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


def connected_to(transport: ReadAheadTransport) -> tuple[Any, list[Any]]:
    """Our Connection on ``transport`` (not connected: a socket pair instead), handing
    frames to a handler that completes a method at each frame whose payload ends in "!";
    and the frames it got."""
    got: list[Any] = []
    connection = Connection.__new__(Connection)
    connection._transport = transport
    connection.on_inbound_frame = lambda f: got.append(f) or f[2].endswith(b"!")
    return connection, got


def test_frames_buffered_whole_are_read_until_one_completes_a_method(pair):
    """A delivery's three frames in one call, from one recv, setting no timeout."""
    transport, sock, server = pair
    server.sendall(frame(b"deliver") + frame(b"header", 2) + frame(b"body!", 3)
                   + frame(b"next!"))
    connection, got = connected_to(transport)
    assert connection.blocking_read(0) is True
    assert [f[2] for f in got] == [b"deliver", b"header", b"body!"]
    assert (sock.recvs, sock.timeouts_set) == (1, 0)
    connection.drain_events(timeout=0)
    assert got[-1] == (1, 1, b"next!") and sock.recvs == 1
    # A method's frames cut short: those there are handed over, the rest waited for.
    whole = frame(b"header", 2)
    server.sendall(frame(b"deliver") + whole[:4])
    assert connection.blocking_read(0) is False
    server.sendall(whole[4:] + frame(b"body!", 3))
    connection.drain_events(timeout=0)
    assert [f[2] for f in got[-3:]] == [b"deliver", b"header", b"body!"]


def test_a_read_that_must_not_wait_ends_at_once_on_an_empty_socket(pair):
    """One recv, no timeout set, TimeoutError (py-amqp's socket.timeout); a closed
    connection is an error and the transport is no longer connected."""
    transport, sock, server = pair
    connection, _ = connected_to(transport)
    transport.connected = True
    with pytest.raises(TimeoutError):
        connection.drain_events(timeout=0)
    assert (sock.recvs, sock.timeouts_set) == (1, 0) and transport.connected
    server.close()
    with pytest.raises(OSError, match="unexpectedly closed"):
        connection.drain_events(timeout=0)
    assert not transport.connected


def test_a_wrong_frame_end_is_py_amqps_error(pair):
    transport, _, server = pair
    server.sendall(frame(b"one!")[:-1] + b"\x00" + frame(b"two!"))
    connection, got = connected_to(transport)
    with pytest.raises(UnexpectedFrame, match="frame_end 0x00"):
        connection.drain_events(timeout=0)
    connection.drain_events(timeout=0)
    assert [f[2] for f in got] == [b"two!"]


def test_a_socket_with_a_timeout_of_its_own_is_read_by_py_amqps_path(pair):
    """recv would wait up to the socket's timeout before reading: read_now declines, and
    py-amqp's read (setting the timeout asked for around it) is used."""
    transport, sock, server = pair
    sock.sock.settimeout(3.0)
    assert transport.read_now() is None and sock.recvs == 0
    server.sendall(frame(b"one!"))
    connection, got = connected_to(transport)
    connection.drain_events(timeout=0)
    assert got == [(1, 1, b"one!")] and sock.timeouts_set == 2   # 0 s, then back to 3 s


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
