"""On Redis the loop thread sends its acks and takes itself, as one script on the channel's
own connection, and reads the answer when the socket is readable: it never waits, and the
broker thread stays parked until every answer is in (BrokerLink._send_take). One take is
out at a time, except that an ack at start goes out at once behind it (its task waits for
it), with a take of what room is left; a take that gets no answer is given up
(tests/test_broker_faults.py injects that fault into a real worker)."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

from workhorse.broker import thread as broker_thread
from workhorse.broker.drivers import base as driver_base
from workhorse.broker.drivers import redis as redis_driver
from workhorse.protocol import dead_letter_queue

from .conftest import BrokerEnv, make_broker
from .links import LinkHarness

pytestmark = [pytest.mark.timeout(60), pytest.mark.broker("redis")]


class RedisLink(LinkHarness):
    """The harness on Redis."""

    def __init__(self, broker: BrokerEnv) -> None:
        super().__init__(broker.url, broker.queue)
        self.broker = broker
        self.handed = 0                 # messages handed to the loop, those cleared too
        self.redis = redis.Redis.from_url(broker.url)

    def _received(self, queue: str, message: Any, deliveries: int) -> None:
        super()._received(queue, message, deliveries)
        self.handed += 1

    def room(self, free: int) -> None:
        """``free`` places in the window now, as the supervisor says it."""
        self.link.received = self.handed
        self.link.set_room(free)

    def leased(self, message: Any) -> bool:
        return bool(self.redis.hexists("unacked", message.delivery_tag))


@pytest.fixture
def redis_link(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[RedisLink]:
    # The loop thread sends only while the broker thread is parked: its idle turns, safety
    # polls and sweeps would now and then be under way when a test sends.
    monkeypatch.setattr(broker_thread, "IDLE_TURN", 3600.0)
    monkeypatch.setattr(driver_base.Driver, "poll_interval", 3600.0)
    monkeypatch.setattr(redis_driver, "RESTORE_SWEEP_INTERVAL", 3600.0)
    broker = make_broker("redis", tmp_path)
    it = RedisLink(broker)
    it.publish(1)                      # the queue exists before it connects
    it.start()
    # The first take is the broker thread's: it opens the connection the loop sends on
    # (connecting may wait); the ack of what it took is sent from here.
    it.room(1)
    it.turn_until(lambda: it.received, "the first message")
    it.link.ack(it.received.pop())
    it.room(0)
    it.link.flush()
    it.turn_until(lambda: it.link._pipe is None and not it.link._acks, "its ack")
    fetches = it.link._fetches
    assert fetches == it.link.thread.fetches_done == 1
    try:
        yield it
    finally:
        it.link.close(5)
        it.redis.close()
        broker.cleanup()


def test_on_redis_the_loop_sends_its_take_and_reads_the_answer_when_it_comes(redis_link):
    it = redis_link
    it.publish(10)
    assert it.link.room_read_before_wait    # (the supervisor's settles say it a turn later)
    it.room(8)
    it.loop.wait(0)
    assert it.link._pipe is not None and len(it.link._out) == 1   # sent, not waited for
    assert it.received == []
    it.turn_until(lambda: it.link._pipe is None, "the answer")
    assert len(it.received) == 8            # the window, not what the queue holds
    assert it.link.thread.fetches_done == 1 and it.link._fetches == 1   # no thread woken
    assert all(it.leased(m) for m in it.received)
    for message in it.received[:5]:
        it.link.ack(message)
    it.room(5)                              # five places free: the acks go with the take
    it.turn_until(lambda: len(it.received) == 10 and it.link._pipe is None, "the next take")
    assert not any(it.leased(m) for m in it.received[:5])
    assert all(m.acknowledged for m in it.received[:5])
    assert it.redis.llen(it.broker.queue) == 0


def test_a_late_ack_held_back_while_a_take_is_out_goes_once_its_answer_is_in(redis_link):
    """Nothing else happens afterwards (the last task of a burst): the ack must not wait
    for a next take that never comes."""
    it = redis_link
    it.publish(10)
    it.room(2)              # (less than the queue holds: the broker thread is not woken)
    it.turn_until(lambda: len(it.received) == 2 and it.link._pipe is None, "the messages")
    first, last = it.received
    it.link.ack(first)
    it.link.flush()                         # sent from here: a take is out
    assert it.link._pipe is not None
    it.link.ack(last)
    it.link.flush()                         # held back: one take out at a time
    assert len(it.link._out) == 1 and it.link._acks
    it.turn_until(lambda: last.acknowledged and it.link._pipe is None, "the held ack")
    assert not it.leased(first) and not it.leased(last)
    assert it.link.thread.fetches_done == 1


def test_an_ack_at_start_goes_at_once_behind_a_take_and_the_two_never_pass_the_window(
        redis_link):
    it = redis_link
    it.publish(20)
    it.room(2)
    it.turn_until(lambda: len(it.received) == 2 and it.link._pipe is None, "two messages")
    held, started = it.received
    it.link.ack(held)
    it.room(4)                              # 4 free: a take of 4 goes out with the ack
    it.loop.wait(0)
    assert len(it.link._out) == 1
    answered: list[Any] = []
    it.link.ack_then(started, answered.append)
    it.link.set_room(4)                     # the supervisor's turn after an ack at start
    it.loop.wait(0)
    assert len(it.link._out) == 2           # not waiting for the take's answer
    it.turn_until(lambda: answered and it.link._pipe is None, "the ack at start")
    assert answered == [None] and started.acknowledged and not it.leased(started)
    # The second take asked for the room the first had not claimed: none.
    assert len(it.received) == 2 + 4
    assert it.redis.llen(it.broker.queue) == 20 - 6


def test_an_unreadable_entry_met_by_the_loop_is_buried_by_the_broker_thread(redis_link):
    it = redis_link
    it.redis.lpush(it.broker.queue, b"{not json")
    it.publish(1)
    dead = dead_letter_queue(it.broker.queue)
    try:
        it.room(8)
        it.loop.wait(0)
        assert it.link._pipe is not None
        it.turn_until(lambda: it.redis.llen(dead) == 1, "the unreadable entry's burial")
        # (the message behind it is taken by the broker thread, whose turn arms a wait
        # on the list: the room said already is not said again)
        it.turn_until(lambda: len(it.received) == 1, "the readable message")
    finally:
        it.redis.delete(dead)


def _take_two(it: RedisLink) -> None:
    """Two messages taken by the loop, then acked: a pipe begun and ended."""
    before = len(it.received)
    it.room(2)
    it.turn_until(lambda: len(it.received) == before + 2 and it.link._pipe is None,
                  "two messages")
    for message in it.received[-2:]:
        it.link.ack(message)
    it.room(0)
    it.link.flush()
    it.turn_until(lambda: it.link._pipe is None and not it.link._acks, "their acks")


def _channel(it: RedisLink) -> Any:
    return it.link.thread.consumer.driver.channel


def test_the_socket_stays_watched_between_takes_without_registering_it_again(redis_link):
    """Each take sent here is a pipe of its own (each ack at start, with acks early): its
    socket is not removed from the loop's selector and added again for each."""
    it = redis_link
    it.publish(6)
    fd, sock = it.link._watching
    registered: list[int] = []
    register = it.loop.selector.register

    def counted(fileobj: Any, events: int, data: Any = None) -> Any:
        registered.append(fileobj)
        return register(fileobj, events, data)

    it.loop.selector.register = counted     # type: ignore[method-assign]
    for _ in range(3):
        _take_two(it)
    assert registered == []
    assert it.link._watching == (fd, sock) and fd in it.loop._idle


