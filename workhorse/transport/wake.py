"""Wakeups for the SQLite broker: a publisher tells the workers consuming the file that a
message is there, instead of their polling the file every 50 ms.

Each consuming worker binds a Unix datagram socket in Linux's abstract namespace (no file,
gone with the process) and registers it by an empty file of the same name in
``<broker file>.wake/``. A publisher, once its message is committed, sends one byte to
every registered socket, without blocking: a full socket buffer means a wakeup is pending
there already, and a refused send means the worker is gone (its file is removed). What a
wakeup cannot reach (a publisher in another network namespace, or not using workhorse's
transport; a lease that ran out) a worker still finds by a slow safety poll.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import socket
import time
from pathlib import Path

log = logging.getLogger("workhorse.transport.sqlite")

#: A publisher reads the registrations again at most this often.
LIST_INTERVAL = 1.0


def wake_dir(broker: Path) -> Path:
    return broker.with_name(broker.name + ".wake")


def _address(broker: Path, name: str) -> bytes:
    digest = hashlib.sha1(str(broker.absolute()).encode()).hexdigest()[:16]
    return f"\0workhorse-wake/{digest}/{name}".encode()


class Listener:
    """A consumer's end: readable when a publisher has put a message in the file."""

    def __init__(self, broker: Path) -> None:
        self.broker = broker
        self.dir = wake_dir(broker)
        self.name = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.sock = socket.socket(socket.AF_UNIX,
                                  socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        try:
            self.sock.bind(_address(broker, self.name))
            self.dir.mkdir(exist_ok=True)
            (self.dir / self.name).touch()
        except OSError:
            self.sock.close()
            raise

    def fileno(self) -> int:
        return self.sock.fileno()

    def drain(self) -> int:
        """Read the wakeups waiting; return how many there were."""
        count = 0
        while True:
            try:
                self.sock.recv(64)
            except (BlockingIOError, InterruptedError):
                return count
            count += 1

    def close(self) -> None:
        with contextlib.suppress(OSError):
            (self.dir / self.name).unlink()
        self.sock.close()


class Notifier:
    """A publisher's end: ``notify()`` after each commit that gives consumers work."""

    def __init__(self, broker: Path) -> None:
        self.broker = broker
        self.dir = wake_dir(broker)
        self._names: list[str] = []
        self._listed = float("-inf")
        self._sock: socket.socket | None = None

    def notify(self) -> None:
        """Never raises: the message is committed already, and a publish that raised now
        would be published again by a caller that retries."""
        try:
            self._notify()
        except Exception as exc:  # noqa: BLE001 - a wakeup is a courtesy
            log.debug("could not wake the consumers of %s: %r", self.broker, exc)

    def _notify(self) -> None:
        now = time.monotonic()
        if now - self._listed >= LIST_INTERVAL:
            self._listed = now
            try:
                self._names = os.listdir(self.dir)
            except OSError:
                self._names = []
        if not self._names:
            return
        if self._sock is None:
            self._sock = socket.socket(
                socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        for name in list(self._names):
            try:
                self._sock.sendto(b"\0", _address(self.broker, name))
            except (BlockingIOError, InterruptedError):
                pass                    # its buffer is full: it has wakeups pending
            except (ConnectionRefusedError, FileNotFoundError):
                self._names.remove(name)    # nobody listens: a worker that died
                with contextlib.suppress(OSError):
                    (self.dir / name).unlink()
            except OSError as exc:      # a wakeup is a courtesy: the poll still finds it
                log.debug("could not wake the consumer %s: %r", name, exc)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
