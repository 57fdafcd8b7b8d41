"""Operator tools for dead-letter queues: look at them, replay, or drop messages.

Looking takes nothing away. SQLite rows and Redis lists are read where they are. RabbitMQ
cannot show a queue without delivering it: its dead letters are taken without
acknowledging and all given back when the listing is done, in the order taken. They keep
their places, but come back marked redelivered (a quorum queue also counts a delivery,
which a ``delivery-limit`` on the dead-letter queue itself would act on).

Each dead letter has an id: its task id, or ``unreadable-<hash of its bytes>`` for one that
holds no task message (an unreadable entry kept in its envelope, one written raw by an
earlier version, or a message with no task id). Requeue and purge act on the ids named, or
on every dead letter (``--all``), and report what they did to each. Unreadable ones are
never requeued, and purged only when named.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from kombu import Connection, Producer
from kombu.message import Message

from ..protocol import (
    DEAD_AT_HEADER,
    DEAD_QUEUE_HEADER,
    DEAD_REASON_HEADER,
    DEAD_TASK_HEADER,
    DEAD_WORKER_HEADER,
    DELIVERIES_HEADER,
    HELD_LOSSES_HEADER,
)
from .queues import ensure_queue
from ..transport import unreadable
from ..transport.redis import Channel as RedisChannel
from ..transport.sqlite import Channel as SqliteChannel
from .counting import BROKER_HEADERS

DEAD_HEADERS = (DEAD_AT_HEADER, DEAD_QUEUE_HEADER, DEAD_REASON_HEADER, DEAD_TASK_HEADER,
                DEAD_WORKER_HEADER)
#: The id of a dead letter that holds no task message starts so.
UNREADABLE_ID = "unreadable-"
#: Message properties a replay carries over.
_KEPT_PROPERTIES = ("correlation_id", "reply_to", "priority")

SKIPPED_UNREADABLE = "skipped: unreadable, left in place"


@dataclass(frozen=True)
class DeadLetter:
    id: str                  # the task id, or UNREADABLE_ID + a hash of its bytes
    task_id: str | None
    task: str | None
    reason: str | None
    dead_at: str | None
    queue: str | None        # the queue it died in
    worker: str | None
    args: str | None
    unreadable: bool         # holds no task message a worker could run
    raw: str | None          # unreadable: the start of its bytes


@dataclass(frozen=True)
class Content:
    """A dead letter that is a message: what a replay publishes."""

    headers: dict[str, Any]
    body: bytes | str | None
    content_type: str | None
    content_encoding: str | None
    properties: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Entry:
    letter: DeadLetter
    content: Content | None      # None: an entry no transport could read
    handle: Any                  # how its dead-letter queue finds it again


@dataclass(frozen=True)
class Done:
    """What requeue or purge did to one dead letter; ``ok`` False: what the operator named
    could not be done."""

    dead_queue: str
    id: str
    what: str
    ok: bool = True


Report = Callable[[Done], None]


class Shelf(Protocol):
    """One dead-letter queue, as the broker lets us look at it."""

    def entries(self, limit: int | None) -> list[Entry]: ...

    def held(self, entry: Entry) -> bool:
        """Does a consumer hold it right now (so it must be left alone)?"""
        ...

    def remove(self, entry: Entry) -> bool:
        """Take it out of the queue; False if it was not there any more."""
        ...


# ---------------------------------------------------------------------------- the letters
def _data(value: bytes | str | None) -> bytes:
    if value is None:
        return b""
    return value.encode("utf-8", "surrogateescape") if isinstance(value, str) else value


def _unreadable_id(data: bytes) -> str:
    return UNREADABLE_ID + hashlib.sha1(data, usedforsecurity=False).hexdigest()[:12]


def _preview(data: bytes, size: int = 100) -> str:
    return repr(data[:size]) + ("…" if len(data) > size else "")


def letter_of(content: Content) -> DeadLetter:
    h = content.headers
    task_id = h.get(DEAD_TASK_HEADER) or h.get("id")
    if not isinstance(task_id, str) or unreadable.is_envelope(h):
        task_id = None
    data = _data(content.body)
    return DeadLetter(
        id=task_id or _unreadable_id(data), task_id=task_id, task=h.get("task"),
        reason=h.get(DEAD_REASON_HEADER), dead_at=h.get(DEAD_AT_HEADER),
        queue=h.get(DEAD_QUEUE_HEADER), worker=h.get(DEAD_WORKER_HEADER),
        args=h.get("argsrepr"), unreadable=task_id is None,
        raw=None if task_id else _preview(data))


def raw_letter(raw: bytes | str, why: str) -> DeadLetter:
    """An entry no transport could read, left raw in a dead-letter queue (earlier versions
    moved unreadable Redis entries there as they were)."""
    data = _data(raw)
    return DeadLetter(id=_unreadable_id(data), task_id=None, task=None,
                      reason=f"{unreadable.UNREADABLE}: {why}", dead_at=None, queue=None,
                      worker=None, args=None, unreadable=True, raw=_preview(data))


def _stored_entry(raw: bytes | str, handle: Any, *, tagged: bool) -> Entry:
    """An entry of kombu's JSON as the SQLite and Redis transports store it."""
    message, why = unreadable.read(raw, tagged=tagged)
    if message is None:
        return Entry(raw_letter(raw, why or ""), None, handle)
    content = Content(dict(message.get("headers") or {}), unreadable.body(message),
                      message.get("content-type"), message.get("content-encoding"),
                      message["properties"])
    return Entry(letter_of(content), content, handle)


