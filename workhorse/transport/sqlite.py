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
it as direct).

Broker faults (disk full, a read-only file, I/O errors, a write lock held too long) are
raised as ``BrokerFileError``, one of the transport's ``connection_errors``: consumers
treat them as a lost connection and reconnect with back-off, kombu's retrying producers
retry and then raise them. A file deleted or replaced under its path is noticed and the
new one opened (see ``store``).
"""
from __future__ import annotations

import logging
from pathlib import Path
from collections.abc import Iterable
from queue import Empty
from typing import Any

from kombu.transport import virtual
from kombu.utils.json import dumps

from ..protocol import dead_letter_queue
from . import unreadable
from .store import BrokerFileError, Store, parse_tag

log = logging.getLogger("workhorse.transport.sqlite")

DEFAULT_VISIBILITY_TIMEOUT = 3600.0


def path_from_url(virtual_host: str | None) -> Path:
    if not virtual_host or virtual_host == "/":
        raise ValueError("sqlite broker URL needs a file: sqlite:////absolute/path.sqlite3 or "
                         "sqlite:///relative/path.sqlite3")
    return Path(virtual_host).expanduser()


class QoS(virtual.QoS):
    """Acks and rejects go to the database, by lease."""

    def ack(self, delivery_tag: str) -> None:
        self.channel.store.ack(parse_tag(delivery_tag))
        super().ack(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if requeue:       # a clean hand-back: not a delivery that counts
            self.channel.store.release([parse_tag(delivery_tag)], uncount=True)
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
        if tags:
            self.channel.store.release(parse_tag(tag) for tag in tags)
        return []


class Channel(virtual.Channel):
    QoS = QoS
    do_restore = True

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
        self.store.put(queue, dumps(message), int(priority))

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        while True:
            leased = self.store.lease(queue, self.visibility_timeout)
            if leased is None:
                raise Empty()
            ident, token, payload, deliveries = leased
            message, why = unreadable.read(payload, tagged=False)
            if message is not None:
                break
            self._bury(queue, (ident, token), payload, why or "")
        properties = message["properties"]
        properties["delivery_tag"] = f"{ident}:{token}"
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
        alive = self.store.renew((parse_tag(t) for t in tags), self.visibility_timeout)
        return [t for t in tags if parse_tag(t) not in alive]

    def forget(self, delivery_tag: str) -> None:
        """Drop a message whose lease ``renew`` reported lost, uncounting our delivery."""
        self.qos.forget(delivery_tag)

    def _size(self, queue: str) -> int:
        return self.store.size(queue)

    def _purge(self, queue: str) -> int:
        return self.store.purge(queue)

    # -- queues and routing
    def _new_queue(self, queue: str, **kwargs: Any) -> None:
        self.store.declare_queue(queue)

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return self.store.has_queue(queue)

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        self.store.delete_queue(queue)

    def queue_bind(self, queue: str, exchange: str | None = None, routing_key: str = "",
                   arguments: Any = None, **kwargs: Any) -> None:
        exchange = exchange or "amq.direct"
        super().queue_bind(queue, exchange, routing_key, arguments, **kwargs)
        routing, pattern, _ = self.typeof(exchange).prepare_bind(
            queue, exchange, routing_key, arguments)
        self.store.bind(exchange, routing, pattern or "", queue)

    def get_table(self, exchange: str) -> list[tuple[str, str, str]]:
        return self.store.bindings(exchange)

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
