"""Frames between the supervisor and a child: a 4-byte length, then a pickle or a marshal.

Frames are named tuples: immutable, made and pickled several times faster than frozen
dataclasses (a frame is made, pickled and read for every task, on both sides). The two
frames of every task, ``Job`` and ``Done``, go as plain tuples through ``marshal``, which
carries exactly the plain values they hold in a fraction of pickle's time (a Done's read
costs a third); a Job whose headers hold a value marshal does not carry (a datetime that
kombu's JSON decoded) is pickled. The first byte tells them apart: every pickle starts
with PROTO (0x80), no marshal does. The direction tells a marshalled tuple's kind: what
the supervisor reads is a Done, what a child reads a Job.

Pickle and marshal are safe here: both ends are our own processes, forked from one image
(one Python, one marshal format). Frames carry already-received broker data (raw body
bytes), never code from outside. The supervisor reads without blocking (``FrameReader``);
a child reads (``FrameStream``) and writes blocking.

Every frame a child writes names its sender's pid, and those about a job name the job's
seq: a process the task forked shares the child's pipe, and the supervisor acts only on
what the child itself wrote about the job it runs (``Child.receive``).
"""
from __future__ import annotations

import errno
import marshal
import os
import pickle
import struct
from typing import Any, NamedTuple, cast

_LEN = struct.Struct("!I")
#: A child's frames are small (a Done's detail is bounded): a length beyond this is not a
#: frame but garbage, e.g. two processes' writes interleaved.
MAX_FRAME = 16 * 1024 * 1024
#: How much of an outcome's description a Done carries.
MAX_DETAIL = 10_000


class Job(NamedTuple):
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
    #: The message's properties (correlation_id, reply_to, priority, ...): request.properties.
    properties: dict[str, Any] = {}     # (dispatch always gives its own)
    #: Task events are on: Done carries the result's repr or the traceback for them.
    events: bool = False
    #: An async def task: the child runs it on its event loop beside others, and enforces
    #: its time limits itself (the supervisor kills the child only if that fails).
    asynchronous: bool = False
    soft_limit: float | None = None
    hard_limit: float | None = None


class Cancel(NamedTuple):
    """Supervisor → child running async tasks: cancel job ``seq`` (revoked with terminate);
    it ends as ``outcome`` (an Outcome value), for ``detail``."""

    seq: int
    outcome: str
    detail: str


class Stop(NamedTuple):
    """Supervisor → child: exit (the child is idle when it reads it)."""


class Hello(NamedTuple):
    """Child → supervisor: set up and ready for jobs."""

    pid: int


class Claimed(NamedTuple):
    """Child → supervisor: an idempotent task claimed its key; renew it while it runs."""

    pid: int
    seq: int
    key: str
    owner: str


class Done(NamedTuple):
    """Child → supervisor: the job's outcome, after its result is stored."""

    pid: int
    seq: int
    outcome: str           # an Outcome value
    detail: str | None = None
    rss: int = 0           # the child's resident set size in bytes after the task (0: not
    #                        measured, with no max_memory_per_child)
    runtime: float | None = None    # seconds the task body ran, if it ran
    result: str | None = None       # events on: the return value's repr
    traceback: str | None = None    # events on: a failure's traceback


class Corrupt(NamedTuple):
    """Not a frame: where ``FrameReader`` found bytes that are none (a length or a pickle
    that cannot be read). Nothing after it is trusted; the child has to go."""

    reason: str


#: The first byte of every pickle (protocol 2 and later): PROTO.
_PICKLE = 0x80


def encode(obj: object) -> bytes:
    kind = type(obj)
    if kind is Job or kind is Done:
        fields = tuple(cast(tuple[Any, ...], obj))      # (marshal takes no subclass)
        try:
            payload = marshal.dumps(fields)
        except ValueError:
            # A value marshal does not carry: a datetime; a str subclass, which pickle
            # reduces in Python, at ten times the frame's cost (keep them out of jobs).
            # A Job still goes as a plain tuple (``decode`` makes it a Job again): a named
            # tuple is pickled through a Python call (__getnewargs__), at twice the cost.
            payload = pickle.dumps(fields if kind is Job else obj,
                                   protocol=pickle.HIGHEST_PROTOCOL)
    else:
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(payload)) + payload


