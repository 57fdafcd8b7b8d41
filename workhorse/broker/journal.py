"""The worker's journal: which of the messages it holds it has started.

A broker knows which messages a worker holds (leases, unacknowledged deliveries), never
which of them a child started. When a worker dies without a word (SIGKILL, the OOM
killer), only a message that may have started is charged a delivery (docs/delivery.md
"delivery count"); one only held did nothing wrong. So the supervisor writes, to a file of
its own, a line for each start *before* the job goes to the child: a ``write(2)`` to a
local file, which the kernel keeps when the process is killed. Whoever finds the file of a
worker that died (its restart, or any worker of the same broker on the host) reads it:

- SQLite and Redis: the dead worker's leases are put back at once, each marked by what the
  journal says (``broker.recovery``): started ones keep the delivery their take counted,
  the others are given it back and counted as held losses instead.
- RabbitMQ returns a dead connection's messages itself, marked redelivered: a worker that
  receives one looks it up in the journals of the dead workers on its host.

Records, one line each (a line cut short by a death mid-write is ignored: the write it
belonged to never returned, so the job it announced never reached a child):

    W <version> <boot id> <pid>     first line
    O <owner>    leases this worker takes carry <owner> (SQLite: the lease tokens' prefix;
                 Redis: the lease's owner mark), whatever they are, from now on
    H <key>      a message arrived (RabbitMQ, by task id: its leases carry no owner)
    S <key>      started: written before the job goes to a child
    E <key>      its task's code is over (the child reported): what is lost now is a
                 settlement, not a start
    R <key>      looking at a message that was held at an earlier death (before it is
                 decoded); ``r``: done looking

A journal that cannot be written (a full disk) is emptied at once and written no more
until it can be rewritten whole: a journal that says nothing charges every loss as a
delivery (the broker counted each take), which errs on the side of the running message;
one that lacked a start it should have held would not. A journal from before the host's
last boot is not trusted (the kernel's copy of the file is gone with a power loss).
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kombu.message import Message

from ..protocol import Verdict

log = logging.getLogger("workhorse.journal")

VERSION = 1
SUFFIX = ".journal"
#: Past this size the journal is rewritten with only what is held now.
COMPACT_AT = 1 << 20
#: After a journal could not be written: how long until it is tried again (rewritten whole).
RETRY_AFTER = 5.0
#: RabbitMQ: how long the keys of messages a lost connection took back are remembered.
RETURNED_KEPT = 3600.0

#: (key, arrived-record wanted, started, ended) for each message held now: a rewrite's content.
Entry = tuple[str, bool, bool, bool]


def boot_id() -> str:
    """This boot of the host: a journal written before it is not trusted."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def directory_for(state_dir: Path, broker_url: str) -> Path:
    """Where the journals of the workers of one broker live, on this host: a worker reads
    only the journals of its own broker (the leases they name are there)."""
    digest = hashlib.sha256(broker_url.encode()).hexdigest()[:16]
    return state_dir / "journal" / digest


def message_key(message: Message, leased: bool) -> str | None:
    """How the journal names a message: by its lease where the broker leases (SQLite,
    Redis: the delivery tag), else (RabbitMQ) by its task id; None: not journaled."""
    if leased:
        return safe_key(message.delivery_tag)
    task_id = (message.headers or {}).get("id") or (message.properties or {}).get(
        "correlation_id")
    return safe_key(task_id) if isinstance(task_id, str) else None


def safe_key(key: str | None) -> str | None:
    """A key fit for one line; None (not journaled: its losses count as deliveries) for
    one that is not."""
    if not key or "\n" in key or "\r" in key:
        return None
    return key


