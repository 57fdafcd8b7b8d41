"""On RabbitMQ the loop thread writes a turn's acks itself when one of them is an ack at
start (its task waits for it), or while it reads the deliveries itself (the broker thread
lent it the reading: tests/test_amqp_reads_here.py), and the broker thread is parked and
the socket takes them at once (BrokerLink._ack_here): that task starts in the next turn,
no thread woken. Late acks alone, while the broker thread reads the deliveries, go to it:
it writes them with the deliveries it reads. The broker thread busy, or the socket full:
they are handed to it, as before. The socket taking a part: the broker thread sends the
rest before anything else, and only then are they acked."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from .conftest import BrokerEnv
from .links import AmqpLinkHarness, ShapedSocket, on_rabbitmq

pytestmark = [pytest.mark.timeout(60), pytest.mark.broker("amqp")]


class AmqpLink(AmqpLinkHarness):
    """The harness on RabbitMQ; the acks it hands the broker thread are counted."""

    def __init__(self, broker: BrokerEnv) -> None:
        super().__init__(broker)
        self.outcomes: list[BaseException | None] = []
        self.handed: list[int] = []         # acks handed to the broker thread
        submit = self.link.thread.submit_acks
        self.link.thread.submit_acks = lambda acks: (self.handed.append(len(acks)),
                                                     submit(acks))[1]

    def deliveries(self, count: int) -> None:
        """``count`` published and delivered, and the broker thread parked again."""
        self.publish(count)
        self.turn_until(lambda: len(self.received) == count and self.parked(),
                        f"{count} deliveries")

    def ack_at_start(self) -> None:
        """Each delivery acked as an ack at start is (its task waits for the outcome)."""
        for message in self.received:
            self.link.ack_then(message, self.outcomes.append)

    def read_by_the_broker_thread(self) -> None:
        """The reading of the deliveries taken back by the broker thread, and not lent
        again."""
        self.link.thread.lend_reads = None
        self.link._reads_back()
        self.turn_until(lambda: self.link.thread._lent is None and self.parked(),
                        "the broker thread to read the deliveries again")



@pytest.fixture
def amqp_link(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[AmqpLink]:
    with on_rabbitmq(AmqpLink, tmp_path, monkeypatch) as it:
        yield it


def test_on_rabbitmq_the_loop_writes_acks_at_start_and_their_tasks_start_next_turn(
        amqp_link):
    it = amqp_link
    assert not it.link.room_read_before_wait      # a credit: every change said at once
    it.deliveries(3)
    it.ack_at_start()
    it.link.flush()
    assert it.handed == [] and all(m.acknowledged for m in it.received)
    assert it.outcomes == []                # told in the next turn, as the thread tells it
    it.loop.run_once(0)
    assert it.outcomes == [None, None, None]
    it.settled_at_the_server()


def test_with_the_broker_thread_busy_the_acks_are_handed_to_it(amqp_link):
    it = amqp_link
    it.deliveries(2)
    it.ack_at_start()
    with it.link.thread.gate:           # the broker thread in the middle of a turn
        it.link.flush()
        assert it.handed == [2] and not any(m.acknowledged for m in it.received)
    it.turn_until(lambda: len(it.outcomes) == 2, "the broker thread's acks")
    assert it.outcomes == [None, None]
    it.settled_at_the_server()


def test_acks_written_in_part_are_finished_by_the_broker_thread_before_they_count(amqp_link):
    it = amqp_link
    it.deliveries(3)
    transport = it.transport
    transport.sock = ShapedSocket(transport.sock, room=30)     # a frame and a half
    it.ack_at_start()
    it.link.flush()
    assert it.handed == []                  # not handed: written in part, the rest kept
    assert it.outcomes == []
    it.turn_until(lambda: len(it.outcomes) == 3, "the broker thread's rest of the write")
    assert it.outcomes == [None, None, None] and transport._unsent == b""
    it.settled_at_the_server()


def test_a_full_socket_leaves_the_acks_to_the_broker_thread(amqp_link):
    it = amqp_link
    it.deliveries(2)
    transport = it.transport
    transport.sock = ShapedSocket(transport.sock, room=0)
    it.ack_at_start()
    it.link.flush()
    assert it.handed == [2]
    it.turn_until(lambda: len(it.outcomes) == 2, "the broker thread's acks")
    assert it.outcomes == [None, None]
    it.settled_at_the_server()


def test_late_acks_alone_go_to_the_broker_thread_together_while_it_reads(amqp_link):
    """Written here, a turn's late acks went out one or two a write, where the broker
    thread writes several turns' at once (measured: 0.94x the tasks a second)."""
    it = amqp_link
    it.read_by_the_broker_thread()
    it.deliveries(4)
    for message in it.received:
        it.link.ack(message)
    it.link.set_room(8)                     # the end of the turn: RabbitMQ's acks go
    assert it.handed == [4]
    it.turn_until(lambda: all(m.acknowledged for m in it.received), "the acks")
    it.settled_at_the_server()


def test_late_acks_go_with_an_ack_at_start_in_one_write(amqp_link):
    it = amqp_link
    it.deliveries(3)
    it.link.ack(it.received[0])
    it.link.ack(it.received[1])
    it.link.ack_then(it.received[2], it.outcomes.append)
    it.link.flush()
    assert it.handed == [] and all(m.acknowledged for m in it.received)
    it.settled_at_the_server()


def test_while_the_loop_reads_the_deliveries_late_acks_are_written_here_too(amqp_link):
    it = amqp_link
    it.deliveries(4)
    assert it.link._reading[0] >= 0         # the reading is lent to the loop thread
    for message in it.received:
        it.link.ack(message)
    it.link.set_room(8)                     # the end of the turn: RabbitMQ's acks go
    assert it.handed == [] and all(m.acknowledged for m in it.received)
    it.settled_at_the_server()


def test_while_the_loop_reads_late_acks_wait_for_a_batch_a_starved_window_or_5_ms(
        amqp_link):
    """Written one or two a turn, late acks cost RabbitMQ a frame and a wakeup each: they
    are held back, as on Redis and SQLite, until half the window's worth is waiting, no
    message is buffered for a child (they hold RabbitMQ's credit), or ACK_DELAY passed."""
    it = amqp_link
    it.deliveries(8)                                # the whole window: no room left
    assert it.link._reading[0] >= 0
    it.link.set_room(0, starved=False)
    it.link.ack(it.received[0])
    it.link.set_room(1, starved=False)              # one place free: not a batch
    assert not it.received[0].acknowledged
    it.turn_until(lambda: it.received[0].acknowledged, "ACK_DELAY to pass")
    it.link.ack(it.received[1])
    it.link.set_room(2, starved=True)               # nothing buffered for a child
    assert it.received[1].acknowledged
    for message in it.received[2:5]:
        it.link.ack(message)
    it.link.set_room(2, starved=False)              # three: not a batch yet
    assert not any(m.acknowledged for m in it.received[2:5])
    it.link.ack(it.received[5])
    it.link.set_room(2, starved=False)              # four, half the window
    assert all(m.acknowledged for m in it.received[:6])
    for message in it.received[6:]:
        it.link.ack(message)
    it.link.flush()
    assert it.handed == [] and all(m.acknowledged for m in it.received)
    it.settled_at_the_server()