def test_an_answer_on_the_watched_socket_between_takes_is_left_to_its_reader(redis_link):
    """Between takes the connection is the broker thread's: an answer to its own call
    wakes the loop (if the broker thread has not read it first), which stops watching
    the socket, reads nothing of it, and watches it again with its next take."""
    it = redis_link
    it.publish(2)
    fd, sock = it.link._watching
    direct = _channel(it)._direct
    with direct.lock:                   # a call of the broker thread's, as it makes one
        direct.connection.send_command("PING")
        it.turn_until(lambda: it.link._watching is None, "the loop to stop watching")
        assert fd not in it.loop._keys
        assert direct.connection.read_response() in (b"PONG", "PONG")     # left unread
    it.room(2)
    it.turn_until(lambda: len(it.received) == 2 and it.link._pipe is None, "the loop's take")
    assert it.link._watching == (fd, sock) and it.loop._keys[fd].data == it.link._read_sent
    assert it.link.thread.fetches_done == 1         # (the loop's, not the broker thread's)


def test_a_new_socket_on_the_same_number_is_watched_anew(redis_link):
    """The connection dropped and made again between takes: the idle registration was
    of the old socket, which the kernel dropped with it; the new one is registered."""
    it = redis_link
    reused = False
    # The new socket takes the lowest free number, which is the old one's unless another
    # thread of the test's process closed a lower one meanwhile: up to 5 tries for the
    # case that matters; every one is registered anew.
    for _ in range(5):
        it.publish(6)
        # First a take of the loop's, which leaves it watching the socket it sent on
        # (the state after a take; the broker thread's own calls stop the watching).
        _take_two(it)
        assert it.link._watching is not None
        old_fd, old_sock = it.link._watching
        done = it.link.thread.fetches_done
        _channel(it)._direct.connection.disconnect()
        # The next take finds no socket to send on: the broker thread connects and
        # takes; the one after is the loop's, on the new socket.
        _take_two(it)
        _take_two(it)
        fd, sock = it.link._watching
        assert sock is not old_sock and sock is _channel(it)._direct.connection._sock
        assert it.loop._keys[fd].data == it.link._read_sent
        assert it.link.thread.fetches_done > done       # (the broker thread's take)
        if fd == old_fd:
            reused = True
            break
    assert reused, "the new socket never took the old one's number"


