"""The write-ahead log of the SQLite broker and result files: it stays small, checkpoints never
wait for a reader, the loop thread's takes leave checkpoints to the broker thread, opening a
file already set up writes nothing, and a file's trouble is said once."""
from __future__ import annotations

import hashlib
import logging
import sqlite3
import time
from pathlib import Path

import pytest

from workhorse import sqlitedb
from workhorse.transport import store as store_module
from workhorse.transport.store import BrokerFileError, Store

#: A message the size of a small task's.
PAYLOAD = "x" * 1000


def cycle(store: Store, count: int) -> float:
    """``count`` messages put, taken and acked, one by one; the slowest round, in seconds
    (each one raises what fails)."""
    slowest = 0.0
    for _ in range(count):
        started = time.monotonic()
        store.put("q", PAYLOAD)
        taken = store.lease_many(["q"], 60, 1)
        store.ack_many([(ident, token) for _, ident, token, _, _ in taken])
        slowest = max(slowest, time.monotonic() - started)
    return slowest


@pytest.mark.timeout(60)
def test_the_write_ahead_log_stays_under_its_limit_as_messages_come_and_go(tmp_path):
    path = tmp_path / "broker.sqlite3"
    store = Store(path)
    peak = 0
    for _ in range(30):         # some 60 MB through the log: SQLite's default grows it to 4 MB
        cycle(store, 100)
        peak = max(peak, sqlitedb.wal_size(path))
    assert 0 < peak <= sqlitedb.WAL_SIZE_LIMIT


@pytest.mark.timeout(60)
def test_a_reader_holding_a_snapshot_delays_no_write_and_the_log_shrinks_once_it_lets_go(
        tmp_path):
    path = tmp_path / "broker.sqlite3"
    store = Store(path)
    store.put("q", PAYLOAD)
    reader = sqlite3.connect(path, isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM messages").fetchone()    # holds its snapshot
    slowest = cycle(store, 1500)
    # Nothing can copy what the reader may still read: the log grows meanwhile...
    assert sqlitedb.wal_size(path) > sqlitedb.WAL_SIZE_LIMIT
    # ...but no write waited for it (a checkpoint that waited would for BUSY_TIMEOUT).
    assert slowest < sqlitedb.BUSY_TIMEOUT / 4
    reader.execute("COMMIT")
    reader.close()
    assert store.checkpoint()           # all copied, now that nobody reads it
    cycle(store, 1)                    # starts the log over, cut back to its limit
    assert sqlitedb.wal_size(path) <= sqlitedb.WAL_SIZE_LIMIT


def test_the_loop_threads_takes_leave_checkpoints_to_the_broker_thread(tmp_path):
    store = Store(tmp_path / "broker.sqlite3")
    store.put("q", PAYLOAD)
    autocheckpoint = "PRAGMA wal_autocheckpoint"
    with store._session() as conn:
        assert conn.execute(autocheckpoint).fetchone()[0] > 0
    assert store.lease_many(["q"], 60, 1, wait=False)       # the loop thread's take
    assert store._opened is not None
    assert store._opened.conn.execute(autocheckpoint).fetchone()[0] == 0   # a checkpoint fsyncs
    with store._session() as conn:                          # the broker thread's call
        assert conn.execute(autocheckpoint).fetchone()[0] > 0


@pytest.mark.parametrize("what", ["broker", "results"])
def test_opening_a_file_already_set_up_writes_nothing(tmp_path, what):
    """So opening one on a full disk needs no space."""
    path = tmp_path / f"{what}.sqlite3"
    schema, version = ((store_module._SCHEMA, store_module.SCHEMA_VERSION) if what == "broker"
                       else (_results_schema()))
    sqlitedb.connect(path, schema, version).close()     # made, set up, closed: no log left
    assert sqlitedb.wal_size(path) == 0
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    conn = sqlitedb.connect(path, schema, version)
    assert conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] > 0
    assert sqlitedb.wal_size(path) == 0                 # not one frame
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
    conn.close()