class Journal:
    """This worker's journal. The loop thread writes it: a start (and a look at a message
    held at an earlier death) at once, one ``write(2)`` each, carrying what waited for it;
    arrivals and the end of a look before the loop waits; the end of a task with the next
    write (should the worker die first, the task counts as started: pessimistic, never
    wrong the other way). The broker thread adds owner marks (a SQLite file opened
    anew). Its file is locked (``flock``) for as long as the worker lives: a journal whose
    lock can be taken belongs to a worker that is gone."""

    def __init__(self, path: Path, fd: int, owner: str, boot: str,
                 held_now: Callable[[], Iterable[Entry]]) -> None:
        self.path = path
        self._fd = fd
        #: This incarnation's owner mark (Redis leases carry it).
        self.owner = owner
        self._boot = boot
        self._held_now = held_now
        self._lock = threading.Lock()
        #: Records waiting for the next write (loop thread); ``_urgent``: written before
        #: the loop waits, not only with the next start.
        self._lazy: list[str] = []
        self._urgent = False
        self._size = 0
        self._owners: list[str] = []
        self.valid = True
        self._retry_at = 0.0
        #: Keys of messages a lost RabbitMQ connection took back while only held: they come
        #: back marked redelivered (key -> monotonic time it was noted).
        self.returned: dict[str, float] = {}
        self._write_now(f"{self._header()}O {owner}\n")
        self._owners.append(owner)

    @classmethod
    def create(cls, directory: Path, name: str,
               held_now: Callable[[], Iterable[Entry]]) -> Journal:
        """A new journal in ``directory``, locked; raises OSError if it cannot be made."""
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = directory / f"{_safe_name(name)}.{os.getpid()}{SUFFIX}"
        fd = _open_locked(path, os.O_EXCL)
        owner = f"{_safe_name(name)}/{os.getpid()}/{secrets.token_hex(4)}"
        try:
            return cls(path, fd, owner, boot_id(), held_now)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise

    def _header(self) -> str:
        return f"W {VERSION} {self._boot} {os.getpid()}\n"

    # -- records
    def owned(self, owner: str) -> None:
        """Any thread, at once: leases taken from now on carry ``owner`` (a SQLite
        opening's token prefix)."""
        with self._lock:
            if owner not in self._owners:
                self._owners.append(owner)
            if self.valid:
                self._write_now(f"O {owner}\n")

    def arrived(self, key: str) -> None:
        """A message whose lease carries no owner mark (RabbitMQ) arrived."""
        self._lazy.append(f"H {key}\n")
        self._urgent = True

    def started(self, key: str) -> None:
        """Before a job goes to its child. Returns once the start is in the journal, or the
        journal is emptied (it then charges every loss): never with the journal saying
        "held" of a message about to start. Raises only if neither could be done (the job
        must then not start)."""
        self._write(f"S {key}\n")

    def reading(self, key: str) -> None:
        """Before looking at a message that was held at an earlier death."""
        self._write(f"R {key}\n")

    def done_reading(self) -> None:
        self._lazy.append("r\n")
        self._urgent = True

    def ended(self, key: str) -> None:
        """The task's code is over."""
        self._lazy.append(f"E {key}\n")

    def flush(self) -> None:
        """Loop thread, before it looks at what arrived and before it waits: arrivals and
        the end of a look, and a rewrite when the file grew past COMPACT_AT (or could not
        be written before)."""
        if self._urgent:
            self._write(None)
        if self._size > COMPACT_AT or (not self.valid and time.monotonic() >= self._retry_at):
            self.rewrite()

    def note_returned(self, keys: Iterable[str]) -> None:
        """A lost RabbitMQ connection took these back while only held (forgotten after
        RETURNED_KEPT: they came back to another worker)."""
        now = time.monotonic()
        with self._lock:
            for key, when in list(self.returned.items()):
                if now - when > RETURNED_KEPT:
                    del self.returned[key]
            for key in keys:
                self.returned[key] = now

    def take_returned(self, key: str) -> bool:
        with self._lock:
            return self.returned.pop(key, None) is not None

    # -- writing
    def _write(self, line: str | None) -> None:
        """Loop thread: what waited, then ``line``, in one write."""
        if self._lazy:
            lines, self._lazy, self._urgent = self._lazy, [], False
            if line is not None:
                lines.append(line)
            line = "".join(lines)
        elif line is None:
            return
        with self._lock:
            if self.valid:
                self._write_now(line)

    def _write_now(self, text: str) -> None:
        data = text.encode()
        try:
            written = os.write(self._fd, data)
            if written != len(data):
                raise OSError(errno.ENOSPC, f"wrote {written} of {len(data)} bytes")
        except OSError as exc:
            self._empty(exc)
            return
        self._size += written

    def _empty(self, exc: OSError) -> None:
        """The journal cannot be written: empty it (that needs no room) and write nothing
        more until a rewrite succeeds. Raises if it can be neither emptied nor removed."""
        self.valid = False
        self._retry_at = time.monotonic() + RETRY_AFTER
        try:
            os.ftruncate(self._fd, 0)
        except OSError:
            self.path.unlink()      # raises if that fails too: the start must not go on
        self._size = 0
        log.warning("journal %s: cannot be written (%s); until it can, a death of this "
                    "worker counts every message it holds as a delivery, started or not "
                    "(tried again every %.0f s)", self.path, exc, RETRY_AFTER)

    def rewrite(self) -> None:
        """Write the journal afresh with only what is held now (beside it, then renamed
        over it), so it stays small; after it could not be written, this makes it whole
        again. A rewrite that fails leaves the journal as it was."""
        with self._lock:
            lines = [self._header(), *(f"O {owner}\n" for owner in self._owners)]
            for key, arrival, started, ended in self._held_now():
                if arrival:
                    lines.append(f"H {key}\n")
                if started:
                    lines.append(f"S {key}\n")
                if ended:
                    lines.append(f"E {key}\n")
            data = "".join(lines).encode()
            beside = self.path.with_name(self.path.name + ".new")
            try:
                fd = _open_locked(beside, os.O_TRUNC)
            except OSError as exc:
                self._retry_at = time.monotonic() + RETRY_AFTER
                log.debug("journal %s: cannot rewrite it (%s)", self.path, exc)
                return
            try:
                written = os.write(fd, data)
                if written != len(data):
                    raise OSError(errno.ENOSPC, f"wrote {written} of {len(data)} bytes")
                # Renamed while both are locked: a reader that opened the old file finds,
                # once it has the lock, that the path names another file, and leaves it.
                os.replace(beside, self.path)
            except OSError as exc:
                os.close(fd)
                beside.unlink(missing_ok=True)
                self._retry_at = time.monotonic() + RETRY_AFTER
                log.debug("journal %s: cannot rewrite it (%s)", self.path, exc)
                return
            os.close(self._fd)
            self._fd = fd
            self._size = written
            if not self.valid:
                self.valid = True
                log.info("journal %s: written again", self.path)

    def close(self, remove: bool) -> None:
        """At exit; ``remove`` when nothing is held any more (else whoever finds it
        recovers what is left)."""
        with self._lock:
            if remove:
                self.path.unlink(missing_ok=True)
            elif self._lazy and self.valid:
                self._write_now("".join(self._lazy))
            os.close(self._fd)
            self._fd = -1


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.@-]", "_", name)[:100] or "worker"


