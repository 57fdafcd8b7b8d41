"""Tier 1: the broker thread (``broker/thread.py``) against a fake session and a fake clock:
no broker, no thread started, no sleep. Its turn is driven by hand (``_run_commands``,
``_prepare``, ``_hand_over``), its timers by the fake clock."""
from __future__ import annotations

import os
import socket
import types
from collections.abc import Callable
from typing import Any

import pytest

from tests.fakes import FakeClock
from workhorse.broker.backoff import LASTED, backoff
from workhorse.broker.thread import BLOCKED_RETRY, Ack, BrokerThread
from workhorse.transport.rabbitmq import BrokerBlocked

pytestmark = pytest.mark.timeout(30)


class FakeSession:
    """The connection's session as the broker thread uses it: connects when ``up``,
    records acks, fetches and counts, hands over what a test says arrived."""

    def __init__(self, clock: FakeClock, received: Callable[[str, Any], None],
                 lost: Callable[[BaseException], None]) -> None:
        self.clock, self.received, self.lost = clock, received, lost
        self.up = True
        self.connected = False
        self.generation = 0
        self.connected_at = 0.0
        self.attempts: list[float] = []
        self.calls: list[tuple] = []
        self.takes_with_acks = False
        self.poll_interval = 1.0
        self.replaced: set[Any] = set()     # redeliveries replaced by a copy: never handed

    # -- life cycle
    def connect(self, prefetch: int, room: Callable[[], int], *, retries: int = 3,
                acked_running: int = 0) -> None:
        self.attempts.append(self.clock())
        if not self.up:
            raise ConnectionRefusedError("refused")
        self.connected = True
        self.generation += 1
        self.connected_at = self.clock()

    def drop(self) -> None:
        """The connection fails, as a failed read reports it."""
        self.connected = False
        self.lost(ConnectionError("reset"))

    def close(self) -> None:
        self.connected = False

    def where(self) -> str:
        return "fake://"

    def server(self) -> str:
        return ""

    def describe_failure(self, exc: BaseException) -> str:
        return f"unreachable ({exc})"

    def is_connection_error(self, exc: BaseException) -> bool:
        return isinstance(exc, ConnectionError)

    # -- a turn
    def tick(self) -> None:
        pass

    def fds(self) -> set[int]:
        return set()

    def on_readable(self, fd: int) -> None:
        pass

    def periodic(self) -> list[tuple[float, Callable[[], None]]]:
        return []

    def poll_due(self, now: float) -> bool:
        return True

    def poll(self) -> None:
        self.calls.append(("poll",))

    def ack_many(self, messages: list[Any], fetch: bool = False) -> list[Exception | None]:
        self.calls.append(("ack_many", list(messages), fetch))
        return [None] * len(messages)

    def count_delivery(self, queue: str, message: Any) -> int | None:
        return None if message in self.replaced else 1


class Made:
    """A broker thread, its fake session and clock, and what it told the loop."""

    def __init__(self, max_retries: int | None = None, retry_on_startup: bool = True) -> None:
        self.clock = FakeClock()
        self.posted: list[Callable[[], None]] = []
        self.handed: list[Any] = []
        self.connected: list[bool] = []
        self.lost: list[BaseException] = []
        self.gave_up: list[BaseException] = []
        self.thread = BrokerThread(
            self._session, self.posted.append, lambda q, m, n: self.handed.append(m),
            lambda consumer, ok: self.connected.append(ok), self.lost.append,
            self.gave_up.append, lambda: 8, max_retries, retry_on_startup, clock=self.clock)
        self.thread.room.update(8, 0)

    def _session(self, received: Callable[[str, Any], None],
                 lost: Callable[[BaseException], None]) -> FakeSession:
        self.session = FakeSession(self.clock, received, lost)
        return self.session

    def run_posted(self) -> None:
        posted, self.posted[:] = list(self.posted), []
        for callback in posted:
            callback()

    def advance(self, seconds: float) -> None:
        """Move the fake clock on, running the broker thread's timers as they come due."""
        step = 0.05
        for _ in range(int(round(seconds / step))):
            self.clock.t += step
            self.thread.loop.run_due()
        self.run_posted()

    def close(self) -> None:
        self.thread.loop.close()


