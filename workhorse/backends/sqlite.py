"""The embedded default result store: one SQLite file shared by the processes of a host.

Guarantees: a stored result is durable once the call returns (WAL, synchronous=NORMAL:
it survives a process crash; a power loss may take the last moments). Expired results are
invisible at once and deleted by the worker's periodic purge. Waiting polls, starting at
5 ms and backing off to the ``interval`` given to ``get()``.

The file's troubles (disk full, read-only, I/O errors, a write lock held too long:
``sqlitedb.FAULTS``) are raised as :class:`ResultStoreFileError`, naming the file, and
retried with the store's back-off; after one that may have come from how the file was
opened (read-only, unopenable) the next attempt opens it again, and after a full disk the
write-ahead log is checkpointed, so the next write can start it over in the space it has.
Each process says a trouble once when it begins and once when it ends (``sqlitedb.troubles``).
"""
from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from .. import sqlitedb
from ..control.revoked import REVOKES_MAX
from ..forksafe import abandon
from ..transport import fenced
from ..transport.fenced import Record, Ticket
from .base import Backend, ChordCompletion, ChordPart, Claim
from .encoding import loads

# Files made by an older version get the tables they lack when opened (sqlitedb.connect runs
# the script, all IF NOT EXISTS, while user_version is below this): 3 added claims, 4
# revoked.
SCHEMA_VERSION = 5      # 5: the periodic tasks' fences
_SCHEMA = """
CREATE TABLE IF NOT EXISTS task_results (
    task_id    TEXT PRIMARY KEY,
    status     TEXT NOT NULL,
    meta       TEXT NOT NULL,
    expires_at REAL            -- epoch seconds; NULL keeps the result forever
);
CREATE INDEX IF NOT EXISTS task_results_expiry ON task_results (expires_at)
    WHERE expires_at IS NOT NULL;
CREATE TABLE IF NOT EXISTS group_results (
    group_id   TEXT PRIMARY KEY,
    meta       TEXT NOT NULL,
    expires_at REAL
);
CREATE TABLE IF NOT EXISTS chords (
    group_id    TEXT PRIMARY KEY,
    size        INTEGER NOT NULL,
    claim       TEXT,            -- token of the caller applying the body
    claim_until REAL,
    done        INTEGER NOT NULL DEFAULT 0,
    expires_at  REAL
);
CREATE TABLE IF NOT EXISTS chord_parts (
    group_id TEXT NOT NULL,
    idx      INTEGER NOT NULL,
    task_id  TEXT NOT NULL,
    state    TEXT NOT NULL,
    result   TEXT NOT NULL,
    PRIMARY KEY (group_id, idx, task_id)
);
CREATE TABLE IF NOT EXISTS claims (
    key        TEXT PRIMARY KEY,
    owner      TEXT,              -- who holds it; NULL once done
    until      REAL,              -- epoch seconds the claim lapses unless renewed
    done       INTEGER NOT NULL DEFAULT 0,
    expires_at REAL               -- when a done key is forgotten; NULL keeps it
);
CREATE TABLE IF NOT EXISTS revoked (
    entry      TEXT PRIMARY KEY,  -- id:<task id> or stamp:<json [header, value]>
    expires_at REAL NOT NULL
);
""" + fenced.SQLITE_SCHEMA + fenced.SQLITE_PENDING_SCHEMA
#: How long a claim on a completed chord holds before another caller may take over (the
#: claimer crashed before dispatching the body).
CHORD_CLAIM_SECONDS = 30.0
#: A chord whose header never completes is forgotten after this long.
CHORD_EXPIRES = 86400.0
#: Errors after which the file is opened again: it may have been opened read-only.
_REOPEN_AFTER = frozenset({sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_PERM,
                           sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB})
T = TypeVar("T")


class ResultStoreFileError(sqlite3.OperationalError):
    """The result store's SQLite file cannot be used now; the message names the file, the
    error and what to do. SQLite's error code is kept (``sqlite_errorcode``)."""

    #: Said in the log already (``sqlitedb.troubles``): callers that report it say it quietly.
    said = False

    def __init__(self, path: Path, cause: sqlite3.Error | OSError) -> None:
        super().__init__(f"SQLite result store {sqlitedb.describe(path, cause)}")
        self.path = path
        # SQLite's code, for exception_safe_to_retry; an OSError (its directory could not
        # be made) is what SQLite calls CANTOPEN.
        self.sqlite_errorcode = getattr(cause, "sqlite_errorcode", sqlite3.SQLITE_CANTOPEN)
        self.sqlite_errorname = getattr(cause, "sqlite_errorname", "SQLITE_CANTOPEN")


