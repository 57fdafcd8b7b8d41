"""The embedded default result store: one SQLite file shared by the processes of a host."""
from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

from .. import sqlitedb
from ..forksafe import abandon
from .base import Backend

SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS task_results (
    task_id    TEXT PRIMARY KEY,
    status     TEXT NOT NULL,
    meta       TEXT NOT NULL,
    expires_at REAL            -- epoch seconds; NULL keeps the result forever
);
CREATE INDEX IF NOT EXISTS task_results_expiry ON task_results (expires_at)
    WHERE expires_at IS NOT NULL;
"""


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

    def __init__(self, url: str, *, expires: float | None = None, extended: bool = False) -> None:
        super().__init__(url, expires=expires, extended=extended)
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

    def _set(self, task_id: str, state: str, payload: str) -> None:
        expires_at = time.time() + self.expires if self.expires else None
        self.conn.execute(
            "INSERT OR REPLACE INTO task_results (task_id, status, meta, expires_at) "
            "VALUES (?, ?, ?, ?)", (task_id, state, payload, expires_at))

    def _get(self, task_id: str) -> str | None:
        row = self.conn.execute(
            "SELECT meta FROM task_results WHERE task_id = ? "
            "AND (expires_at IS NULL OR expires_at > ?)", (task_id, time.time())).fetchone()
        return row[0] if row else None

    def _forget(self, task_id: str) -> None:
        self.conn.execute("DELETE FROM task_results WHERE task_id = ?", (task_id,))

    def purge_expired(self) -> int:
        """Delete expired results; returns how many went."""
        cur = self.conn.execute(
            "DELETE FROM task_results WHERE expires_at IS NOT NULL AND expires_at <= ?",
            (time.time(),))
        return cur.rowcount