@pytest.fixture
def made():  # type: ignore[no-untyped-def]
    made = Made()
    yield made
    made.close()


def test_a_broker_down_at_start_is_retried_with_back_off_until_it_answers(made):
    made.session.up = False
    made.thread._connect()
    made.advance(0.1)
    assert made.connected == [False]
    made.advance(backoff(1) + backoff(2) + backoff(3) + 0.2)
    tried = made.session.attempts
    gaps = [b - a for a, b in zip(tried, tried[1:], strict=False)]
    assert gaps == pytest.approx([backoff(1), backoff(2), backoff(3)], abs=0.06)
    made.session.up = True
    made.advance(backoff(4))
    assert made.connected[-1] is True and made.session.connected
    assert made.gave_up == []


@pytest.mark.parametrize(("max_retries", "retry_on_startup", "attempts"),
                         [(2, True, 3), (None, False, 1)])
def test_the_broker_thread_gives_up_after_its_retries(max_retries, retry_on_startup,
                                                      attempts):
    made = Made(max_retries, retry_on_startup)
    try:
        made.session.up = False
        made.thread._connect()
        made.advance(60)
        assert len(made.session.attempts) == attempts
        assert len(made.gave_up) == 1 and made.thread._stopping
    finally:
        made.close()


def test_a_lost_connection_is_reported_and_connected_again_backing_off_if_lost_soon(made):
    """A connection that lasted is connected again at once; one lost again soon after it
    was made (an error that only shows once connected) backs off instead of spinning."""
    made.thread._connect()
    made.advance(LASTED + 1)
    made.session.drop()
    made.advance(0.05)
    assert [type(e) for e in made.lost] == [ConnectionError]
    assert made.session.connected and len(made.session.attempts) == 2
    made.session.drop()
    made.advance(backoff(1) / 2)
    assert not made.session.connected and len(made.session.attempts) == 2
    made.advance(backoff(1))
    assert made.session.connected and len(made.session.attempts) == 3


def test_a_connection_that_lasted_starts_the_back_off_over(made):
    made.session.up = False
    made.thread._connect()
    made.advance(backoff(1) + backoff(2) + backoff(3) + 0.1)
    made.session.up = True
    made.advance(backoff(4) + 0.1)
    assert made.session.connected and made.thread._attempts > 0
    made.advance(LASTED + 0.1)
    assert made.thread._attempts == 0


def test_a_turns_acks_and_fetches_go_together_after_its_other_commands_in_order(made):
    """The broker thread carries acks submitted one after another in one call, in order
    with the other commands; however many fetches a turn asked for, it fetches once,
    last, with the acks still waiting (one round trip on Redis), and counts them."""
    thread, session = made.thread, made.session
    session.connected = True
    told: list[object] = []
    first, second, third = (Ack(m, told.append) for m in "abc")
    thread.submit_acks([first])
    thread.fetch()
    thread.commands.put(lambda consumer: session.calls.append(("requeue",)))
    thread.submit_acks([second, third])
    thread.fetch()
    thread.fetch()
    thread._run_commands()
    assert session.calls == [("ack_many", ["a"], False), ("requeue",),
                             ("ack_many", ["b", "c"], True)]
    assert len(made.posted) == 4                    # three acks' callbacks, one wakeup
    made.run_posted()
    assert told == [None, None, None]
    # The loop keeps one fetch in flight: it learns they were carried out, and a fetch
    # that took nothing still wakes it (nothing else would).
    assert thread.fetches_done == 3
    session.calls.clear()
    thread.fetch()
    thread._arrived = [("q", "message")]            # this one took something
    thread._run_commands()
    assert session.calls == [("ack_many", [], True)]
    assert thread.fetches_done == 4 and made.posted == []   # handed over: that wakes it
    session.calls.clear()
    thread.submit_acks([Ack("d")])
    thread._run_commands()
    assert session.calls == [("ack_many", ["d"], False)]    # RabbitMQ: acks alone take nothing
    session.calls.clear()
    session.takes_with_acks = True
    thread.submit_acks([Ack("e")])
    thread._run_commands()
    assert session.calls == [("ack_many", ["e"], True)]     # Redis, SQLite: they take too
    assert thread.fetches_done == 4


