"""The SQL behind the SQLite broker: messages with leases, bindings, queues.

A consumed message is leased, not deleted: ``lease`` marks it taken until a deadline with a
fresh token; ``ack`` deletes it and ``release`` hands it back, both only while the token
still matches; an expired lease makes the message available again. Several processes on
one host share the file (WAL mode); each process opens its own connection.

Each message keeps its delivery count (docs/delivery.md): ``lease`` adds one in the same
statement that takes it, so a consumer killed outright has counted already; a clean
hand-back by a live consumer (``release(uncount=True)``, ``forget``) takes it back.

Broker faults: SQLite's errors that are the file's trouble (disk full, read-only, I/O
error, locked too long; ``sqlitedb.FAULTS``) are raised as :class:`BrokerFileError`, which
names the file and says what to do; the transport counts it as a lost connection. It is
said in the log once when it begins and once when writes go through again
(``sqlitedb.troubles``). A write that failed for want of space is followed by a
checkpoint, so the next can start the write-ahead log over in the space it has
(``sqlitedb``); the broker thread checkpoints it too, every half second. A file
deleted or replaced under the same path is noticed (its inode, looked at before every
``put`` and at most once a second otherwise) and the new one opened: messages leased from
the old file are gone with it, so their leases read as held (they run here, once) and
settling them does nothing.
"""
from __future__ import annotations

import logging
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .. import sqlitedb
from . import fenced
from ..forksafe import abandon

log = logging.getLogger("workhorse.broker")

#: Seconds between looks at which file the path names (every put looks).
IDENTITY_CHECK_INTERVAL = 1.0
#: SQLite errors after which the connection is opened again: it may have been opened
#: read-only, or on a file since replaced. (A full disk or a held lock passes by itself.)
_REOPEN_AFTER = frozenset({sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_PERM,
                           sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB})
_PREFIX_LENGTH = 8

SCHEMA_VERSION = 2      # 2: the periodic tasks' fences
_SCHEMA = fenced.SQLITE_SCHEMA + """
CREATE TABLE IF NOT EXISTS messages (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,   -- FIFO order within a priority
    queue       TEXT    NOT NULL,
    priority    INTEGER NOT NULL DEFAULT 0,          -- higher first, as on RabbitMQ
    payload     TEXT    NOT NULL,                    -- kombu's JSON message
    lease_until REAL    NOT NULL DEFAULT 0,          -- epoch seconds; <= now: available
    lease_token TEXT,
    deliveries  INTEGER NOT NULL DEFAULT 0,          -- times leased, less clean hand-backs
    created_at  REAL    NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_fetch ON messages (queue, priority DESC, id);
CREATE TABLE IF NOT EXISTS bindings (
    exchange    TEXT NOT NULL,
    routing_key TEXT NOT NULL,
    pattern     TEXT NOT NULL,
    queue       TEXT NOT NULL,
    PRIMARY KEY (exchange, routing_key, pattern, queue)
);
CREATE TABLE IF NOT EXISTS queues (name TEXT PRIMARY KEY);
"""

Lease = tuple[int, str]   # (message id, lease token)


def parse_tag(delivery_tag: str) -> Lease:
    """Delivery tags are ``"<id>:<token>"``: unique per lease, never reused."""
    ident, _, token = str(delivery_tag).partition(":")
    return int(ident), token


class StoreBusy(Exception):
    """A take that must not wait (``lease_many(wait=False)``) could not be done at once:
    another thread of this process uses the file, another process holds its write lock,
    or SQLite failed. Nothing was changed: the same take, done by a thread that may wait,
    meets whatever it was and deals with it."""


class BrokerFileError(ConnectionError):
    """The broker's SQLite file cannot be used now: disk full, read-only, an I/O error, its
    write lock held too long. kombu counts it as a lost connection: a worker reconnects
    with back-off, a producer retries a few times and then raises it (as kombu's
    ``OperationalError``, with this message)."""

    #: Said in the log already (``sqlitedb.troubles``): callers that report it say it quietly.
    said = False

    def __init__(self, path: Path, cause: BaseException) -> None:
        super().__init__(f"SQLite broker {sqlitedb.describe(path, cause)}")
        self.path = path
        self.cause = cause


