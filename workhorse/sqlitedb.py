"""Opening a SQLite file that several processes share (the embedded broker and result store),
keeping its write-ahead log small, and telling the file's troubles from the statement's.

The write-ahead log: by default SQLite checkpoints it (copies it into the file) only once
it holds 1000 pages, 4 MB, and never shrinks it. On a small file system the logs alone
fill the disk, and on a full one a write that needs the log to grow fails and leaves no
checkpoint behind to start the log over, so no write ever succeeds again. Each
connection checkpoints at
``WAL_CHECKPOINT_BYTES`` and cuts the log back to ``WAL_SIZE_LIMIT`` when it starts over,
and a write that failed for want of space is followed by a checkpoint (``checkpoint``).
The log keeps the space it has: a broker whose messages come and go writes on in it on a
disk that is full.

A file's trouble (an error that is a fault, until writes go through again) is said once
when it begins and once when it ends (``troubles``), not on every retry: errors raised for
it carry ``said`` (see ``said``).
"""
from __future__ import annotations

import logging
import os
import random
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("workhorse.sqlite")

#: How long one process waits for another's write lock before giving up.
BUSY_TIMEOUT = 10.0
#: A commit that leaves this much in the write-ahead log checkpoints it (PASSIVE: it never
#: waits for a reader or a writer; what a reader still uses is copied by a later one).
WAL_CHECKPOINT_BYTES = 1 << 20
#: The write-ahead log is cut back to this size whenever it starts over. Above the
#: checkpoint size by the largest usual transaction, so that in normal running it keeps
#: its size (and the disk space it has) instead of being cut and grown again each time.
WAL_SIZE_LIMIT = 2 << 20

#: SQLite's primary result codes that say the file, its directory or its disk is in trouble,
#: not the statement: they pass once the operator (or another process) acts, so they are
#: retried with back-off. Each maps to what the operator can do about it.
FAULTS: dict[int, str] = {
    sqlite3.SQLITE_FULL: "free space on its disk",
    sqlite3.SQLITE_IOERR: "check its disk and that the file was not deleted or replaced",
    sqlite3.SQLITE_READONLY: "make it and its directory writable for this user",
    sqlite3.SQLITE_CANTOPEN: "make it and its directory readable and writable for this user",
    sqlite3.SQLITE_PERM: "make it and its directory readable and writable for this user",
    sqlite3.SQLITE_BUSY: f"another process held its write lock for over {BUSY_TIMEOUT:.0f} s",
    sqlite3.SQLITE_LOCKED: f"another process held its write lock for over {BUSY_TIMEOUT:.0f} s",
    sqlite3.SQLITE_PROTOCOL: "another process held its locks; this passes by itself",
    sqlite3.SQLITE_CORRUPT: "restore it from a backup, or move it away to start afresh",
    sqlite3.SQLITE_NOTADB: "restore it from a backup, or move it away to start afresh",
}


def is_fault(exc: BaseException) -> bool:
    """Is ``exc`` the file's trouble (disk full, read-only, I/O error, locked, gone) rather
    than a mistake in the statement? OSError: its directory could not be made."""
    if isinstance(exc, sqlite3.Error):
        return _primary(exc) in FAULTS
    return isinstance(exc, OSError)


def describe(path: Path, exc: BaseException) -> str:
    """``<path>: <SQLite's message> (<code name>); <what to do>``."""
    if isinstance(exc, sqlite3.Error):
        name = getattr(exc, "sqlite_errorname", None)
        code = _primary(exc)
        hint = None if code is None else FAULTS.get(code)
        return f"{path}: {exc}" + (f" ({name})" if name else "") + (f"; {hint}" if hint else "")
    return f"{path}: {exc}"


def _primary(exc: sqlite3.Error) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)
    return None if code is None else code & 0xFF


