"""Frames between the supervisor and a child: a 4-byte length, then a pickle.

Pickle is safe here: both ends are our own processes, forked from one image. Frames carry
already-received broker data (raw body bytes), never code from outside.
The supervisor reads without blocking (``FrameReader``); a child reads and writes blocking.
"""
from __future__ import annotations

import errno
import os
import pickle
import struct
from dataclasses import dataclass
from typing import Any

_LEN = struct.Struct("!I")


@dataclass(frozen=True)
class Job:
    """Supervisor → child: run this message. The child decodes the body itself."""

    seq: int
    task: str
    body: bytes
    content_type: str | None
    content_encoding: str | None
    headers: dict[str, Any]
    delivery_info: dict[str, Any]
    track_started: bool
    queue: str = ""
    priority: int | None = None
    acks_late: bool = True
    #: Idempotent tasks: who claims the task's key for this run, and for how long.
    claim_owner: str = ""
    claim_ttl: float = 0.0


@dataclass(frozen=True)
class Stop:
    """Supervisor → child: exit after the current task (the child is idle when it reads it)."""


@dataclass(frozen=True)
class Hello:
    """Child → supervisor: set up and ready for jobs."""

    pid: int


@dataclass(frozen=True)
class Claimed:
    """Child → supervisor: an idempotent task claimed its key; renew it while it runs."""

    seq: int
    key: str
    owner: str


@dataclass(frozen=True)
class Done:
    """Child → supervisor: the job's outcome, after its result is stored."""

    seq: int
    outcome: str           # an Outcome value
    detail: str | None = None
    rss: int = 0           # the child's resident set size in bytes, measured after the task


def encode(obj: object) -> bytes:
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(payload)) + payload


def write_frame(fd: int, obj: object) -> None:
    """Write a whole frame, blocking until it is written."""
    view = memoryview(encode(obj))
    while view:
        written = os.write(fd, view)
        view = view[written:]


def read_frame(fd: int) -> Any | None:
    """Read one frame, blocking; None at end of file (the other side is gone)."""
    header = _read_exact(fd, _LEN.size)
    if header is None:
        return None
    (length,) = _LEN.unpack(header)
    payload = _read_exact(fd, length)
    if payload is None:
        return None
    return pickle.loads(payload)


def _read_exact(fd: int, size: int) -> bytes | None:
    chunks: list[bytes] = []
    while size:
        chunk = os.read(fd, size)
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


class FrameReader:
    """Non-blocking reader: feed it what is readable, get whole frames out."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buffer = bytearray()
        self.eof = False

    def read(self) -> list[Any]:
        """Read what the fd has now; return the frames completed by it."""
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno in (errno.EBADF, errno.EIO):
                    self.eof = True
                    break
                raise
            if not chunk:
                self.eof = True
                break
            self._buffer += chunk
            if len(chunk) < 65536:
                break
        return self._frames()

    def _frames(self) -> list[Any]:
        frames = []
        buffer = self._buffer
        while len(buffer) >= _LEN.size:
            (length,) = _LEN.unpack_from(buffer)
            end = _LEN.size + length
            if len(buffer) < end:
                break
            frames.append(pickle.loads(bytes(buffer[_LEN.size:end])))
            del buffer[:end]
        return frames