def sqlite_path(url: str) -> Path:
    """``sqlite:////abs/file`` → ``/abs/file``; ``sqlite:///rel`` → ``rel`` (from the CWD)."""
    prefix = "sqlite://"
    if not url.startswith(prefix) or len(url) <= len(prefix) + 1:
        raise ValueError(f"expected sqlite:///<path> or sqlite:////<absolute path>, got {url!r}")
    rest = url[len(prefix):]
    path = rest[1:] if rest.startswith("/") else rest
    return Path(path).expanduser()


class SQLiteBackend(Backend):
    """Results in a WAL-mode SQLite file; expiry enforced on read, purged by the worker."""

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        self.path = sqlite_path(url)
        self._conn: sqlite3.Connection | None = None
        self._pid = 0

    @property
    def conn(self) -> sqlite3.Connection:
        # A sqlite3 connection must never be used, or closed, across fork(): a new process
        # opens its own (see workhorse.forksafe).
        if self._conn is None or self._pid != os.getpid():
            abandon(self._conn)   # inherited across fork: never close it here
            conn = sqlitedb.connect(self.path, _SCHEMA, SCHEMA_VERSION)
            self._conn, self._pid = conn, os.getpid()
        return self._conn

    def close(self) -> None:
        if self._conn is not None and self._pid == os.getpid():
            self._conn.close()
        self._conn = None

    def on_connection_error(self, exc: BaseException) -> None:
        """A busy database or a full disk needs no new connection: just try again. One
        opened read-only (or not at all) is opened again."""
        code = getattr(exc, "sqlite_errorcode", None)
        if code is not None and code & 0xFF in _REOPEN_AFTER:
            self.close()

    def exception_safe_to_retry(self, exc: BaseException) -> bool:
        return sqlitedb.is_fault(exc)

    def retrying(self, what: str, function: Callable[[], T]) -> T:
        return super().retrying(what, lambda: self._naming_the_file(function))

    def _naming_the_file(self, function: Callable[[], T]) -> T:
        # While the file is in trouble, a write that changes a row ends it.
        conn = self._conn if sqlitedb.troubles.troubled(self.path) else None
        changes = conn.total_changes if conn is not None else -1
        try:
            done = function()
        except (sqlite3.Error, OSError) as exc:
            if isinstance(exc, ResultStoreFileError) or not sqlitedb.is_fault(exc):
                raise
            sqlitedb.troubles.began(self.path, "SQLite result store", exc)
            if (isinstance(exc, sqlite3.Error) and self._conn is not None
                    and (exc.sqlite_errorcode or 0) & 0xFF == sqlite3.SQLITE_FULL):
                sqlitedb.checkpoint(self._conn, self.path)     # see the module docstring
            error = ResultStoreFileError(self.path, exc)
            error.said = True
            raise error from exc
        if conn is not None and conn is self._conn and conn.total_changes != changes:
            sqlitedb.troubles.written(self.path)
        return done

    def _expiry(self) -> float | None:
        return time.time() + self.expires if self.expires else None

    @contextmanager
    def _immediate(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (see sqlitedb.immediate)."""
        with sqlitedb.immediate(self.conn) as conn:
            yield conn

    # -- task results
    def _set(self, task_id: str, state: str, payload: str) -> None:
        self.conn.execute(
            "INSERT OR REPLACE INTO task_results (task_id, status, meta, expires_at) "
            "VALUES (?, ?, ?, ?)", (task_id, state, payload, self._expiry()))

    def _get(self, task_id: str) -> str | None:
        row = self.conn.execute(
            "SELECT meta FROM task_results WHERE task_id = ? "
            "AND (expires_at IS NULL OR expires_at > ?)", (task_id, time.time())).fetchone()
        return row[0] if row else None

    def _forget(self, task_id: str) -> None:
        self.conn.execute("DELETE FROM task_results WHERE task_id = ?", (task_id,))

    # -- groups
    def _set_group(self, group_id: str, payload: str) -> None:
        self.conn.execute("INSERT OR REPLACE INTO group_results VALUES (?, ?, ?)",
                          (group_id, payload, self._expiry()))

    def _get_group(self, group_id: str) -> str | None:
        row = self.conn.execute(
            "SELECT meta FROM group_results WHERE group_id = ? "
            "AND (expires_at IS NULL OR expires_at > ?)", (group_id, time.time())).fetchone()
        return row[0] if row else None

    def _forget_group(self, group_id: str) -> None:
        self.conn.execute("DELETE FROM group_results WHERE group_id = ?", (group_id,))

    # -- chords
    def set_chord_size(self, group_id: str, size: int) -> None:
        self.retrying(f"setting up chord {group_id}", lambda: self.conn.execute(
            "INSERT OR REPLACE INTO chords (group_id, size, expires_at) VALUES (?, ?, ?)",
            (group_id, size, time.time() + CHORD_EXPIRES)))

    def _part_return(self, group_id: str, task_id: str, index: int, state: str,
                     encoded: str) -> ChordCompletion | None:
        with self._immediate() as conn:   # one writer at a time: the count is exact
            chord = conn.execute("SELECT size, claim, claim_until, done FROM chords "
                                 "WHERE group_id = ?", (group_id,)).fetchone()
            if chord is None or chord[3]:
                return None
            conn.execute("INSERT OR IGNORE INTO chord_parts VALUES (?, ?, ?, ?, ?)",
                         (group_id, index, task_id, state, encoded))
            ready = conn.execute("SELECT count(*) FROM chord_parts WHERE group_id = ?",
                                 (group_id,)).fetchone()[0]
            size, claim, claim_until = chord[0], chord[1], chord[2]
            now = time.time()
            # The claim is the completing part's task id: that part's redelivery (its
            # worker died before the body was sent) takes it again at once.
            if ready < size or (claim not in (None, task_id) and claim_until > now):
                return None
            token = task_id
            conn.execute("UPDATE chords SET claim = ?, claim_until = ? WHERE group_id = ?",
                         (token, now + CHORD_CLAIM_SECONDS, group_id))
            rows = conn.execute("SELECT task_id, state, result FROM chord_parts "
                                "WHERE group_id = ? ORDER BY idx", (group_id,)).fetchall()
        return ChordCompletion([ChordPart(t, s, loads(r)) for t, s, r in rows], token)

    def chord_finished(self, group_id: str, token: str) -> None:
        def finish() -> None:
            with self._immediate() as conn:
                claimed = conn.execute("UPDATE chords SET done = 1 WHERE group_id = ? AND "
                                       "claim = ?", (group_id, token)).rowcount
                if claimed:
                    conn.execute("DELETE FROM chord_parts WHERE group_id = ?", (group_id,))
        self.retrying(f"finishing chord {group_id}", finish)

    # -- claims (retried by the base class's public methods). Expired rows count as absent
    # at once, like results; purge_expired deletes them later.
    def _claim(self, key: str, owner: str, ttl: float) -> Claim:
        with self._immediate() as conn:
            row = conn.execute("SELECT owner, until, done, expires_at FROM claims "
                               "WHERE key = ?", (key,)).fetchone()
            now = time.time()
            if row is not None:
                holder, until, done, expires_at = row
                if done and (expires_at is None or expires_at > now):
                    return Claim.DONE
                if not done and holder != owner and until > now:
                    return Claim.HELD
            conn.execute("INSERT OR REPLACE INTO claims (key, owner, until, done, expires_at) "
                         "VALUES (?, ?, ?, 0, NULL)", (key, owner, now + ttl))
        return Claim.CLAIMED

    def _renew_claims(self, claims: Mapping[str, str], ttl: float) -> set[str]:
        lost = set()
        with self._immediate() as conn:
            now = time.time()
            for key, owner in claims.items():
                # A lapsed claim is lost even if nobody took it meanwhile, as in Redis where
                # the key is gone: someone may have claimed and released it in between.
                renewed = conn.execute(
                    "UPDATE claims SET until = ? WHERE key = ? AND owner = ? AND NOT done "
                    "AND until > ?", (now + ttl, key, owner, now)).rowcount
                if not renewed:
                    lost.add(key)
        return lost

    # One statement is a transaction of its own, and a write statement takes the write lock
    # before it reads: release and finish need no BEGIN IMMEDIATE.
    def _release_claim(self, key: str, owner: str) -> None:
        self.conn.execute("DELETE FROM claims WHERE key = ? AND owner = ? AND NOT done",
                          (key, owner))

    def _finish_claim(self, key: str) -> None:
        self.conn.execute("INSERT OR REPLACE INTO claims (key, owner, until, done, expires_at) "
                          "VALUES (?, NULL, NULL, 1, ?)", (key, self._expiry()))

    # -- fences of periodic tasks
    def _move_fence(self, ticket: Ticket) -> tuple[bool, Record | None]:
        with self._immediate() as conn:
            moved, holder = fenced.sqlite_move(conn, ticket)
            if moved and holder is None:
                conn.execute(f"INSERT OR REPLACE INTO {fenced.SQLITE_PENDING} (name, nominal, "
                             "record) VALUES (?, ?, ?)",
                             (ticket.name, ticket.record.nominal, ticket.record.dumps()))
            return moved, holder

    def _settle_fence(self, ticket: Ticket, record: Record) -> None:
        with self._immediate() as conn:
            conn.execute(f"UPDATE {fenced.SQLITE_TABLE} SET nominal = ?, record = ? "
                         "WHERE name = ? AND json_extract(record, '$.task_id') = ?",
                         (record.nominal, record.dumps(), ticket.name, ticket.record.task_id))
            conn.execute(f"DELETE FROM {fenced.SQLITE_PENDING} WHERE name = ? AND nominal = ? "
                         "AND record = ?",
                         (ticket.name, ticket.record.nominal, ticket.record.dumps()))

    def _pending_fences(self, name: str) -> list[Record]:
        rows = self.conn.execute(f"SELECT record FROM {fenced.SQLITE_PENDING} WHERE name = ? "
                                 "ORDER BY nominal", (name,)).fetchall()
        return [r for (text,) in rows if (r := fenced.record_or_none(text)) is not None]

    def _take_pending(self, name: str, old: Record, new: Record) -> bool:
        return self.conn.execute(
            f"UPDATE {fenced.SQLITE_PENDING} SET record = ? WHERE name = ? AND nominal = ? AND "
            "record = ?", (new.dumps(), name, old.nominal, old.dumps())).rowcount == 1

    def _fence_records(self, names: list[str]) -> dict[str, Record]:
        return fenced.sqlite_records(self.conn, names)

    # -- revoked
    def _save_revoked(self, entries: Mapping[str, float]) -> None:
        with self._immediate() as conn:
            conn.executemany(
                "INSERT INTO revoked (entry, expires_at) VALUES (?, ?) ON CONFLICT (entry) "
                "DO UPDATE SET expires_at = max(expires_at, excluded.expires_at)",
                list(entries.items()))
            conn.execute("DELETE FROM revoked WHERE expires_at <= ?", (time.time(),))
            conn.execute("DELETE FROM revoked WHERE entry NOT IN (SELECT entry FROM revoked "
                         "ORDER BY expires_at DESC LIMIT ?)", (REVOKES_MAX,))

    def _load_revoked(self) -> dict[str, float]:
        return dict(self.conn.execute("SELECT entry, expires_at FROM revoked WHERE "
                                      "expires_at > ?", (time.time(),)).fetchall())

    # -- housekeeping
    def purge_expired(self) -> int:
        """Delete expired results, groups, abandoned chords and claims (lapsed, or done and
        past result_expires), then checkpoint the write-ahead log (never waiting: it cuts
        back a log that grew while the file was busy); returns how many results."""
        removed = self.retrying("purging expired results", self._purge_expired)
        sqlitedb.checkpoint(self.conn, self.path)
        return removed

    def _purge_expired(self) -> int:
        now = time.time()
        conn = self.conn
        removed = conn.execute("DELETE FROM task_results WHERE expires_at IS NOT NULL AND "
                               "expires_at <= ?", (now,)).rowcount
        conn.execute("DELETE FROM group_results WHERE expires_at IS NOT NULL AND expires_at <= ?",
                     (now,))
        conn.execute("DELETE FROM chord_parts WHERE group_id IN (SELECT group_id FROM chords "
                     "WHERE expires_at <= ?)", (now,))
        conn.execute("DELETE FROM chords WHERE expires_at <= ?", (now,))
        conn.execute("DELETE FROM claims WHERE (done AND expires_at <= ?) OR (NOT done AND "
                     "until <= ?)", (now, now))
        conn.execute("DELETE FROM revoked WHERE expires_at <= ?", (now,))
        return removed