def identity(path: Path) -> tuple[int, int] | None:
    """The (device, inode) the path names now; None if nothing is there."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def connect(path: Path, schema: str, schema_version: int) -> sqlite3.Connection:
    """A WAL-mode connection with the schema in place.

    Switching to WAL and creating tables need locks that SQLite does not wait for through
    its busy handler; two processes opening a new file at once (a worker's children, say)
    would see "database is locked" at once. So those steps are retried here, with jitter.
    """
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT, isolation_level=None,
                           check_same_thread=False)
    deadline = time.monotonic() + BUSY_TIMEOUT
    delay = 0.005
    while True:
        try:
            # Nothing is written to a file already set up (WAL, schema current): opening
            # one on a full disk needs no room.
            if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            autocheckpoint(conn, True)
            conn.execute(f"PRAGMA journal_size_limit = {WAL_SIZE_LIMIT}")
            if conn.execute("PRAGMA user_version").fetchone()[0] < schema_version:
                # IF NOT EXISTS makes a race between two processes creating it harmless.
                conn.executescript(schema + f"\nPRAGMA user_version = {schema_version};")
            return conn
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc):
                conn.close()
                raise
            if time.monotonic() >= deadline:
                conn.close()
                raise
            time.sleep(delay * (1 + random.random()))
            delay = min(delay * 2, 0.2)


@contextmanager
def immediate(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction: taking the write lock up front means what is read inside
    cannot change before it is written, and waiting for it goes through busy_timeout.
    SQLite may roll back by itself on an error (disk full, I/O): only a transaction still
    open is rolled back here, so the error that ended it is the one raised."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def autocheckpoint(conn: sqlite3.Connection, on: bool) -> None:
    """Let a commit on ``conn`` checkpoint the log once it holds WAL_CHECKPOINT_BYTES, or
    not: a thread that must not wait on the disk leaves it to ``checkpoint`` elsewhere."""
    pages = max(1, WAL_CHECKPOINT_BYTES // conn.execute("PRAGMA page_size").fetchone()[0])
    conn.execute(f"PRAGMA wal_autocheckpoint = {pages if on else 0}")


def checkpoint(conn: sqlite3.Connection, path: Path) -> bool:
    """Copy the write-ahead log of ``path`` (open on ``conn``) into the file and have the
    next write start the log over in the space it has, never waiting: RESTART with the busy
    handler off; TRUNCATE (the log cut to nothing) if it grew past WAL_SIZE_LIMIT. With a
    writer in the file it copies what no reader needs, as PASSIVE does; with a reader in
    the log at that moment the log is copied but not started over (a later one will).
    (Commits' own PASSIVE checkpoints copy the log, but it starts over only at a write that
    begins with all of it copied and no reader in it: while several processes write
    without pause that is seldom.) True if it was all copied and starts over; False if
    not, or it failed (the file could not grow on a full disk): a later one goes on."""
    if conn.in_transaction:     # (a checkpoint cannot run inside one)
        return False
    mode = "TRUNCATE" if wal_size(path) > WAL_SIZE_LIMIT else "RESTART"
    waits = conn.execute("PRAGMA busy_timeout").fetchone()[0]
    conn.execute("PRAGMA busy_timeout = 0")
    try:
        busy, logged, copied = conn.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
    except sqlite3.Error:
        return False
    finally:
        conn.execute(f"PRAGMA busy_timeout = {waits}")
    return not busy and logged == copied


def wal_size(path: Path) -> int:
    """Bytes in the file's write-ahead log now (0: none)."""
    try:
        return os.stat(f"{path}-wal").st_size
    except FileNotFoundError:
        return 0


class _Trouble:
    __slots__ = ("what", "described", "code", "began", "failed")

    def __init__(self, what: str, exc: BaseException, described: str, now: float) -> None:
        self.what = what                # "SQLite broker"
        self.described = described      # the error, as said when it began
        self.code = getattr(exc, "sqlite_errorname", None) or type(exc).__name__
        self.began = self.failed = now      # monotonic times: it began, it last failed


class Troubles:
    """The troubles of this process's SQLite files going on now, each said once in the log
    when it begins and once when it ends: every call that meets it in between (each retry,
    each reconnect) would otherwise say it again, hundreds of times. A trouble begins with
    an error that is a fault (``is_fault``) and ends with a write that changes a row
    SETTLE seconds after the last failure: on a disk that is full, a write can go through
    now and then (into space a checkpoint freed in the log) between failures."""

    #: Seconds without a failure before a write ends a trouble.
    SETTLE = 2.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._now: dict[Path, _Trouble] = {}
        #: Bumped by each change: a reader of ``now`` sees it has something new to say.
        self.changes = 0

    def began(self, path: Path, what: str, exc: BaseException) -> None:
        """``what`` (``SQLite broker``) at ``path`` failed with the fault ``exc``."""
        now = time.monotonic()
        with self._lock:
            trouble = self._now.get(path)
            if trouble is not None:
                trouble.failed = now
                return
            trouble = self._now[path] = _Trouble(what, exc, describe(path, exc), now)
            self.changes += 1
        log.error("%s %s%s. Calls that need it fail and are retried with back-off meanwhile; "
                  "this is said again only once it is written again", what, trouble.described,
                  _free_space(path, exc))

    def written(self, path: Path) -> None:
        """A write to ``path`` changed a row (call only while ``troubled``)."""
        now = time.monotonic()
        with self._lock:
            trouble = self._now.get(path)
            if trouble is None or now - trouble.failed < self.SETTLE:
                return
            del self._now[path]
            self.changes += 1
        log.info("%s %s is written again, after %.1f s of trouble (%s)", trouble.what, path,
                 now - trouble.began, trouble.code)

    def troubled(self, path: Path) -> bool:
        return path in self._now

    def now(self) -> list[str]:
        """What is going on, one line per file."""
        with self._lock:
            return [f"{trouble.what} {trouble.described}" for trouble in self._now.values()]


#: This process's.
troubles = Troubles()


def said(exc: BaseException) -> bool:
    """Was ``exc`` (or what caused it: kombu wraps ours) said already, by ``troubles``? Then a
    caller that reports errors logs it quietly (DEBUG)."""
    seen: BaseException | None = exc
    for _ in range(8):      # a chain of causes is short; a cycle is not followed round
        if seen is None:
            return False
        if getattr(seen, "said", False):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _free_space(path: Path, exc: BaseException) -> str:
    if not isinstance(exc, sqlite3.Error) or _primary(exc) != sqlite3.SQLITE_FULL:
        return ""
    try:
        stat = os.statvfs(path.parent)
    except OSError:
        return ""
    return (f" ({stat.f_bavail * stat.f_frsize} bytes free on its file system; its "
            f"write-ahead log holds {wal_size(path)} bytes)")