def _open_locked(path: Path, flags: int) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | flags, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


# ---------------------------------------------------------------------- reading
@dataclass
class Record:
    """What a dead worker's journal says (``read``)."""

    boot: str = ""
    owners: list[str] = field(default_factory=list)
    arrived: set[str] = field(default_factory=set)
    started: set[str] = field(default_factory=set)
    ended: set[str] = field(default_factory=set)
    #: The message it was looking at when it died (it had been held at an earlier death).
    reading: str | None = None

    @property
    def running(self) -> set[str]:
        """Started and not over when the worker died: these may have killed it."""
        return self.started - self.ended

    def verdict(self, key: str) -> Verdict:
        """What the death of this journal's worker costs the message behind ``key``."""
        if key in self.running:
            return Verdict(started=True, held_loss=False)
        return Verdict(started=False, held_loss=self.reading is None or self.reading == key)


def parse(text: str) -> Record | None:
    """A journal's text, read; None if it has no header (emptied, or not a journal)."""
    lines = text.split("\n")[:-1]       # the last piece has no newline: cut short, ignored
    if not lines or not lines[0].startswith("W "):
        return None
    header = lines[0].split()
    record = Record(boot=header[2] if len(header) > 2 else "")
    for line in lines[1:]:
        kind, _, key = line.partition(" ")
        if kind == "S":
            record.started.add(key)
        elif kind == "E":
            record.ended.add(key)
        elif kind == "H":
            record.arrived.add(key)
        elif kind == "O":
            record.owners.append(key)
        elif kind == "R":
            record.reading = key
        elif kind == "r":
            record.reading = None
    return record


class Dead:
    """The journal of a worker that is gone, locked by us while we read and act on it."""

    def __init__(self, path: Path, fd: int, record: Record | None) -> None:
        self.path = path
        self._fd = fd
        self.record = record

    def remove(self) -> None:
        """Done with it: what it said has been acted on."""
        self.path.unlink(missing_ok=True)
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def dead_journals(directory: Path, own: Path | None = None) -> Iterator[Dead]:
    """The journals in ``directory`` whose worker is gone (their lock can be taken), each
    locked while the caller uses it, and closed after. Those from before the host's last
    boot are removed unread (their leases run out as usual)."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return
    boot = boot_id()
    for name in names:
        if not name.endswith(SUFFIX):
            continue
        path = directory / name
        if own is not None and path == own:
            continue
        dead = _lock_if_dead(path)
        if dead is None:
            continue
        try:
            if dead.record is None or dead.record.boot != boot:
                dead.remove()
                continue
            yield dead
        finally:
            dead.close()


def _lock_if_dead(path: Path) -> Dead | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # Rewritten (renamed over) or removed since we opened it: not the file there now.
        if os.fstat(fd).st_ino != os.stat(path).st_ino:
            raise OSError(errno.ESTALE, "replaced")
        with os.fdopen(os.dup(fd), "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        os.close(fd)
        return None
    return Dead(path, fd, parse(text))
