"""On RabbitMQ the broker thread, once idle, lends the reading of the deliveries to the loop
thread (BrokerLink._read_here): the loop reads what the socket holds when it is readable,
never waiting, and hands each delivery over once its frames are in whole; no thread is
woken for them. The broker thread busy when the socket is readable: the reading goes back
to it, it reads what is there, and lends it again once idle. The connection failing under
the loop's read: the loss is reported, and the reading is lent again on the new
connection. A delivery whose frames come a few bytes at a time is handed over whole. Once
consuming is cancelled, the broker thread reads what is left, and lends nothing more."""
from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from .conftest import BrokerEnv
from .links import AmqpLinkHarness, ShapedSocket, on_rabbitmq

pytestmark = [pytest.mark.timeout(60), pytest.mark.broker("amqp")]


class ReadingLink(AmqpLinkHarness):
    """The harness on RabbitMQ; the broker thread's reads, the loop's, and the losses
    reported are recorded."""

    def __init__(self, broker: BrokerEnv) -> None:
        super().__init__(broker)
        self.losses: list[BaseException] = []
        self.link.on_lost_cb = self.losses.append
        self.thread_reads = 0       # the broker thread's reads of the socket
        self.loop_reads = 0
        consumer = self.link.thread.consumer
        on_readable, read_now = consumer.on_readable, consumer.read_now

        def thread_read(fd: int) -> None:
            self.thread_reads += 1
            on_readable(fd)

        def loop_read() -> bool | None:
            self.loop_reads += 1
            return read_now()
        consumer.on_readable = thread_read      # type: ignore[method-assign]
        consumer.read_now = loop_read           # type: ignore[method-assign]
        self.lends = 0              # the reading lent to the loop (not its taking back, fd -1)
        lend = self.link.thread.lend_reads
        assert lend is not None

        def lent(fd: int, generation: int) -> None:
            # Once cancelled, the broker thread's post taking the reading back (fd -1) can
            # come after the loop gave it back itself (it found the thread busy running
            # the cancel): a lend it is not.
            self.lends += fd >= 0
            lend(fd, generation)
        self.link.thread.lend_reads = lent

    def lent(self) -> bool:
        return self.link._reading[0] >= 0

    def wait_lent(self) -> None:
        self.turn_until(lambda: self.lent() and self.parked(),
                        "the broker thread to lend the reading to the loop")

    def ids(self) -> list[str]:
        return [message.headers["id"] for message in self.received]

    def settled_at_the_server(self) -> None:
        """Every delivery acked; once the connection is closed nothing came back."""
        for message in self.received:
            self.link.ack(message)
        self.link.set_room(8)
        self.turn_until(lambda: all(m.acknowledged for m in self.received), "the acks")
        super().settled_at_the_server()


@pytest.fixture
def reading_link(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[ReadingLink]:
    with on_rabbitmq(ReadingLink, tmp_path, monkeypatch) as it:
        yield it


def test_the_idle_broker_thread_lends_the_reading_and_the_loop_reads_the_deliveries(
        reading_link):
    it = reading_link
    it.wait_lent()
    before = it.thread_reads
    it.publish(5)
    it.turn_until(lambda: len(it.received) == 5, "5 deliveries")
    assert it.ids() == [f"id-{n}" for n in range(5)]
    assert it.loop_reads >= 1 and it.thread_reads == before
    it.settled_at_the_server()


def test_with_the_broker_thread_busy_the_reading_goes_back_to_it_and_is_lent_again(
        reading_link):
    it = reading_link
    it.wait_lent()
    with it.link.thread.gate:               # the broker thread in the middle of a turn
        it.publish(3)
        it.turn_until(lambda: not it.lent(), "the loop to give the reading back")
        assert it.received == []
    it.turn_until(lambda: len(it.received) == 3, "the broker thread to read them")
    assert it.thread_reads >= 1
    it.wait_lent()
    reads = it.loop_reads
    it.publish(2)
    it.turn_until(lambda: len(it.received) == 5, "2 more, read by the loop")
    assert it.loop_reads > reads
    assert it.ids() == [f"id-{n}" for n in range(3)] + ["id-0", "id-1"]
    it.settled_at_the_server()


def test_a_connection_failing_under_the_loops_read_is_reported_and_read_again(reading_link):
    it = reading_link
    it.wait_lent()
    generation = it.link._reading[1]
    it.connected.clear()
    it.transport.sock.shutdown(socket.SHUT_RDWR)    # as a connection the network broke
    it.turn_until(lambda: it.losses, "the loss to be reported")
    assert not it.lent()
    it.turn_until(it.connected.is_set, "the broker thread to connect again")
    it.wait_lent()
    assert it.link._reading[1] != generation
    it.publish(2)
    it.turn_until(lambda: len(it.received) == 2, "2 deliveries on the new connection")
    it.settled_at_the_server()


def test_a_delivery_whose_frames_come_a_few_bytes_at_a_time_is_handed_over_whole(
        reading_link):
    it = reading_link
    it.wait_lent()
    transport = it.transport
    transport.sock = ShapedSocket(transport.sock, size=7)     # not even a frame's header a read
    it.publish(3)
    it.turn_until(lambda: len(it.received) == 3, "3 deliveries, a few bytes a read")
    assert it.ids() == [f"id-{n}" for n in range(3)]
    assert it.loop_reads > 3 * 3            # (three frames a delivery, many reads each)
    assert [message.decode()[0] for message in it.received] == [[0], [1], [2]]
    transport.sock = transport.sock.sock
    it.settled_at_the_server()


def test_once_consuming_is_cancelled_the_broker_thread_reads_what_is_left(reading_link):
    it = reading_link
    it.wait_lent()
    it.link.cancel()
    it.turn_until(lambda: not it.lent() and it.parked(),
                  "the reading back with the broker thread")
    lends = it.lends
    it.publish(2)                           # not delivered: nothing consumes
    for _ in range(25):
        it.loop.run_once(0.02)
    assert it.received == [] and not it.lent() and it.lends == lends
    it.link.close(5)
    assert len(it.broker.drain(it.broker.queue)) == 2       # nothing lost


def test_a_lend_that_comes_after_its_socket_closed_is_not_taken(reading_link):
    """The broker thread's post lending the reading can come after the connection closed
    (at shutdown, or a loss reported right behind it): its number may be closed, or
    another file's by then; neither is watched, nor raises."""
    it = reading_link
    it.wait_lent()
    it.link._stop_reading()
    closed = os.open(os.devnull, os.O_RDONLY)
    os.close(closed)
    it.link._reads_lent(closed, 99)
    assert not it.lent()
    read, write = os.pipe()
    try:
        taken: list[int] = []
        it.loop.add_reader(read, lambda: taken.append(1))
        it.link._reads_lent(read, 99)       # another file's number now
        assert not it.lent()
        os.write(write, b"x")
        it.loop.run_once(1)
        assert taken == [1]                 # its reader is untouched
        it.loop.remove_reader(read)
    finally:
        os.close(read)
        os.close(write)
