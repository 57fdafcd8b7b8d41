"""Opening a SQLite file that several processes share (the embedded broker and result store)."""
from __future__ import annotations

import random
import sqlite3
import time
from pathlib import Path

#: How long one process waits for another's write lock before giving up.
BUSY_TIMEOUT = 10.0


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