# ---------------------------------------------------------------------------- the brokers
class _StoreShelf:
    """The SQLite broker: rows read in place, removed by id."""

    def __init__(self, channel: SqliteChannel, dead_queue: str) -> None:
        self.store = channel.store
        self.dead_queue = dead_queue

    def entries(self, limit: int | None) -> list[Entry]:
        rows = self.store.browse(self.dead_queue, -1 if limit is None else limit)
        return [_stored_entry(payload, (ident, leased), tagged=False)
                for ident, payload, _, leased in rows]

    def held(self, entry: Entry) -> bool:
        return bool(entry.handle[1])

    def remove(self, entry: Entry) -> bool:
        return self.store.remove(self.dead_queue, entry.handle[0])


class _RedisShelf:
    """Redis: the lists read with LRANGE, an entry removed by its exact bytes."""

    def __init__(self, channel: RedisChannel, dead_queue: str) -> None:
        self.client = channel.client
        self.keys = channel.list_keys([dead_queue])

    def entries(self, limit: int | None) -> list[Entry]:
        found: list[Entry] = []
        for key in self.keys:
            left = None if limit is None else limit - len(found)
            if left is not None and left <= 0:
                break
            # Taken from the right: the last ``left`` entries, in the order taken.
            raws = self.client.lrange(key, 0 if left is None else -left, -1)
            found += [_stored_entry(raw, (key, raw), tagged=True) for raw in reversed(raws)]
        return found

    def held(self, entry: Entry) -> bool:
        return False     # a taken entry is no longer in its list

    def remove(self, entry: Entry) -> bool:
        key, raw = entry.handle
        return bool(self.client.lrem(key, 1, raw))


class _TakenShelf:
    """RabbitMQ (and any other broker): messages taken without acknowledging, and given
    back when done, in the order taken."""

    def __init__(self, connection: Connection, dead_queue: str, queue_type: str) -> None:
        self.channel = connection.channel()
        self.queue = ensure_queue(connection, dead_queue, queue_type)(self.channel)
        self.taken: list[Message] = []

    def entries(self, limit: int | None) -> list[Entry]:
        found: list[Entry] = []
        while limit is None or len(found) < limit:
            message = self.queue.get(no_ack=False)
            if message is None:
                break
            self.taken.append(message)
            content = Content(dict(message.headers or {}), message.body,
                              message.content_type, message.content_encoding,
                              dict(message.properties or {}))
            found.append(Entry(letter_of(content), content, message))
        return found

    def held(self, entry: Entry) -> bool:
        return False

    def remove(self, entry: Entry) -> bool:
        entry.handle.ack()
        self.taken.remove(entry.handle)
        return True

    def give_back(self) -> None:
        try:
            for message in self.taken:
                message.reject(requeue=True)
        finally:
            self.taken.clear()
            self.channel.close()     # the broker takes back whatever is still unacked


#: The type a missing RabbitMQ queue is declared as, by name (``App.queue_type``).
QueueType = Callable[[str], str]