def test_a_take_asked_for_while_one_is_out_waits_for_the_room_said_after_its_answer(
        redis_link):
    """A take asked for while another is out is not sent blind when the answer comes in:
    that answer may have filled the buffer, and a take of the place or two freed meanwhile
    costs a round trip for little. The room said next decides; a late ack held meanwhile
    goes within ACK_DELAY all the same."""
    it = redis_link
    it.publish(20)
    it.room(2)
    it.turn_until(lambda: len(it.received) == 2 and it.link._pipe is None, "two messages")
    it.link.ack(it.received[0])
    it.room(4)                              # a take of 4 goes out with the ack
    it.loop.wait(0)
    assert len(it.link._out) == 1
    it.link.ack(it.received[1])
    it.link.set_room(5)                     # a starved window asks again: held back
    it.loop.wait(0)
    assert len(it.link._out) == 1 and it.link._deferred
    it.turn_until(lambda: it.link._pipe is None, "the answer")
    assert len(it.received) == 2 + 4
    assert not it.link._want_fetch and it.link._ack_timer is not None   # nothing sent blind
    it.turn_until(lambda: it.received[1].acknowledged and it.link._pipe is None,
                  "the held ack, within ACK_DELAY")
    taken = len(it.received)
    it.link.received = it.handed
    it.link.set_room(1, starved=False)      # one place, children busy: not worth a take
    it.loop.wait(0)
    assert it.link._pipe is None and len(it.received) == taken
    it.room(6)                              # a batch's worth: taken
    it.turn_until(lambda: len(it.received) == taken + 6 and it.link._pipe is None, "a take")


def test_one_timer_gives_up_on_answers_whatever_the_takes_sent(redis_link):
    """Each take sent here has a second for its answer. One timer watches them all (not
    one made and cancelled for every take, a take a task with acks at start): due before
    the oldest answer's second is over, it waits on; due after it, the takes out are given
    up."""
    it = redis_link
    it.publish(8)
    for _ in range(3):
        _take_two(it)
    watching = [entry for entry in it.loop._timers if entry[2].callback == it.link._out_due]
    assert len(watching) == 1       # (not one for each take, cancelled but in the heap)
    given_up: list[BaseException] = []
    it.link._sent_failed = given_up.append     # type: ignore[method-assign]
    it.room(2)
    it.loop.wait(0)                 # sent; its answer not read yet
    assert it.link._pipe is not None
    timer = it.link._out_timer
    assert timer is not None and not timer.cancelled
    timer.callback()                # due early (an older pipe's time): waits on
    again = it.link._out_timer
    assert given_up == [] and again is not None and again is not timer
    assert again.when == it.link._out_deadline > it.loop.clock()
    it.link._out_deadline = it.loop.clock() - 0.001
    again.callback()                # its second is over: given up
    assert len(given_up) == 1 and isinstance(given_up[0], TimeoutError)
    del it.link._sent_failed
    it.turn_until(lambda: it.link._pipe is None, "the answer, read all the same")
