"""On SQLite the loop thread acks and takes itself, while the broker thread is parked, and
never waits doing so: a take that would wait (the file's write lock held by another
process, the store in use by another thread, anything wrong with the file) changes
nothing and is handed to the broker thread, which may wait (BrokerLink._take_here)."""
from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import workhorse  # noqa: F401 - registers the sqlite:// transport
from workhorse.broker import thread as broker_thread
from workhorse.broker.drivers import sqlite as sqlite_driver
from workhorse.protocol import dead_letter_queue
from workhorse.transport.store import Store, StoreBusy

from .links import LinkHarness

pytestmark = [pytest.mark.timeout(60), pytest.mark.broker("sqlite")]

#: Far below SQLite's busy timeout (10 s): a call that took this long waited for a lock.
AT_ONCE = 2.0


@contextmanager
def write_lock(path: Path) -> Iterator[sqlite3.Connection]:
    """Another process's view of the file: its write lock held, as a publisher's
    transaction holds it."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    finally:
        conn.execute("ROLLBACK")
        conn.close()


def _store_with(tmp_path: Path, count: int) -> tuple[Store, Path]:
    path = tmp_path / "broker.sqlite3"
    store = Store(path)
    for n in range(count):
        store.put("q", f'{{"n": {n}}}')
    return store, path


def test_a_take_that_must_not_wait_fails_at_once_on_a_held_write_lock_and_changes_nothing(
        tmp_path):
    store, path = _store_with(tmp_path, 3)
    held = store.lease_many(["q"], 60, 1)
    acks = [(ident, token) for _, ident, token, _, _ in held]
    with write_lock(path):
        started = time.monotonic()
        with pytest.raises(StoreBusy, match="locked"):
            store.lease_many(["q"], 60, 5, acks, wait=False)
        assert time.monotonic() - started < AT_ONCE
    assert store.size("q") == 2 and len(store.browse("q")) == 3   # none taken or acked
    taken = store.lease_many(["q"], 60, 5, acks, wait=False)     # the lock is free: done
    assert len(taken) == 2 and store.ack_many([(i, t) for _, i, t, _, _ in taken]) == 2
    assert store.size("q") == 0 and not store.browse("q")


def test_after_a_take_that_must_not_wait_the_others_wait_for_the_lock_again(tmp_path):
    store, path = _store_with(tmp_path, 2)
    assert store.lease_many(["q"], 60, 1, wait=False)
    released = threading.Event()

    def hold_then_release() -> None:
        with write_lock(path):
            ready.set()
            time.sleep(0.3)       # the lock held a while, as a long publish holds it
        released.set()
    ready = threading.Event()
    threading.Thread(target=hold_then_release).start()
    assert ready.wait(5)
    assert len(store.lease_many(["q"], 60, 1)) == 1      # waited for it, did not fail
    assert released.is_set()


def test_a_take_that_must_not_wait_fails_at_once_while_another_thread_uses_the_store(
        tmp_path):
    store, _ = _store_with(tmp_path, 1)
    store.check()
    inside, leave = threading.Event(), threading.Event()

    def use() -> None:
        with store._session():
            inside.set()
            leave.wait(10)
    user = threading.Thread(target=use)
    user.start()
    try:
        assert inside.wait(5)
        with pytest.raises(StoreBusy, match="another thread"):
            store.lease_many(["q"], 60, 1, wait=False)
    finally:
        leave.set()
        user.join(5)
    assert len(store.lease_many(["q"], 60, 1, wait=False)) == 1


class SqliteLink(LinkHarness):
    """The harness on a SQLite file, queue "q"."""

    def __init__(self, tmp_path: Path) -> None:
        self.path = tmp_path / "broker.sqlite3"
        super().__init__(f"sqlite:///{self.path}", "q")

    def rows(self) -> int:
        """Messages in the queue, held (leased) or not: what is not acked."""
        return len(Store(self.path).browse("q"))


    def start(self) -> None:
        """The broker thread started, connected, and parked: a take the loop asks for
        next is made on the loop (a publish made after this wakes the broker thread, which
        may then be under way when the loop takes; the tests that must take on the loop
        publish before)."""
        super().start()
        self.turn_until(self.parked, "the broker thread to park")


@pytest.fixture
def unstarted_sqlite_link(tmp_path: Path,
                          monkeypatch: pytest.MonkeyPatch) -> Iterator[SqliteLink]:
    # These tests take on the loop thread, which it does only while the broker thread is
    # parked: its checkpoints, every half second, would now and then be under way.
    monkeypatch.setattr(sqlite_driver, "CHECKPOINT_INTERVAL", 3600.0)
    it = SqliteLink(tmp_path)
    it.publish(0)                      # the file and the queue exist before it connects
    try:
        yield it
    finally:
        it.link.close(5)


@pytest.fixture
def sqlite_link(unstarted_sqlite_link: SqliteLink) -> SqliteLink:
    unstarted_sqlite_link.start()
    return unstarted_sqlite_link


def test_on_sqlite_the_loop_acks_and_takes_itself_without_the_broker_thread(
        unstarted_sqlite_link):
    it = unstarted_sqlite_link
    it.publish(10)
    it.start()
    assert it.link.room_read_before_wait    # (the supervisor's settles say it a turn later)
    it.link.set_room(8)
    assert it.received == []                # the turn goes on: its jobs come first
    it.loop.wait(0)
    assert len(it.received) == 8            # taken on this thread, before the loop waited
    assert it.link.thread.fetches_done == 0 and it.link._fetches == 0
    for message in it.received[:5]:
        it.link.ack(message)
    it.link.received = 8
    it.link.set_room(5)                     # five places free: the acks go with the take
    it.loop.wait(0)
    assert len(it.received) == 10 and it.rows() == 5
    assert all(m.acknowledged for m in it.received[:5])
    for message in it.received[5:]:
        it.link.ack(message)
    it.link.flush()                         # acks alone, here too
    assert it.rows() == 0 and it.link.thread.fetches_done == 0


def test_an_ack_at_start_goes_alone_unless_the_room_asks_for_a_take(
        unstarted_sqlite_link, monkeypatch):
    """Acks at start (acks_late = false) come one a task, each freeing no room of its own
    beyond its task's, with the place the task before freed: the ack goes alone, and the
    room is taken once it is worth a take (``batch``), or at once when a child starves."""
    it = unstarted_sqlite_link
    # The room stays free for a while here: the broker thread's idle turns and safety
    # polls, which would take it themselves on a slow run, are put off.
    monkeypatch.setattr(broker_thread, "IDLE_TURN", 3600.0)
    monkeypatch.setattr(sqlite_driver, "SAFETY_POLL", 3600.0)
    it.publish(20)
    it.start()
    it.link.set_room(8)
    it.loop.wait(0)
    assert len(it.received) == 8 and it.rows() == 20
    assert it.link.batch == 6
    acked: list[BaseException | None] = []
    it.link.received = 8
    for n, free in enumerate(range(1, it.link.batch)):      # 1 to 5 places: acks alone
        it.link.ack_then(it.received[n], acked.append)
        it.link.set_room(free, starved=False)
        it.loop.wait(0)
        assert it.rows() == 19 - n and len(it.received) == 8, free
    it.turn_until(lambda: len(acked) == 5, "the acks' callbacks")
    assert acked == [None] * 5
    it.link.ack_then(it.received[5], acked.append)         # 6 places: taken with the ack
    it.link.set_room(6, starved=False)
    it.loop.wait(0)
    assert it.rows() == 14 and len(it.received) == 14
    it.link.received = 14
    it.link.ack_then(it.received[6], acked.append)         # a child starves: taken at once
    it.link.set_room(1, starved=True)
    it.loop.wait(0)
    assert it.rows() == 13 and len(it.received) == 15
    it.turn_until(lambda: len(acked) == 7, "the acks' callbacks")
    assert acked == [None] * 7 and it.link.thread.fetches_done == 0
    it.link.received = 15
    for message in it.received[7:13]:       # late acks, a batch of them: they carry a take
        it.link.ack(message)
    it.link.set_room(2, starved=False)
    it.loop.wait(0)
    assert it.rows() == 7 and len(it.received) == 17


def test_the_loop_never_waits_for_a_write_lock_another_process_holds(sqlite_link):
    """The fault: a publisher (another process) holds the file's write lock for a while.
    The loop's take does not wait for it: the fetch goes to the broker thread, which does,
    and the messages arrive once the lock is released."""
    it = sqlite_link
    it.publish(3)
    message_held = []
    it.link.set_room(1)
    # (set-up: one message held and acked; on a loaded machine the take may go to the
    # broker thread instead of this turn)
    it.turn_until(lambda: len(it.received) == 1
                  and it.link.thread.fetches_done == it.link._fetches, "the first message")
    fetches = it.link._fetches
    message_held += it.received
    it.link.ack(message_held[0])
    with write_lock(it.path):
        started = time.monotonic()
        it.link.received = 1
        it.link.set_room(8)
        it.loop.wait(0)
        assert time.monotonic() - started < AT_ONCE
        assert len(it.received) == 1 and it.link._fetches == fetches + 1   # handed over
    # (The broker thread's safety poll may take them before it carries out the fetch
    # handed to it, which then finds nothing: both happen, in either order.)
    it.turn_until(lambda: len(it.received) == 3
                  and it.link.thread.fetches_done == fetches + 1, "the broker thread's take")
    assert it.rows() == 2 and message_held[0].acknowledged


def test_an_unreadable_entry_taken_on_the_loop_is_buried_by_the_broker_thread(
        unstarted_sqlite_link):
    it = unstarted_sqlite_link
    Store(it.path).put("q", "{not json")
    it.publish(1)
    it.start()
    it.link.set_room(8)
    it.loop.wait(0)
    assert len(it.received) == 1            # the readable one; the other waits, leased
    dead = dead_letter_queue("q")
    it.turn_until(lambda: Store(it.path).size(dead) == 1, "the unreadable entry's burial")
    assert it.rows() == 1                   # the readable one, held by us