def classic(queue: str) -> str:
    return "classic"


@contextmanager
def open_dead_queue(connection: Connection, dead_queue: str,
                    queue_type: QueueType = classic) -> Iterator[Shelf]:
    """``queue_type``: what a missing queue is declared as (RabbitMQ)."""
    channel = connection.default_channel
    if isinstance(channel, SqliteChannel):
        yield _StoreShelf(channel, dead_queue)
    elif isinstance(channel, RedisChannel):
        yield _RedisShelf(channel, dead_queue)
    else:
        shelf = _TakenShelf(connection, dead_queue, queue_type(dead_queue))
        try:
            yield shelf
        finally:
            shelf.give_back()


# ---------------------------------------------------------------------------- the commands
def list_dead(connection: Connection, dead_queue: str, limit: int = 100,
              queue_type: QueueType = classic) -> list[DeadLetter]:
    """The first ``limit`` dead letters, in the order they would be delivered; nothing is
    removed or moved."""
    with open_dead_queue(connection, dead_queue, queue_type) as shelf:
        return [entry.letter for entry in shelf.entries(limit)]


def requeue_dead(connection: Connection, dead_queue: str, ids: Collection[str] | None,
                 default_queue: str, report: Report,
                 queue_type: QueueType = classic) -> None:
    """Publish the dead letters named by ``ids`` (None: all) back to the queue they died in,
    as fresh deliveries (their delivery count starts again), then remove them from the
    dead-letter queue. Unreadable ones stay where they are."""
    producer = Producer(connection.channel())
    ready: set[str] = set()
    with open_dead_queue(connection, dead_queue, queue_type) as shelf:
        for entry in shelf.entries(None):
            letter = entry.letter
            if ids is not None and letter.id not in ids:
                continue
            named = ids is not None
            if entry.content is None or letter.unreadable:
                report(Done(dead_queue, letter.id, SKIPPED_UNREADABLE, ok=not named))
                continue
            if shelf.held(entry):
                report(Done(dead_queue, letter.id, "skipped: a consumer holds it right now, "
                            "left in place", ok=not named))
                continue
            target = letter.queue or default_queue
            if target not in ready:
                ensure_queue(connection, target, queue_type(target))
                ready.add(target)
            _replay(producer, entry.content, target)
            # After the copy is out: a crash in between duplicates, never loses.
            if shelf.remove(entry):
                report(Done(dead_queue, letter.id, f"requeued to {target}"))
            else:
                report(Done(dead_queue, letter.id, f"requeued to {target}, but it had left "
                            f"{dead_queue} meanwhile (taken by another consumer?)", ok=False))


def _replay(producer: Producer, content: Content, target: str) -> None:
    headers = {k: v for k, v in content.headers.items()
               if k not in DEAD_HEADERS and k not in BROKER_HEADERS and k != "redelivered"}
    headers[DELIVERIES_HEADER] = 0      # an operator's replay: fresh counts (a suspect
    headers.pop(HELD_LOSSES_HEADER, None)   # stays one: if it kills, it kills alone)
    properties = {k: content.properties[k] for k in _KEPT_PROPERTIES
                  if content.properties.get(k) is not None}
    producer.publish(content.body, exchange="", routing_key=target, headers=headers,
                     content_type=content.content_type,
                     content_encoding=content.content_encoding, delivery_mode=2,
                     **properties)


def purge_dead(connection: Connection, dead_queue: str, ids: Collection[str] | None,
               report: Report, queue_type: QueueType = classic) -> None:
    """Remove the dead letters named by ``ids``; None: every one but the unreadable, which
    are removed only when named."""
    with open_dead_queue(connection, dead_queue, queue_type) as shelf:
        for entry in shelf.entries(None):
            letter = entry.letter
            if ids is None and letter.unreadable:
                report(Done(dead_queue, letter.id, SKIPPED_UNREADABLE + " (name it to purge it)"))
                continue
            if ids is not None and letter.id not in ids:
                continue
            if not shelf.held(entry) and shelf.remove(entry):
                report(Done(dead_queue, letter.id, "purged"))
            else:
                report(Done(dead_queue, letter.id, "left in place: a consumer holds it right "
                            "now, or it is gone", ok=ids is None))
