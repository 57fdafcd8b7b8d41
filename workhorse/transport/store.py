"""The SQL behind the SQLite broker: messages with leases, bindings, queues.

A consumed message is leased, not deleted: ``lease`` marks it taken until a deadline with a
fresh token; ``ack`` deletes it and ``release`` hands it back, both only while the token
still matches; an expired lease makes the message available again. Several processes on
one host share the file (WAL mode); each process opens its own connection.

Each message keeps its delivery count (SEMANTICS.md): ``lease`` adds one in the same
statement that takes it, so a consumer killed outright has counted already; a clean
hand-back by a live consumer (``release(uncount=True)``, ``forget``) takes it back.
"""
from __future__ import annotations

import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from .. import sqlitedb
from ..forksafe import abandon

SCHEMA_VERSION = 1
_SCHEMA = """
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


class Store:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._conn: sqlite3.Connection | None = None
        self._pid = 0
        self._lock = threading.RLock()

    @property
    def conn(self) -> sqlite3.Connection:
        # Never use, or close, a sqlite3 connection across fork(): each process opens its
        # own (see workhorse.forksafe).
        if self._conn is None or self._pid != os.getpid():
            abandon(self._conn)   # inherited across fork: never close it here
            conn = sqlitedb.connect(self.path, _SCHEMA, SCHEMA_VERSION)
            self._conn, self._pid = conn, os.getpid()
        return self._conn

    def close(self) -> None:
        if self._conn is not None and self._pid == os.getpid():
            self._conn.close()
        self._conn = None

    # -- messages
    def put(self, queue: str, payload: str, priority: int = 0) -> int:
        with self._lock:
            cur = self.conn.execute(
                "INSERT INTO messages (queue, priority, payload, created_at) VALUES (?, ?, ?, ?)",
                (queue, priority, payload, time.time()))
            return int(cur.lastrowid or 0)

    def lease(self, queue: str, visibility_timeout: float) -> tuple[int, str, str, int] | None:
        """Take the next available message: (id, token, payload, deliveries) or None."""
        now = time.time()
        token = secrets.token_hex(8)
        with self._lock:
            row = self.conn.execute(
                "UPDATE messages SET lease_until = ?, lease_token = ?, deliveries = deliveries + 1 "
                "WHERE id = (SELECT id FROM messages WHERE queue = ? AND lease_until <= ? "
                "            ORDER BY priority DESC, id LIMIT 1) "
                "RETURNING id, payload, deliveries",
                (now + visibility_timeout, token, queue, now)).fetchone()
        if row is None:
            return None
        return int(row[0]), token, row[1], int(row[2])

    def ack(self, lease: Lease) -> bool:
        """Delete the message if this lease still holds it; False if the lease was lost."""
        with self._lock:
            cur = self.conn.execute("DELETE FROM messages WHERE id = ? AND lease_token = ?", lease)
            return cur.rowcount == 1

    def release(self, leases: Iterable[Lease], *, uncount: bool = False) -> int:
        """Make leased messages available again at once, in their old place in line.

        ``uncount``: a clean hand-back by a live consumer, which takes back the delivery
        its lease counted; without it (a channel closed holding them) they stay counted.
        """
        with self._lock:
            cur = self.conn.executemany(
                "UPDATE messages SET lease_until = 0, lease_token = NULL, "
                "deliveries = MAX(deliveries - ?, 0) WHERE id = ? AND lease_token = ?",
                [(int(uncount), *lease) for lease in leases])
            return cur.rowcount

    def forget(self, lease: Lease) -> bool:
        """A lease its live consumer lost (not renewed in time): take back the delivery it
        counted, wherever the message is now (waiting, or leased to another consumer).
        A lease still held is left alone. False if there was nothing to take back."""
        with self._lock:
            cur = self.conn.execute(
                "UPDATE messages SET deliveries = MAX(deliveries - 1, 0) "
                "WHERE id = ? AND lease_token IS NOT ?", lease)
            return cur.rowcount == 1

    def renew(self, leases: Iterable[Lease], visibility_timeout: float) -> set[Lease]:
        """Push the deadline of each lease out; return the leases that still exist."""
        leases = list(leases)
        until = time.time() + visibility_timeout
        alive: set[Lease] = set()
        with self._lock:
            conn = self.conn
            conn.execute("BEGIN IMMEDIATE")
            try:
                for lease in leases:
                    cur = conn.execute("UPDATE messages SET lease_until = ? "
                                       "WHERE id = ? AND lease_token = ?", (until, *lease))
                    if cur.rowcount == 1:
                        alive.add(lease)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        return alive

    def bury(self, lease: Lease, dead_queue: str, payload: str) -> bool:
        """Replace a leased message by ``payload`` at the end of ``dead_queue``, in one
        transaction; False (nothing changed) if the lease was lost."""
        with self._lock:
            conn = self.conn
            conn.execute("BEGIN IMMEDIATE")
            try:
                cur = conn.execute("DELETE FROM messages WHERE id = ? AND lease_token = ?",
                                   lease)
                if cur.rowcount == 1:
                    conn.execute("INSERT INTO messages (queue, payload, created_at) "
                                 "VALUES (?, ?, ?)", (dead_queue, payload, time.time()))
                    conn.execute("INSERT OR IGNORE INTO queues (name) VALUES (?)",
                                 (dead_queue,))
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        return cur.rowcount == 1

    def remove(self, queue: str, ident: int) -> bool:
        """Delete a message that nobody holds (see ``browse``); False if it is leased or gone."""
        with self._lock:
            cur = self.conn.execute("DELETE FROM messages WHERE id = ? AND queue = ? AND "
                                    "lease_until <= ?", (ident, queue, time.time()))
            return cur.rowcount == 1

    def size(self, queue: str) -> int:
        """Messages available now (not leased)."""
        with self._lock:
            return int(self.conn.execute(
                "SELECT count(*) FROM messages WHERE queue = ? AND lease_until <= ?",
                (queue, time.time())).fetchone()[0])

    def purge(self, queue: str) -> int:
        """Delete the available messages; leased ones stay with their consumers (as in AMQP)."""
        with self._lock:
            cur = self.conn.execute("DELETE FROM messages WHERE queue = ? AND lease_until <= ?",
                                    (queue, time.time()))
            return cur.rowcount

    def browse(self, queue: str, limit: int = 100) -> list[tuple[int, str, int, bool]]:
        """Look without leasing: (id, payload, deliveries, leased now) in delivery order."""
        with self._lock:
            rows = self.conn.execute(
                "SELECT id, payload, deliveries, lease_until > ? FROM messages WHERE queue = ? "
                "ORDER BY priority DESC, id LIMIT ?", (time.time(), queue, limit)).fetchall()
        return [(int(i), p, int(d), bool(leased)) for i, p, d, leased in rows]

    # -- queues and bindings
    def declare_queue(self, queue: str) -> None:
        with self._lock:
            self.conn.execute("INSERT OR IGNORE INTO queues (name) VALUES (?)", (queue,))

    def has_queue(self, queue: str) -> bool:
        with self._lock:
            conn = self.conn
            return bool(conn.execute("SELECT 1 FROM queues WHERE name = ?", (queue,)).fetchone()
                        or conn.execute("SELECT 1 FROM messages WHERE queue = ? LIMIT 1",
                                        (queue,)).fetchone())

    def delete_queue(self, queue: str) -> None:
        with self._lock:
            conn = self.conn
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("DELETE FROM messages WHERE queue = ?", (queue,))
            conn.execute("DELETE FROM bindings WHERE queue = ?", (queue,))
            conn.execute("DELETE FROM queues WHERE name = ?", (queue,))
            conn.execute("COMMIT")

    def bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        with self._lock:
            self.conn.execute("INSERT OR IGNORE INTO bindings VALUES (?, ?, ?, ?)",
                              (exchange, routing_key or "", pattern or "", queue))

    def bindings(self, exchange: str) -> list[tuple[str, str, str]]:
        with self._lock:
            return [tuple(r) for r in self.conn.execute(
                "SELECT routing_key, pattern, queue FROM bindings WHERE exchange = ?",
                (exchange,)).fetchall()]