def _results_schema() -> tuple[str, int]:
    from workhorse.backends import sqlite as results
    return results._SCHEMA, results.SCHEMA_VERSION


# -- a file's trouble, said once
@pytest.fixture
def troubles(monkeypatch: pytest.MonkeyPatch) -> sqlitedb.Troubles:
    troubles = sqlitedb.Troubles()
    monkeypatch.setattr(sqlitedb, "troubles", troubles)
    return troubles


def _full(message: str = "database or disk is full") -> sqlite3.OperationalError:
    exc = sqlite3.OperationalError(message)
    exc.sqlite_errorcode = sqlite3.SQLITE_FULL
    exc.sqlite_errorname = "SQLITE_FULL"
    return exc


def test_a_trouble_is_said_when_it_begins_and_when_a_write_goes_through_after_it_settles(
        troubles, caplog, monkeypatch):
    path = Path("/var/lib/workhorse/broker.sqlite3")
    clock = [100.0]
    monkeypatch.setattr(sqlitedb.time, "monotonic", lambda: clock[0])
    with caplog.at_level(logging.INFO, logger="workhorse.sqlite"):
        for _ in range(167):
            troubles.began(path, "SQLite broker", _full())
            clock[0] += 1.5
        troubles.written(path)          # a write between failures ends nothing...
        troubles.began(path, "SQLite broker", _full())
        clock[0] += troubles.SETTLE - 0.1
        troubles.written(path)
        assert troubles.troubled(path)
        assert troubles.now() == [f"SQLite broker {path}: database or disk is full "
                                  "(SQLITE_FULL); free space on its disk"]
        clock[0] += 0.1
        troubles.written(path)          # ...one SETTLE seconds after the last failure does
    assert not troubles.troubled(path) and troubles.now() == []
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.ERROR, f"SQLite broker {path}: database or disk is full (SQLITE_FULL); free "
                        "space on its disk. Calls that need it fail and are retried with "
                        "back-off meanwhile; this is said again only once it is written again"),
        (logging.INFO, f"SQLite broker {path} is written again, after 252.5 s of trouble "
                       "(SQLITE_FULL)"),
    ]


def test_an_error_said_already_is_known_through_what_wraps_it():
    from kombu.exceptions import OperationalError
    error = BrokerFileError(Path("/b.sqlite3"), _full())
    assert not sqlitedb.said(error)
    error.said = True
    try:
        try:
            raise error
        except BrokerFileError as exc:
            raise OperationalError(str(exc)) from exc     # as kombu's producer raises it
    except OperationalError as wrapped:
        assert sqlitedb.said(wrapped)
    assert not sqlitedb.said(OperationalError("unrelated"))


@pytest.mark.timeout(30)
def test_the_workers_status_carries_a_broker_files_trouble_while_it_lasts(
        tmp_path, troubles, monkeypatch):
    from .test_systemd import NotifySocket
    from .test_take_here import SqliteLink
    notify = NotifySocket(tmp_path)
    monkeypatch.setenv("NOTIFY_SOCKET", notify.address)
    it = SqliteLink(tmp_path)
    it.publish(0)
    it.link.start()
    it.loop.every(1.0, it.link.say_troubles)       # as the supervisor's timer does
    try:
        it.turn_until(lambda: notify.got("STATUS=consuming q"), "consuming, in STATUS")
        troubles.began(it.path, "SQLite broker", _full())     # as the broker thread meets it
        full = f"STATUS=consuming q; SQLite broker {it.path}: database or disk is full"
        it.turn_until(lambda: notify.got(full), "the full disk, in STATUS")
        troubles.SETTLE = 0.0
        troubles.written(it.path)
        notify.received.clear()
        it.turn_until(lambda: notify.got("STATUS=consuming q"), "the full disk gone from STATUS")
        assert notify.received[-1] == "STATUS=consuming q"
    finally:
        it.link.close(5)
        notify.close()
