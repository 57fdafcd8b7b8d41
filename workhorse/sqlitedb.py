"""Opening a SQLite file that several processes share (the embedded broker and result store),
and telling the file's troubles from the statement's."""
from __future__ import annotations

import os
import random
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: How long one process waits for another's write lock before giving up.
BUSY_TIMEOUT = 10.0

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
            if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
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
