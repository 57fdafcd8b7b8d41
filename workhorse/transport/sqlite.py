"""workhorse's embedded broker: a kombu virtual transport over one SQLite file.

    Connection("sqlite:////var/lib/workhorse/broker.sqlite3")   # absolute path
    Connection("sqlite:///broker.sqlite3")                      # relative to the CWD

At-least-once, unlike kombu's SQLAlchemy transport (which hides consumed rows forever) and
filesystem transport (which deletes on read): a consumed message is *leased* for
``visibility_timeout`` seconds. ``ack`` deletes it, ``reject(requeue=True)`` releases it
(first in line again), ``reject()`` deletes it, and a lease that expires — its consumer
died — makes it available again. Closing a channel releases the leases it holds at once.

Each lease has its own delivery tag, ``"<id>:<token>"``, so a late ack from a lost lease can
never delete the copy someone else now holds. A consumed message's ``delivery_info`` carries
``delivery_count``: its delivery count, this lease included, added in the same statement
that leases it, so it counts even if its consumer is killed outright. ``reject(requeue=True)``
(a clean hand-back) and ``Channel.forget`` (a lease lost by a live consumer) take it back;
a lease that expires, or a channel closed holding it, leaves it counted. A message counted
before (``delivery_count`` > 1) is marked ``redelivered`` in ``delivery_info`` and in its
headers, as kombu's Redis transport marks restored messages.

A row kombu cannot read (its payload is not kombu's JSON: written by another program or by
hand) is replaced, in the transaction that checks our lease, by a readable envelope at the
end of ``<queue>.dead`` (``workhorse.transport.unreadable``).

Routing: publishing to the anonymous exchange ``""`` puts the message straight into the
queue named by the routing key (what Celery and workhorse do by default). Bindings made by
``queue_bind`` are stored in the file, so direct, topic and fanout routing work across
processes; an exchange's *type* is known only to processes that declared it (others treat
it as direct). A fanout exchange puts a copy in each bound queue: remote control's
broadcasts. A worker's mailbox queue outlives the worker (no expiry in the file); the
worker purges it when it starts, so it never answers commands sent while it was down.

Broker faults (disk full, a read-only file, I/O errors, a write lock held too long) are
raised as ``BrokerFileError``, one of the transport's ``connection_errors``: consumers
treat them as a lost connection and reconnect with back-off, kombu's retrying producers
retry and then raise them. A file deleted or replaced under its path is noticed and the
new one opened (see ``store``).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from collections.abc import Callable, Iterable, Sequence
from queue import Empty
from typing import Any

from kombu.transport import virtual
from kombu.utils.json import dumps

from ..protocol import Verdict, after_loss, dead_letter_queue
from . import fenced, unreadable
from .backlog import Backlog, stamp_properties
from .delivering import Delivering
from .store import BrokerFileError, Store, parse_tag
from .wake import Notifier

log = logging.getLogger("workhorse.transport.sqlite")

DEFAULT_VISIBILITY_TIMEOUT = 3600.0


def path_from_url(virtual_host: str | None) -> Path:
    if not virtual_host or virtual_host == "/":
        raise ValueError("sqlite broker URL needs a file: sqlite:////absolute/path.sqlite3 or "
                         "sqlite:///relative/path.sqlite3")
    return Path(virtual_host).expanduser()


class QoS(virtual.QoS):
    """Acks and rejects go to the database, by lease."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: tag -> when its lease was taken or last renewed (epoch seconds, read before
        #: the transaction that set it: never later than the lease's own start).
        self._leased_at: dict[str, float] = {}

    def _flush(self) -> None:
        for tag in self._dirty:
            self._leased_at.pop(tag, None)
        super()._flush()

    def ack(self, delivery_tag: str) -> None:
        self.channel.store.ack(parse_tag(delivery_tag))
        super().ack(delivery_tag)

    def ack_many(self, tags: list[str]) -> None:
        """Ack several in one transaction (the broker thread's acks of one turn)."""
        self.channel.store.ack_many([parse_tag(tag) for tag in tags])
        for tag in tags:
            super().ack(tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if requeue:       # a clean hand-back: not a delivery that counts
            self.channel.store.release([parse_tag(delivery_tag)], uncount=True)
            self.channel.connection.wake.notify()
        else:
            self.channel.store.ack(parse_tag(delivery_tag))
        self._quick_ack(delivery_tag)

    def forget(self, delivery_tag: str) -> None:
        """Our lease was lost, though we live: drop it, and take back the count it added."""
        self.channel.store.forget(parse_tag(delivery_tag))
        self._quick_ack(delivery_tag)

    def restore_unacked(self) -> list[Any]:
        """Release every lease this channel holds (on close), instead of re-inserting copies.
        They stay counted: the channel closed without settling them."""
        self._flush()
        tags = list(self._delivered)
        self._delivered.clear()
        self._leased_at.clear()
        if tags:
            self.channel.store.release(parse_tag(tag) for tag in tags)
            self.channel.connection.wake.notify()
        return []


class Channel(Delivering):
    QoS = QoS
    do_restore = True
    #: A fanout exchange (Celery's broadcast mailbox, ``celery.pidbox``) puts a copy in
    #: every queue bound to it, bindings being stored in the file.
    supports_fanout = True

    @property
    def store(self) -> Store:
        return self.connection.store

    @property
    def visibility_timeout(self) -> float:
        options = self.connection.client.transport_options
        return float(options.get("visibility_timeout", DEFAULT_VISIBILITY_TIMEOUT))

    # -- messages
    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        priority = (message.get("properties") or {}).get("priority") or 0
        ticket = fenced.current()
        if ticket is None:
            self.store.put(queue, dumps(message), int(priority))
        else:
            self.store.put_fenced(queue, dumps(message), int(priority), ticket)
        self.connection.wake.notify()

    def fence_records(self, names: Iterable[str]) -> dict[str, fenced.Record]:
        """The periodic tasks' records (``transport.fenced``) for ``names``."""
        return self.store.fence_records(names)

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        while True:
            now = time.time()
            leased = self.store.lease(queue, self.visibility_timeout)
            if leased is None:
                raise Empty()
            ident, token, payload, deliveries = leased
            message, why = unreadable.read(payload, tagged=False)
            if message is not None:
                return self._leased(message, ident, token, deliveries, now)
            self._bury(queue, (ident, token), payload, why or "")

    #: At most this many messages per take (one transaction), whatever the room.
    MAX_TAKE = 64
    _rotation = 0
    #: Unreadable entries a take that must not wait leased: (queue, lease, payload, why).
    _unburied: list[tuple[str, tuple[int, str], str, str]] = []

    def take(self, limit: int = 1, acks: Sequence[str] = (), *, wait: bool = True) -> int:
        """Ack ``acks``, then lease up to ``limit`` messages from the queues consumed here,
        in one transaction (the queues in turn, each emptied before the next), and deliver
        them all to their consumers at once, so none waits here unseen. Returns how many
        were taken (0: none, or ``limit`` is 0). ``wait=False``: raise StoreBusy, having
        changed nothing, rather than wait for the file (``Store.lease_many``); an
        unreadable entry it took waits, leased, for ``bury_unburied`` (or the next take
        that may wait)."""
        if wait and self._unburied:
            self.bury_unburied()
        queues = list(self._active_queues) if limit > 0 else []
        if not queues and not acks:
            return 0
        start = self._rotation % len(queues) if queues else 0
        now = time.time()
        taken = self.store.lease_many(queues[start:] + queues[:start], self.visibility_timeout,
                                      min(limit, self.MAX_TAKE) if queues else 0,
                                      [parse_tag(tag) for tag in acks], wait=wait)
        for tag in acks:
            virtual.QoS.ack(self.qos, tag)
        if not taken:
            return 0
        self._rotation = queues.index(taken[-1][0]) + 1 if taken[-1][0] in queues else 0
        unreadable_taken = []
        for queue, ident, token, payload, deliveries in taken:   # delivered first, buried after
            message, why = unreadable.read(payload, tagged=False)
            if message is None:
                unreadable_taken.append((queue, (ident, token), payload, why or ""))
            else:
                self.deliver_taken(self._leased(message, ident, token, deliveries, now),
                                   queue)
        if wait:
            for queue, lease, payload, why in unreadable_taken:
                self._bury(queue, lease, payload, why)
        else:       # burying may wait: leased to us, it waits for bury_unburied
            self._unburied = self._unburied + unreadable_taken
        return len(taken)

    def bury_unburied(self) -> None:
        """Bury the unreadable entries a take that must not wait leased."""
        unburied, self._unburied = self._unburied, []
        for queue, lease, payload, why in unburied:
            self._bury(queue, lease, payload, why)

    def _leased(self, message: dict[str, Any], ident: int, token: str,
                deliveries: int, leased_at: float) -> dict[str, Any]:
        """The raw message as kombu delivers it: the lease as its tag, the count."""
        properties = message["properties"]
        properties["delivery_tag"] = tag = f"{ident}:{token}"
        self.qos._leased_at[tag] = leased_at
        info = properties.get("delivery_info")
        if not isinstance(info, dict):
            info = properties["delivery_info"] = {}
        info["delivery_count"] = deliveries
        if deliveries > 1:
            info["redelivered"] = True
            message["headers"] = {**(message.get("headers") or {}), "redelivered": True}
        return message

    def _bury(self, queue: str, lease: tuple[int, str], payload: bytes | str, why: str) -> None:
        """Dead-letter an entry that cannot be delivered, in its readable envelope."""
        dead = dead_letter_queue(queue)
        if self.store.bury(lease, dead, unreadable.envelope(payload, why, queue)):
            log.error("an unreadable entry on %s (%s) was dead-lettered to %s in an "
                      "envelope: %.200r", queue, why, dead, payload)

    def renew(self, tags: Iterable[str]) -> list[str]:
        """Extend the leases behind these delivery tags; return the tags whose lease is lost."""
        tags = list(tags)
        now = time.time()
        alive = self.store.renew((parse_tag(t) for t in tags), self.visibility_timeout)
        leased_at = self.qos._leased_at
        lost = []
        for tag in tags:
            if parse_tag(tag) in alive:
                if tag in leased_at:
                    leased_at[tag] = now
            else:
                lost.append(tag)
                leased_at.pop(tag, None)
        return lost

    def lease_set_at(self, tag: str) -> float | None:
        """When the lease behind ``tag`` was taken or last renewed (epoch seconds); None
        if this channel holds no such lease (settled, or found lost)."""
        qos = self._qos     # (kombu's property makes one where there is none: not here)
        return None if qos is None else qos._leased_at.get(tag)

    def forget(self, delivery_tag: str) -> None:
        """Drop a message whose lease ``renew`` reported lost, uncounting our delivery."""
        self.qos.forget(delivery_tag)

    def recover(self, owners: Iterable[str], judge: Callable[[str], Verdict]) -> int:
        """Put back at once what a worker that is gone held, its leases known by their
        tokens' prefix (``owners``), each as ``judge(delivery tag)`` says: a start keeps
        the delivery its take counted; a message only held gets it back, and its headers
        count the held loss (``protocol.after_loss``). Returns how many."""
        def rewrite(tag: str, payload: str) -> tuple[str, bool]:
            verdict = judge(tag)
            message, _ = unreadable.read(payload, tagged=False)
            if message is not None:     # (an unreadable one is buried when taken again)
                message["headers"] = after_loss(message.get("headers"), verdict)
                payload = dumps(message)
            return payload, not verdict.started
        with unreadable.headroom():
            recovered = self.store.recover(owners, rewrite)
        if recovered:
            self.connection.wake.notify()
        return recovered

    def _size(self, queue: str) -> int:
        return self.store.size(queue)

    def backlog(self, queue: str) -> Backlog:
        """``queue``'s ready messages and when the oldest was put (its row's time, so a
        producer that stamps nothing is covered too)."""
        ready, oldest = self.store.backlog(queue)
        return Backlog(ready, oldest)

    def _inplace_augment_message(self, message: dict[str, Any], exchange: str,
                                 routing_key: str) -> None:
        super()._inplace_augment_message(message, exchange, routing_key)
        stamp_properties(message["properties"])

    def _purge(self, queue: str) -> int:
        return self.store.purge(queue)

    # -- queues and routing
    def _new_queue(self, queue: str, **kwargs: Any) -> None:
        self.store.declare_queue(queue)

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return self.store.has_queue(queue)

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        self.store.delete_queue(queue)

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str | None,
                    queue: str) -> None:
        """kombu's ``queue_bind`` calls this (``supports_fanout``): stored in the file."""
        self.store.bind(exchange, routing_key, pattern or "", queue)

    def get_table(self, exchange: str) -> list[tuple[str, str, str]]:
        return self.store.bindings(exchange)

    def _put_fanout(self, exchange: str, message: dict[str, Any], routing_key: str,
                    **kwargs: Any) -> None:
        for queue in sorted({queue for _, _, queue in self.get_table(exchange)}):
            self._put(queue, message)

    def close(self) -> None:
        super().close()


class Transport(virtual.Transport):
    Channel = Channel
    driver_type = "sqlite"
    driver_name = "sqlite3"
    polling_interval = 0.05
    default_port = None
    # kombu's stubs type this as a 1-tuple.
    connection_errors = (*virtual.Transport.connection_errors,  # type: ignore[assignment]
                         BrokerFileError)
    channel_errors = virtual.Transport.channel_errors

    def __init__(self, client: Any, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        self.store = Store(path_from_url(client.virtual_host))
        #: Tells the workers consuming this file that a message is there (wake.py).
        self.wake = Notifier(self.store.path)

    def establish_connection(self) -> Any:
        # Open the file now: one that cannot be opened fails the connection, not later calls.
        self.store.check()
        return super().establish_connection()

    def driver_version(self) -> str:
        import sqlite3
        return sqlite3.sqlite_version

    def close_connection(self, connection: Any) -> None:
        super().close_connection(connection)
        self.store.close()
        self.wake.close()