@dataclass
class _Opened:
    """One opening of the broker file, in one process."""

    conn: sqlite3.Connection
    pid: int
    identity: tuple[int, int] | None      # (device, inode) the path named when opened
    prefix: str                           # starts the token of every lease taken through it
    checked: float                        # monotonic time of the last look at the path


class Store:
    def __init__(self, path: Path) -> None:
        # Absolute: the path is looked at again later, maybe from another directory.
        self.path = path.absolute()
        self._opened: _Opened | None = None
        #: Token prefixes of openings whose file was deleted or replaced.
        self._gone: set[str] = set()
        self._lock = threading.RLock()
        #: Does the connection wait for a write lock held elsewhere (busy_timeout), and do
        #: its commits checkpoint the write-ahead log? Neither after a call that must not
        #: wait (``_at_once``) turned them off, until a ``_session`` turns them on again:
        #: the loop thread's takes, one after another, set them once, not each take.
        self._waits: bool | None = None
        #: Called with the token prefix of each opening, before any lease carries it (the
        #: worker's journal: its leases are known by it after a death).
        self.on_open: Callable[[str], None] | None = None

    @contextmanager
    def _session(self, *, check: bool = False) -> Iterator[sqlite3.Connection]:
        """The connection, under the lock; the file's troubles raised as BrokerFileError.
        ``check``: look at which file the path names now, whenever it was looked at last."""
        with self._lock:
            conn = None
            try:
                conn = self._connection(check)
                if self._waits is False:    # after a call that must not wait
                    conn.execute(f"PRAGMA busy_timeout = {int(sqlitedb.BUSY_TIMEOUT * 1000)}")
                    sqlitedb.autocheckpoint(conn, True)
                    self._waits = True
                # While the file is in trouble, a write that changes a row ends it.
                changes = conn.total_changes if sqlitedb.troubles.troubled(self.path) else -1
                yield conn
                if changes >= 0 and conn.total_changes != changes:
                    sqlitedb.troubles.written(self.path)
            except (sqlite3.Error, OSError) as exc:
                if isinstance(exc, BrokerFileError) or not sqlitedb.is_fault(exc):
                    raise
                raise self._trouble(exc, conn) from exc

    def _trouble(self, exc: sqlite3.Error | OSError,
                 conn: sqlite3.Connection | None) -> BrokerFileError:
        """The file's trouble ``exc``, said once, as the error to raise. A connection that
        may have been opened wrong is opened again; after a write failed for want of space,
        the log is checkpointed so that the next write can start it over in the space it
        has, instead of needing more (nothing else would: SQLite checkpoints after a
        commit)."""
        sqlitedb.troubles.began(self.path, "SQLite broker", exc)
        code = (exc.sqlite_errorcode or 0) & 0xFF if isinstance(exc, sqlite3.Error) else None
        if code in _REOPEN_AFTER:
            self.close()
        elif code == sqlite3.SQLITE_FULL and conn is not None:
            sqlitedb.checkpoint(conn, self.path)
        error = BrokerFileError(self.path, exc)
        error.said = True
        return error

    @contextmanager
    def _at_once(self) -> Iterator[sqlite3.Connection]:
        """The connection for a call that must not wait (the supervisor's loop thread takes
        through it): the lock only if it is free, and SQLite's busy handler off, so a write
        lock held elsewhere fails at once instead of waiting up to BUSY_TIMEOUT. Any
        error is StoreBusy and leaves the connection as it was: a file not open yet, in
        trouble, or replaced is the waiting path's to open, name, reopen and report
        (``_session``), since opening may wait."""
        if not self._lock.acquire(blocking=False):
            raise StoreBusy("another thread is using the broker file")
        try:
            opened = self._opened
            if opened is None or opened.pid != os.getpid():
                raise StoreBusy("the broker file is not open in this process yet")
            try:
                if time.monotonic() - opened.checked >= IDENTITY_CHECK_INTERVAL:
                    if sqlitedb.identity(self.path) != opened.identity:
                        raise StoreBusy("the broker file was deleted or replaced")
                    opened.checked = time.monotonic()
                conn = opened.conn
                if self._waits is not False:    # (set back by the next _session)
                    conn.execute("PRAGMA busy_timeout = 0")
                    # A checkpoint waits on the disk (fsync): the broker thread's are enough.
                    sqlitedb.autocheckpoint(conn, False)
                    self._waits = False
            except (sqlite3.Error, OSError) as exc:
                raise StoreBusy(f"SQLite broker {sqlitedb.describe(self.path, exc)}") from exc
            changes = conn.total_changes if sqlitedb.troubles.troubled(self.path) else -1
            try:
                yield conn
                if changes >= 0 and conn.total_changes != changes:
                    sqlitedb.troubles.written(self.path)
            except (sqlite3.Error, OSError) as exc:
                raise StoreBusy(f"SQLite broker {sqlitedb.describe(self.path, exc)}") from exc
        finally:
            self._lock.release()

    def _connection(self, check: bool) -> sqlite3.Connection:
        opened = self._opened
        # Never use, or close, a sqlite3 connection across fork(): each process opens its
        # own (see workhorse.forksafe).
        if opened is None or opened.pid != os.getpid():
            if opened is not None:
                abandon(opened.conn)   # inherited across fork: never close it here
                self._opened = None
            opened = self._opened = self._open()
        elif check or time.monotonic() - opened.checked >= IDENTITY_CHECK_INTERVAL:
            opened.checked = time.monotonic()
            now = sqlitedb.identity(self.path)
            if now != opened.identity:
                self._reopen(opened, now)
                opened = self._opened = self._open()
        return opened.conn

    def _open(self) -> _Opened:
        # The inode is read before and after opening: one replaced in between is opened again.
        for _ in range(3):
            before = sqlitedb.identity(self.path)
            conn = sqlitedb.connect(self.path, _SCHEMA, SCHEMA_VERSION)
            after = sqlitedb.identity(self.path)
            if before is None or before == after:
                break
            conn.close()
        self._waits = True      # a new connection waits (sqlitedb.connect)
        prefix = secrets.token_hex(_PREFIX_LENGTH // 2)
        if self.on_open is not None:
            self.on_open(prefix)
        return _Opened(conn, os.getpid(), after, prefix, time.monotonic())

    def _reopen(self, opened: _Opened, now: tuple[int, int] | None) -> None:
        """The path names another file, or none: leave the old one (closing it: SQLite
        leaves the -wal and -shm at the path alone for a file that moved)."""
        log.warning("SQLite broker %s was %s while open: opening the file now at that path. "
                    "Messages this process holds from the old file are gone with it: they "
                    "run here as they are, nothing is left to settle them against, and any "
                    "not yet started when the worker stops are lost", self.path,
                    "deleted" if now is None else "replaced")
        self._gone.add(opened.prefix)
        self._opened = None
        opened.conn.close()

    @property
    def prefix(self) -> str | None:
        """The token prefix of this process's opening of the file (None: not open)."""
        opened = self._opened
        return opened.prefix if opened is not None and opened.pid == os.getpid() else None

    def _gone_with_old_file(self, lease: Lease) -> bool:
        return lease[1][:_PREFIX_LENGTH] in self._gone

    def check(self) -> None:
        """Open the file if it is not open, and look at which file the path names; raises
        BrokerFileError if it cannot be opened."""
        with self._session(check=True):
            pass

    def checkpoint(self) -> bool:
        """Copy the write-ahead log into the file as far as no reader needs it, never
        waiting (``sqlitedb.checkpoint``); the broker thread's housekeeping. True if all
        of it was copied."""
        with self._session() as conn:
            return sqlitedb.checkpoint(conn, self.path)

    def close(self) -> None:
        with self._lock:
            opened, self._opened = self._opened, None
            if opened is not None and opened.pid == os.getpid():
                opened.conn.close()

    # -- messages
    def put(self, queue: str, payload: str, priority: int = 0) -> int:
        # Looks at the path first: a message put into a file deleted meanwhile is lost.
        with self._session(check=True) as conn:
            cur = conn.execute(
                "INSERT INTO messages (queue, priority, payload, created_at) VALUES (?, ?, ?, ?)",
                (queue, priority, payload, time.time()))
            return int(cur.lastrowid or 0)

    def put_fenced(self, queue: str, payload: str, priority: int,
                   ticket: fenced.Ticket) -> None:
        """Put the message only if the ticket's fence moves, in one transaction with it;
        raise FenceClosed if another worker's record holds it."""
        with self._session(check=True) as conn, sqlitedb.immediate(conn):
            put, holder = fenced.sqlite_move(conn, ticket)
            if not put:
                raise fenced.FenceClosed(ticket, holder)
            if holder is None:
                conn.execute("INSERT INTO messages (queue, priority, payload, created_at) "
                             "VALUES (?, ?, ?, ?)", (queue, priority, payload, time.time()))

    def fence_records(self, names: Iterable[str]) -> dict[str, fenced.Record]:
        with self._session() as conn:
            return fenced.sqlite_records(conn, names)

    def lease(self, queue: str, visibility_timeout: float) -> tuple[int, str, str, int] | None:
        """Take the next available message: (id, token, payload, deliveries) or None."""
        now = time.time()
        with self._session() as conn:
            assert self._opened is not None
            token = self._opened.prefix + secrets.token_hex(8)
            row = conn.execute(
                "UPDATE messages SET lease_until = ?, lease_token = ?, deliveries = deliveries + 1 "
                "WHERE id = (SELECT id FROM messages WHERE queue = ? AND lease_until <= ? "
                "            ORDER BY priority DESC, id LIMIT 1) "
                "RETURNING id, payload, deliveries",
                (now + visibility_timeout, token, queue, now)).fetchone()
        if row is None:
            return None
        return int(row[0]), token, row[1], int(row[2])

    def lease_many(self, queues: list[str], visibility_timeout: float, limit: int,
                   acks: Iterable[Lease] = (), *,
                   wait: bool = True) -> list[tuple[str, int, str, str, int]]:
        """Ack ``acks`` (as ``ack_many``), then take up to ``limit`` available messages,
        from ``queues`` in order (each emptied before the next), in one transaction:
        (queue, id, token, payload, deliveries) each, in the order they are to be
        delivered. ``wait=False``: never wait, for another thread or for SQLite's write
        lock; raise StoreBusy instead, having changed nothing (see ``_at_once``)."""
        now = time.time()
        taken: list[tuple[str, int, str, str, int]] = []
        with self._session() if wait else self._at_once() as conn:
            assert self._opened is not None
            # One random token per batch; the message id makes each lease's its own.
            batch = self._opened.prefix + secrets.token_hex(8) + "."
            live = [lease for lease in acks if not self._gone_with_old_file(lease)]
            with sqlitedb.immediate(conn):
                if live:
                    conn.executemany("DELETE FROM messages WHERE id = ? AND lease_token = ?",
                                     live)
                for queue in queues:
                    if len(taken) >= limit:
                        break
                    rows = conn.execute(
                        "UPDATE messages SET lease_until = ?, lease_token = ? || id, "
                        "deliveries = deliveries + 1 WHERE id IN ("
                        "  SELECT id FROM messages WHERE queue = ? AND lease_until <= ? "
                        "  ORDER BY priority DESC, id LIMIT ?) "
                        "RETURNING id, payload, deliveries, priority",
                        (now + visibility_timeout, batch, queue, now,
                         limit - len(taken))).fetchall()
                    # (RETURNING comes in no particular order: put them back in line.)
                    rows.sort(key=lambda row: (-(row[3] or 0), row[0]))
                    taken += [(queue, int(ident), f"{batch}{ident}", payload, int(deliveries))
                              for ident, payload, deliveries, _ in rows]
        return taken

    def ack(self, lease: Lease) -> bool:
        """Delete the message if this lease still holds it; False if the lease was lost."""
        with self._session() as conn:
            if self._gone_with_old_file(lease):
                return False
            cur = conn.execute("DELETE FROM messages WHERE id = ? AND lease_token = ?", lease)
            return cur.rowcount == 1

    def ack_many(self, leases: Iterable[Lease]) -> int:
        """``ack`` for several leases in one transaction (one commit, not one each);
        returns how many were still held."""
        with self._session() as conn:
            live = [lease for lease in leases if not self._gone_with_old_file(lease)]
            with sqlitedb.immediate(conn):
                cur = conn.executemany("DELETE FROM messages WHERE id = ? AND lease_token = ?",
                                       live)
                return cur.rowcount

    def release(self, leases: Iterable[Lease], *, uncount: bool = False) -> int:
        """Make leased messages available again at once, in their old place in line.

        ``uncount``: a clean hand-back by a live consumer, which takes back the delivery
        its lease counted; without it (a channel closed holding them) they stay counted.
        """
        with self._session() as conn:
            cur = conn.executemany(
                "UPDATE messages SET lease_until = 0, lease_token = NULL, "
                "deliveries = MAX(deliveries - ?, 0) WHERE id = ? AND lease_token = ?",
                [(int(uncount), *lease) for lease in leases
                 if not self._gone_with_old_file(lease)])
            return cur.rowcount

    def recover(self, prefixes: Iterable[str],
                rewrite: Callable[[str, str], tuple[str, bool]]) -> int:
        """Put back at once, in their old places in line, the messages leased with a token
        that starts with one of ``prefixes``: those of a worker that is gone (its journal
        says so). ``rewrite(tag, payload)`` gives each one's payload and whether the
        delivery its lease counted is taken back. One transaction; returns how many."""
        prefixes = [p for p in prefixes if len(p) == _PREFIX_LENGTH]
        if not prefixes:
            return 0
        marks = ", ".join("?" * len(prefixes))
        with self._session() as conn, sqlitedb.immediate(conn):
            rows = conn.execute(
                "SELECT id, lease_token, payload FROM messages WHERE lease_token IS NOT NULL "
                f"AND substr(lease_token, 1, {_PREFIX_LENGTH}) IN ({marks})",
                prefixes).fetchall()
            for ident, token, payload in rows:
                payload, uncount = rewrite(f"{ident}:{token}", payload)
                conn.execute(
                    "UPDATE messages SET lease_until = 0, lease_token = NULL, payload = ?, "
                    "deliveries = MAX(deliveries - ?, 0) WHERE id = ? AND lease_token = ?",
                    (payload, int(uncount), ident, token))
        return len(rows)

    def forget(self, lease: Lease) -> bool:
        """A lease its live consumer lost (not renewed in time): take back the delivery it
        counted, wherever the message is now (waiting, or leased to another consumer).
        A lease still held is left alone. False if there was nothing to take back."""
        with self._session() as conn:
            if self._gone_with_old_file(lease):
                return False
            cur = conn.execute(
                "UPDATE messages SET deliveries = MAX(deliveries - 1, 0) "
                "WHERE id = ? AND lease_token IS NOT ?", lease)
            return cur.rowcount == 1

    def renew(self, leases: Iterable[Lease], visibility_timeout: float) -> set[Lease]:
        """Push the deadline of each lease out; return the leases that still exist. Those
        from a file deleted or replaced count as existing: nothing else can deliver them."""
        leases = list(leases)
        until = time.time() + visibility_timeout
        with self._session() as conn:
            alive = {lease for lease in leases if self._gone_with_old_file(lease)}
            with sqlitedb.immediate(conn):
                for lease in leases:
                    if lease in alive:
                        continue
                    cur = conn.execute("UPDATE messages SET lease_until = ? "
                                       "WHERE id = ? AND lease_token = ?", (until, *lease))
                    if cur.rowcount == 1:
                        alive.add(lease)
        return alive

    def bury(self, lease: Lease, dead_queue: str, payload: str) -> bool:
        """Replace a leased message by ``payload`` at the end of ``dead_queue``, in one
        transaction; False (nothing changed) if the lease was lost."""
        with self._session() as conn:
            if self._gone_with_old_file(lease):
                return False
            with sqlitedb.immediate(conn):
                cur = conn.execute("DELETE FROM messages WHERE id = ? AND lease_token = ?",
                                   lease)
                buried = cur.rowcount == 1
                if buried:
                    conn.execute("INSERT INTO messages (queue, payload, created_at) "
                                 "VALUES (?, ?, ?)", (dead_queue, payload, time.time()))
                    conn.execute("INSERT OR IGNORE INTO queues (name) VALUES (?)",
                                 (dead_queue,))
        return buried

    def remove(self, queue: str, ident: int) -> bool:
        """Delete a message that nobody holds (see ``browse``); False if it is leased or gone."""
        with self._session() as conn:
            cur = conn.execute("DELETE FROM messages WHERE id = ? AND queue = ? AND "
                               "lease_until <= ?", (ident, queue, time.time()))
            return cur.rowcount == 1

    def size(self, queue: str) -> int:
        """Messages available now (not leased)."""
        with self._session() as conn:
            return int(conn.execute(
                "SELECT count(*) FROM messages WHERE queue = ? AND lease_until <= ?",
                (queue, time.time())).fetchone()[0])

    def backlog(self, queue: str) -> tuple[int, float | None]:
        """Messages available now, and when the oldest of them was put (epoch seconds)."""
        with self._session() as conn:
            count, oldest = conn.execute(
                "SELECT count(*), min(created_at) FROM messages WHERE queue = ? AND "
                "lease_until <= ?", (queue, time.time())).fetchone()
            return int(count), oldest

    def purge(self, queue: str) -> int:
        """Delete the available messages; leased ones stay with their consumers (as in AMQP)."""
        with self._session() as conn:
            cur = conn.execute("DELETE FROM messages WHERE queue = ? AND lease_until <= ?",
                               (queue, time.time()))
            return cur.rowcount

    def browse(self, queue: str, limit: int = 100) -> list[tuple[int, str, int, bool]]:
        """Look without leasing: (id, payload, deliveries, leased now) in delivery order."""
        with self._session() as conn:
            rows = conn.execute(
                "SELECT id, payload, deliveries, lease_until > ? FROM messages WHERE queue = ? "
                "ORDER BY priority DESC, id LIMIT ?", (time.time(), queue, limit)).fetchall()
        return [(int(i), p, int(d), bool(leased)) for i, p, d, leased in rows]

    # -- queues and bindings
    def declare_queue(self, queue: str) -> None:
        with self._session() as conn:
            conn.execute("INSERT OR IGNORE INTO queues (name) VALUES (?)", (queue,))

    def has_queue(self, queue: str) -> bool:
        with self._session() as conn:
            return bool(conn.execute("SELECT 1 FROM queues WHERE name = ?", (queue,)).fetchone()
                        or conn.execute("SELECT 1 FROM messages WHERE queue = ? LIMIT 1",
                                        (queue,)).fetchone())

    def delete_queue(self, queue: str) -> None:
        with self._session() as conn, sqlitedb.immediate(conn):
            conn.execute("DELETE FROM messages WHERE queue = ?", (queue,))
            conn.execute("DELETE FROM bindings WHERE queue = ?", (queue,))
            conn.execute("DELETE FROM queues WHERE name = ?", (queue,))

    def bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        with self._session() as conn:
            conn.execute("INSERT OR IGNORE INTO bindings VALUES (?, ?, ?, ?)",
                         (exchange, routing_key or "", pattern or "", queue))

    def bindings(self, exchange: str) -> list[tuple[str, str, str]]:
        with self._session() as conn:
            return [tuple(r) for r in conn.execute(
                "SELECT routing_key, pattern, queue FROM bindings WHERE exchange = ?",
                (exchange,)).fetchall()]