def test_a_message_the_loop_never_gets_gives_its_place_in_the_window_back(made):
    """RabbitMQ's redelivery after a loss is replaced by a counted copy, not handed to the
    loop: the place it took is free again (each one used to shrink the room for good)."""
    thread = made.thread
    made.session.replaced = {"b"}
    for message in "abc":
        made.session.received("q", message)
    assert thread.room.available() == 5
    thread._hand_over()
    made.run_posted()
    assert thread.room.available() == 6 and made.handed == ["a", "c"]


def test_what_the_tick_delivers_is_handed_over_before_the_broker_thread_waits(made):
    """RabbitMQ's tick delivers frames read ahead (select() cannot see them); handed over
    only after the wait, they waited up to a second for nothing."""
    made.session.connected = True
    made.session.tick = lambda: made.session.received("q", "read ahead")  # type: ignore[method-assign]
    made.thread._prepare()
    made.run_posted()
    assert made.handed == ["read ahead"]


def test_a_publish_refused_while_rabbitmq_blocks_publishing_waits_and_is_retried(made,
                                                                                 caplog):
    caplog.set_level("INFO", logger="workhorse.broker")
    tries: list[float] = []

    def republish(consumer: object) -> None:
        tries.append(made.clock())
        if len(tries) < 3:
            raise BrokerBlocked("low on disk")
    run = made.thread._guarded(republish, "a dead letter")
    run(made.thread.consumer)
    made.advance(3 * BLOCKED_RETRY)
    assert len(tries) == 3 and made.thread._blocked == 0   # waited, then went through once
    assert "RabbitMQ blocks publishing" in caplog.text
    assert "publishes again" in caplog.text


def test_the_broker_thread_is_borrowed_only_parked_with_nothing_submitted_to_it(made):
    thread = made.thread
    thread.thread.is_alive = lambda: True      # type: ignore[method-assign]
    with thread.borrowed() as consumer:
        assert consumer is thread.consumer                 # parked, nothing to run
        with thread.borrowed() as again:
            assert again is None                           # the gate is held: never waits
    thread.submit(lambda c: None, "something submitted before")
    with thread.borrowed() as consumer:
        assert consumer is None                            # it would be overtaken
    thread.commands.take()
    with thread.gate, thread.borrowed() as consumer:
        assert consumer is None                            # busy in a call


def test_a_new_connections_socket_that_reuses_an_old_number_is_watched():
    """The broker thread's selector listed the closed socket's number; the new connection's
    socket got the same number, and was never registered with epoll: the thread slept
    through RabbitMQ's deliveries (the chaos suite's stalled workers). Each connection's
    sockets are registered afresh."""
    thread = BrokerThread(lambda received, lost: types.SimpleNamespace(  # type: ignore[arg-type,return-value]
        on_readable=lambda fd: None), lambda c: None, lambda *a: None, lambda *a: None,
        lambda e: None, lambda e: None, lambda: 8, None, True)
    old, old_peer = socket.socketpair()
    number = old.fileno()
    thread._watch({number}, generation=1)
    old.close()                             # the connection is gone; epoll forgets it
    new, new_peer = socket.socketpair()     # the next connection gets the same number
    if new.fileno() != number:
        os.dup2(new.fileno(), number)
        new.close()
        new = socket.socket(fileno=number)
    try:
        thread._watch({number}, generation=2)
        new_peer.send(b"deliver")
        events = thread.loop.wait(2.0)
        assert [key.fd for key, _ in events] == [number], "the new socket is watched"
    finally:
        for s in (new, old_peer, new_peer):
            s.close()
        thread.loop.close()