def decode(data: bytes | bytearray | memoryview) -> Any:
    """A frame a child reads: a marshalled or pickled plain tuple is a Job."""
    if data[0] != _PICKLE:
        return Job._make(marshal.loads(data))
    frame = pickle.loads(data)
    return Job._make(frame) if type(frame) is tuple else frame


def write_frame(fd: int, obj: object) -> None:
    """Write a whole frame, blocking until it is written."""
    view = memoryview(encode(obj))
    while view:
        written = os.write(fd, view)
        view = view[written:]


class FrameStream:
    """Blocking reader (the child's): one frame at a time, read in as few system calls as
    the pipe allows (a frame usually arrives whole: one read, not two)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buffer = bytearray()

    def read(self) -> Any | None:
        """The next frame, blocking; None at end of file (the other side is gone)."""
        buffer = self._buffer
        while True:
            if len(buffer) >= _LEN.size:
                end = _LEN.size + _LEN.unpack_from(buffer)[0]
                if len(buffer) >= end:
                    frame = decode(buffer[_LEN.size:end])
                    del buffer[:end]
                    return frame
            chunk = os.read(self.fd, 65536)
            if not chunk:
                return None
            buffer += chunk

    def pending(self) -> list[Any]:
        """The whole frames in the buffer now, without reading."""
        frames = []
        buffer = self._buffer
        while len(buffer) >= _LEN.size:
            end = _LEN.size + _LEN.unpack_from(buffer)[0]
            if len(buffer) < end:
                break
            frames.append(decode(buffer[_LEN.size:end]))
            del buffer[:end]
        return frames

    def read_available(self) -> list[Any] | None:
        """What a non-blocking fd has now, as whole frames; None at end of file."""
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                return None
            self._buffer += chunk
            if len(chunk) < 65536:
                break
        return self.pending()


class FrameReader:
    """Non-blocking reader: feed it what is readable, get whole frames out."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buffer = bytearray()
        self.eof = False
        self.broken = False

    def read(self) -> list[Any]:
        """Read what the fd has now; return the frames completed by it, ending with a
        ``Corrupt`` if the stream broke. Once broken, what follows is read and dropped."""
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
            if not self.broken:
                self._buffer += chunk
            if len(chunk) < 65536:
                break
        return self._frames()

    def _frames(self) -> list[Any]:
        frames: list[Any] = []
        buffer = self._buffer
        while not self.broken and len(buffer) >= _LEN.size:
            (length,) = _LEN.unpack_from(buffer)
            if length > MAX_FRAME:
                frames.append(self._break(f"a frame claims {length} bytes, more than any "
                                          f"frame holds ({MAX_FRAME})"))
                break
            end = _LEN.size + length
            if len(buffer) < end:
                break
            try:
                frames.append(_read_from_child(buffer[_LEN.size:end]))
            except Exception as exc:  # noqa: BLE001 - garbage fails in any way it likes
                frames.append(self._break(f"a frame does not unpickle or unmarshal: "
                                          f"{exc!r:.200}"))
                break
            del buffer[:end]
        return frames

    def _break(self, reason: str) -> Corrupt:
        self.broken = True
        self._buffer.clear()
        return Corrupt(reason)


def _read_from_child(data: bytearray) -> Any:
    """A frame the supervisor reads: a marshalled tuple is a Done, and must be whole."""
    if data and data[0] == _PICKLE:
        return pickle.loads(data)
    frame = marshal.loads(data)
    if type(frame) is not tuple or len(frame) != len(Done._fields):
        raise ValueError(f"a marshalled frame that is not a Done: {frame!r:.100}")
    return Done._make(frame)
