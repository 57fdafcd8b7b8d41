"""Where the supervisor's and its children's log records go, and how each is written.

- To stderr, or to ``logfile``. A log file is reopened when it was moved or removed
  (logrotate): the supervisor at once on SIGUSR2, and every process (children too) at its
  first record after noticing, which it checks at most once a second.
- ``log_format = "text"`` (the default): ``[time level process pid] message``; ``"json"``:
  one JSON object per line (``time``, ``level``, ``logger``, ``process``, ``pid``,
  ``message``, and ``traceback`` when there is one).
- Under systemd (``$JOURNAL_STREAM`` names the stderr the worker has), each line starts
  with its syslog priority (``<3>`` for ERROR, as sd-daemon(3) describes: journald stores
  it as the record's PRIORITY), and the newlines inside a record (a traceback) are written
  as the two characters ``\\n``, so a record stays one journal entry. workhorse uses
  this stream convention rather than the native journal protocol: it needs no socket of
  its own, and it is the same stream a container or a plain terminal gets.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import IO, Any

TEXT_FORMAT = "[%(asctime)s %(levelname)s %(processName)s %(process)d] %(message)s"
#: syslog priorities by logging level (sd-daemon(3)'s <N> prefixes).
PRIORITIES = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6,
              logging.DEBUG: 7}
#: How often a log file is checked for having been moved away.
REOPEN_CHECK = 1.0


def under_journald(stream: IO[str]) -> bool:
    """Is ``stream`` the journal stream systemd gave us ($JOURNAL_STREAM is device:inode)?"""
    found = os.environ.get("JOURNAL_STREAM", "")
    if ":" not in found:
        return False
    try:
        stat = os.fstat(stream.fileno())
        device, inode = (int(x) for x in found.split(":", 1))
    except (OSError, ValueError, AttributeError):
        return False
    return (stat.st_dev, stat.st_ino) == (device, inode)


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        found: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created).astimezone().isoformat(
                timespec="milliseconds"),
            "level": record.levelname, "logger": record.name,
            "process": record.processName, "pid": record.process,
            "message": record.getMessage()}
        if record.exc_info:
            found["traceback"] = self.formatException(record.exc_info)
        elif record.exc_text:
            found["traceback"] = record.exc_text
        return json.dumps(found, default=str, ensure_ascii=False)


class JournalFormatter(logging.Formatter):
    """Another formatter's line, one per record: priority prefix, newlines escaped."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        priority = PRIORITIES.get(record.levelno, 6 if record.levelno < logging.WARNING else 3)
        return f"<{priority}>" + self.inner.format(record).replace("\n", "\\n")


class ReopeningFileHandler(logging.StreamHandler):
    """Appends to ``path``; opens it again once it was moved or removed (checked at most
    every ``REOPEN_CHECK`` s, at a record), or at once on ``reopen()``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        super().__init__(self._open())
        self._checked = time.monotonic()

    def _open(self) -> IO[str]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        stream = open(self.path, "a", encoding="utf-8")
        stat = os.fstat(stream.fileno())
        self._identity = (stat.st_dev, stat.st_ino)
        return stream

    def _moved(self) -> bool:
        try:
            stat = os.stat(self.path)
        except OSError:
            return True
        return (stat.st_dev, stat.st_ino) != self._identity

    def reopen(self) -> None:
        self.acquire()
        try:
            old, self.stream = self.stream, self._open()
            with contextlib.suppress(OSError):      # a child's copy may lead nowhere
                old.close()
        finally:
            self.release()

    def emit(self, record: logging.LogRecord) -> None:
        now = time.monotonic()
        if now - self._checked >= REOPEN_CHECK:
            self._checked = now
            if self._moved():
                try:
                    self.reopen()
                except OSError:
                    pass            # write on to the old file rather than lose the record
        super().emit(record)


def configure(loglevel: str, log_format: str, logfile: Path | None) -> logging.Handler:
    """Replace the root logger's handlers with the one the settings say; return it."""
    handler: logging.Handler
    if logfile is not None:
        handler = ReopeningFileHandler(logfile)
        stream: IO[str] | None = None
    else:
        stream = sys.stderr
        handler = logging.StreamHandler(stream)
    inner: logging.Formatter = (JSONFormatter() if log_format == "json"
                                else logging.Formatter(TEXT_FORMAT))
    handler.setFormatter(JournalFormatter(inner) if stream is not None and under_journald(stream)
                         else inner)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(loglevel)
    return handler


def reopen_logfile() -> bool:
    """SIGUSR2: open the log file again (after logrotate moved it). False: no log file."""
    found = False
    for handler in logging.getLogger().handlers:
        if isinstance(handler, ReopeningFileHandler):
            handler.reopen()
            found = True
    return found
