"""The supervisor's broker connection: fetching messages and settling them.

It never blocks waiting for messages. The loop watches ``fds()`` and calls ``on_readable``
when one is readable (and, for brokers without a socket to watch, ``poll`` on a short
timer); both drain what is already there with kombu's ``drain_events(timeout=0)``.

A lost connection is never raised into the loop: the consumer forgets the connection and
calls ``on_lost``; the supervisor reconnects with ``connect`` on its own schedule. The
broker objects of the old connection are not closed (closing a kombu Redis channel puts
back every message it delivered, though our running tasks still hold them): messages
received through it are settled, and their leases renewed, through their own channel,
which on Redis reconnects by itself once the server answers again.
"""
from __future__ import annotations

import logging
from collections import deque
from time import monotonic
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from functools import partial
from typing import Any, NamedTuple

from kombu import Connection, Consumer, Producer, Queue
from kombu.message import Message

from ..app import App
from .connection import BROKER_TIMEOUT
from .queues import (
    DELAY_LEVELS,
    DeadLetterTarget,
    bind_delayed_delivery,
    declare_delayed_delivery,
    declared_type,
    delay_level,
    delayed_routing_key,
    ensure_queue,
    probe_argument,
    rabbitmq_dead_letter_target,
    undelayed,
)
from ..urls import redact
from ..protocol import (
    DEAD_AT_HEADER,
    DEAD_QUEUE_HEADER,
    DEAD_REASON_HEADER,
    DEAD_TASK_HEADER,
    DEAD_WORKER_HEADER,
    DELIVERIES_HEADER,
    HELD_LOSSES_HEADER,
    carried_held_losses,
    Verdict,
    carried_deliveries,
    after_loss,
    dead_letter_queue,
)
from ..transport.store import StoreBusy
from .counting import BROKER_HEADERS, RabbitMQ, earlier_deliveries, parse_version
from .journal import Journal, message_key
from .drivers import POLL_INTERVAL, Capabilities, Driver, driver_for
from .recovery import LOOK_INTERVAL, DeadWorkers

log = logging.getLogger("workhorse.consumer")

#: Message properties carried over when a message is re-published (dead-letter, requeue).
_KEPT_PROPERTIES = ("correlation_id", "reply_to", "priority")

OnMessage = Callable[[str, Message], None]
OnLost = Callable[[BaseException], None]


#: What a worker between connections can do: nothing.
_NONE = Capabilities()


class BrokerUnavailable(ConnectionError):
    """The worker is between broker connections."""


class BrokerConsumer:
    def __init__(self, app: App, queues: list[str], on_message: OnMessage,
                 on_lost: OnLost) -> None:
        self.app = app
        #: This worker's journal: which held messages it started (``broker.journal``),
        #: and the dead workers' journals beside it (``use_journal``).
        self.journal: Journal | None = None
        self.dead_workers: DeadWorkers | None = None
        self.queues = list(queues)      # this thread's: add_queue/cancel_queue change it
        self.on_message = on_message
        self.on_lost = on_lost
        #: Bumped by each connect: periodic work for an older connection stops.
        self.generation = 0
        self.connected_at = 0.0     # monotonic time of the last connect
        #: Does the broker lease what we hold (SQLite, Redis)? Does it push messages up to a
        #: credit and take back what a lost connection held (AMQP)? Known once connected.
        self.leased = False
        self.push = False
        self._channels: set[Any] = set()      # the current connection's channels
        self._error_types: tuple[type[BaseException], ...] = ()
        self.connection: Connection | None = None
        self.consumers: list[Consumer] = []
        self.producer: Producer | None = None
        self.driver: Driver | None = None
        self.consuming = False
        self.paused = False
        self.credit = 0
        self.dead_letter_targets: dict[str, DeadLetterTarget | None] = {}
        #: RabbitMQ: each consumed queue's type (classic, quorum), as RabbitMQ has it.
        self.queue_types: dict[str, str] = {}
        #: RabbitMQ with a quorum queue: each consumer's prefetch (0: a channel-wide
        #: credit instead), and whether consuming pauses for want of room (``_pace``).
        self.per_consumer = 0
        self._paced = False
        #: Resized: the consumers wait for room for their whole new share (``resize``).
        self._restarting = False
        self._room: Callable[[], int] = lambda: 0
        self._queues_ready: set[str] = set()
        #: The RabbitMQ server's version, which says what its delivery marks mean (None:
        #: not RabbitMQ; SQLite and Redis count deliveries themselves).
        self.rabbitmq: RabbitMQ | None = None

    # -- lifecycle
    def connect(self, prefetch_count: int, room: Callable[[], int], *,
                retries: int = 3, acked_running: int = 0) -> None:
        """Connect and start consuming. ``room``: how many more messages the supervisor's
        own count says it may take (brokers we poll ask it before each fetch);
        ``acked_running``: how many of the window's running messages may be acked already
        (acked at start), which a per-consumer prefetch must leave room for. Raises when
        the broker cannot be reached (after ``retries`` quick retries of each URL of a
        failover list); nothing is kept of a connection that failed half-way, so the next
        attempt starts afresh."""
        # RabbitMQ: heartbeats (broker_heartbeat), checked from the loop: a silent broker
        # is noticed and the connection replaced instead of waited on forever.
        connection = self.app.connection(heartbeat=self.app.settings.broker_heartbeat)
        try:
            connection.ensure_connection(max_retries=connection.retries(retries + 1),
                                         interval_start=0.2,
                                         interval_step=0.5)
            channel = connection.channel()
            driver = driver_for(connection, channel, room)
            if self.journal is not None:
                driver.own_leases(self.journal)
            targets = {q: rabbitmq_dead_letter_target(connection, q) for q in self.queues}
            consumers = [
                Consumer(channel, [self._queue(connection, q)],
                         on_message=partial(self.on_message, q), no_ack=False)
                for q in self.queues]
            capabilities = driver.capabilities
            per_consumer = 0
            if capabilities.push:
                per_consumer = self._per_consumer(prefetch_count - acked_running)
                if per_consumer:
                    driver.send_qos(channel, per_consumer, per_consumer=True)
                else:
                    driver.send_qos(channel, prefetch_count)
            else:
                # kombu's virtual transports fetch only while their QoS says it can
                # consume; let it ask the supervisor, whose count is exact in either mode.
                channel.qos.can_consume = lambda: room() > 0
            for consumer in consumers:
                consumer.consume()
            producer = Producer(connection.channel())
        except BaseException:
            _discard(connection)
            raise
        for queue, target in targets.items():
            if target is not None:
                log.info("queue %s dead-letters to its RabbitMQ exchange %r", queue,
                         target.exchange)
        self.connection, self.driver, self.consumers, self.producer = (
            connection, driver, consumers, producer)
        self.dead_letter_targets = targets
        self._queues_ready = set(self.queues)
        self.credit = prefetch_count
        self.per_consumer = per_consumer
        self._room = room
        self._channels = {channel, producer.channel}
        self.leased = capabilities.leased
        self.push = capabilities.push
        self.rabbitmq = _rabbitmq(connection) if capabilities.push else None
        self._error_types = self._errors()
        self.consuming = True
        self.paused = self._restarting = False
        self.generation += 1
        self.connected_at = monotonic()
        self.recover()

    def _per_consumer(self, base: int) -> int:
        """RabbitMQ, where a consumed queue is a quorum queue (which refuses a channel-wide
        prefetch): each consumer's own prefetch, fixed when it starts, so that all of them
        together never deliver past the window: ``base`` (the window, less the running
        messages that may be acked already) shared among the queues. 0: the channel-wide
        credit is used (every queue classic). At least 1: where the window is smaller
        than the queues (or than what acks at start leave), consuming pauses whenever
        there is no room for one more from each (``set_credit``)."""
        if not any(kind == "quorum" for kind in self.queue_types.values()):
            return 0
        share = max(1, base // max(1, len(self.queues)))
        self._paced = base < len(self.queues)
        return share

    def use_journal(self, journal: Journal) -> None:
        """Before the first connect: the worker's journal, and those of the dead beside it."""
        self.journal = journal
        self.dead_workers = DeadWorkers(journal)

    def recover(self) -> None:
        """SQLite, Redis: put back at once what the workers of this broker on this host
        that died held (their journals say which of those they started); RabbitMQ, which
        gave it back already, only reads their journals (``count_delivery``)."""
        deaths = self.dead_workers
        if deaths is None or self.connection is None:
            return
        try:
            if self.push:
                deaths.read()
            else:
                channel: Any = self.consumers[0].channel if self.consumers else None
                if hasattr(channel, "recover"):
                    self._guarded(deaths.put_back, channel.recover)
        except Exception as exc:   # tried again at the next look
            log.error("recovering what dead workers held failed (tried again in %.0f s): %r",
                      LOOK_INTERVAL, exc, exc_info=exc)

    def journal_key(self, message: Message) -> str | None:
        return message_key(message, self.leased)

    def _queue(self, connection: Connection, name: str) -> Queue:
        """The queue ``name`` to consume, declared as the settings say if it is missing; on
        RabbitMQ its type, which a queue that exists keeps (said once if it differs)."""
        wanted = self.app.queue_type(name)
        queue = ensure_queue(connection, name, wanted)
        if connection.transport.driver_type != "amqp":
            return queue
        if self.queue_types.get(name) is None:
            existed = getattr(queue, "no_declare", False)
            actual = declared_type(connection, name) if existed else wanted
            if actual != wanted:
                log.warning("queue %s is a %s queue on RabbitMQ, not %s as queue_type says: "
                            "it is consumed as it is (delete it, with nothing in it, to have "
                            "it declared anew)", name, actual, wanted)
            self.queue_types[name] = actual
            if actual == "quorum":
                self._quorum_queue(connection, name, existed)
        if self.queue_types[name] == "quorum":
            # At every connect: a queue deleted and declared again meanwhile has lost its
            # binding, and what comes out of the delay levels for it would go nowhere.
            bind_delayed_delivery(connection, name, name)
        return queue

    def _quorum_queue(self, connection: Connection, name: str, existed: bool) -> None:
        """Once per queue and worker: what Celery's countdown tasks need (the delay levels;
        ``_queue`` binds the queue to their end), and a word on a delivery-limit that could
        drop messages or dead-letter a message before workhorse's own bounds do."""
        declare_delayed_delivery(connection, "quorum")
        limit = probe_argument(connection, name, "x-delivery-limit") if existed else None
        if isinstance(limit, str) and limit.isdigit():
            limit = int(limit)      # (a quorum queue's refusal says '5', untyped)
        if isinstance(limit, int) and limit >= 0:
            target = rabbitmq_dead_letter_target(connection, name)
            backstop = self.app.settings.max_held_losses
            if target is None:
                log.warning("quorum queue %s has x-delivery-limit = %d and no dead-letter "
                            "exchange: RabbitMQ drops a message returned more often than that "
                            "(each worker that dies holding it returns it). Remove the limit, "
                            "or give the queue a dead-letter exchange", name, limit)
            elif limit < backstop:
                log.warning("quorum queue %s has x-delivery-limit = %d, below workhorse's "
                            "max_held_losses (%d): RabbitMQ dead-letters a message held by "
                            "that many workers that died, before workhorse's own bound", name,
                            limit, backstop)

    @property
    def connected(self) -> bool:
        return self.connection is not None

    def where(self) -> str:
        """The broker's URL as logs show it (no password)."""
        return redact(self.app.settings.broker_url)

    def server(self) -> str:
        """The server of a failover list this is connected to (host:port), or ''."""
        connection = self.connection
        if connection is None or not connection.alt or "master_name" in (
                connection.transport_options or {}):
            return ""       # (Sentinel: the list is of sentinels, not of brokers)
        return f"{connection.hostname}:{connection.port}"

    def describe_failure(self, exc: BaseException) -> str:
        """Why connecting failed, in the words an operator needs: a refused login is not
        an unreachable broker."""
        if _is_auth_failure(exc):
            return f"authentication refused ({type(exc).__name__}: {exc}); check the " \
                   "user and password in broker_url"
        return f"unreachable ({type(exc).__name__}: {exc})"

    def _errors(self) -> tuple[type[BaseException], ...]:
        assert self.connection is not None
        return self.connection.connection_errors + self.connection.channel_errors

    def is_connection_error(self, exc: BaseException) -> bool:
        """Is ``exc`` the broker's connection failing (expected while it is down)?"""
        return isinstance(exc, self._error_types + (BrokerUnavailable,))

    def _lost(self, exc: BaseException) -> None:
        """The connection is gone, or one of its channels is: forget it and tell the
        supervisor. RabbitMQ's is closed, so the broker takes back all it held even when
        only a channel failed; a kombu Redis connection is not (see the module docstring)
        but its idle waiters are."""
        if self.connection is None:
            return
        if self.push:
            _discard(self.connection)
        elif self.driver is not None:
            try:
                self.driver.finish()
            except Exception:  # noqa: BLE001 - closing what is broken already
                pass
        self.connection = None
        self.driver = None
        self.consumers = []
        self.producer = None
        self._channels = set()
        self.consuming = False
        self.paused = self._restarting = False
        self.on_lost(exc)

    def _guarded(self, function: Callable[..., Any], *args: Any) -> Any:
        """Call a fetch-side function; a lost connection is reported, not raised."""
        if self.connection is None:
            return None
        try:
            return function(*args)
        except self._errors() as exc:
            self._lost(exc)
            return None

    def _settling(self, channel: Any, function: Callable[[], Any]) -> Any:
        """Call a settle-side function on ``channel``, returning what it returns; errors
        are raised (the caller logs them), and one on the current connection also counts
        as losing it."""
        try:
            return function()
        except BaseException as exc:
            if (self.connection is not None and channel in self._channels
                    and isinstance(exc, self._errors())):
                self._lost(exc)
            raise

    def close(self) -> None:
        """Close the connection; the broker gets back whatever is still unacknowledged."""
        if self.driver is not None:
            try:
                self.driver.finish()
            except Exception as exc:  # noqa: BLE001 - closing anyway
                log.warning("could not collect an in-flight fetch before closing: %r", exc)
        if self.connection is not None:
            try:
                self.connection.release()
            except Exception as exc:  # noqa: BLE001 - closing a broken connection
                log.debug("closing the broker connection: %r", exc)
        self.connection = None
        self.driver = None
        self.consuming = False

    def add_queue(self, queue: str) -> None:
        """Consume ``queue`` too, now and after every reconnect (remote control)."""
        if queue in self.queues:
            return
        self.queues.append(queue)
        connection = self.connection
        if connection is None or not self.consuming or not self.consumers:
            return          # the next connect consumes it
        consumer = Consumer(self.consumers[0].channel, [self._queue(connection, queue)],
                            on_message=partial(self.on_message, queue), no_ack=False)
        if self.push:
            self.dead_letter_targets[queue] = rabbitmq_dead_letter_target(connection, queue)
        self._guarded(consumer.consume)
        self.consumers.append(consumer)
        self._queues_ready.add(queue)

    def cancel_queue(self, queue: str) -> None:
        """Stop consuming ``queue`` (remote control); what was taken from it stays held and
        is settled as usual."""
        if queue not in self.queues:
            return
        self.queues.remove(queue)
        for consumer in list(self.consumers):
            if any(q.name == queue for q in consumer.queues or ()):
                self._guarded(consumer.cancel)
                self.consumers.remove(consumer)

    def cancel(self) -> None:
        """Stop fetching; what is already held stays held."""
        if not self.consuming:
            return
        self.consuming = False
        for consumer in self.consumers:
            self._guarded(consumer.cancel)

    # -- fetching
    def tick(self) -> None:
        """Before each wait: let the driver (re)issue what it needs, e.g. Redis's BRPOP."""
        if self.driver is not None and self.consuming:
            self._guarded(self.driver.tick)

    def fds(self) -> set[int]:
        """The sockets to watch right now (Redis changes them on reconnect)."""
        return self.driver.fds() if self.driver is not None else set()

    def on_readable(self, fd: int) -> None:
        if self.driver is not None:
            self._guarded(self.driver.on_readable, fd)

    @property
    def capabilities(self) -> Capabilities:
        """What the broker of the current connection does (none while there is none)."""
        return self.driver.capabilities if self.driver is not None else _NONE

    @property
    def takes_with_acks(self) -> bool:
        """Do acks and a take share one round trip (SQLite, Redis)?"""
        return self.capabilities.takes_with_acks

    @property
    def polled(self) -> bool:
        """True for brokers with no socket to watch (SQLite, memory): call ``poll()``."""
        return self.capabilities.polled

    def poll(self) -> None:
        if self.driver is not None and self.consuming:
            self.driver.polled_at = monotonic()
            if self._restarting:    # (a safety net: the credit's changes pace it)
                self._pace()
            self._guarded(self.driver.poll)

    @property
    def poll_interval(self) -> float:
        return self.driver.poll_interval if self.driver is not None else POLL_INTERVAL

    def poll_due(self, now: float) -> bool:
        """Is the driver's periodic poll due (see POLL_INTERVAL, SAFETY_POLL)?"""
        driver = self.driver
        return driver is not None and now - driver.polled_at >= driver.poll_interval

    def periodic(self) -> list[tuple[float, Callable[[], None]]]:
        """Housekeeping the current connection's driver needs every so often, and looking
        for the journals of workers that died."""
        if self.driver is None:
            return []
        return [(interval, partial(self._guarded, function))
                for interval, function in self.driver.periodic()] + [
                    (LOOK_INTERVAL, self.recover)]

    def set_credit(self, count: int) -> None:
        """How many unacknowledged messages the broker may have out with us (push brokers).

        Sent without waiting for the reply, so it costs no round trip; AMQP applies it in
        order with the acks that follow on the channel. 0 means "none": AMQP has no way to
        say that with QoS, so consuming pauses until there is credit again.
        """
        count = max(0, min(count, 65535))
        driver = self.driver
        if self.per_consumer and self.consuming:
            self._pace()
            return
        if count == self.credit or not self.consuming or driver is None or (
                not driver.capabilities.push):
            return
        self.credit = count
        if count == 0:
            self.paused = True
            for consumer in self.consumers:
                self._guarded(consumer.cancel)
            return
        self._guarded(driver.send_qos, self.consumers[0].channel, count)
        if self.paused:
            self.paused = False
            for consumer in self.consumers:
                self._guarded(consumer.consume)

    def resize(self, prefetch_count: int, acked_running: int) -> None:
        """The window changed (reload, TTIN, TTOU): on a per-consumer prefetch, which
        RabbitMQ fixes when a consumer starts, the consumers start again with their new
        share (the channel-wide credit follows ``set_credit`` instead). What they were sent
        stays theirs to ack; until it is fewer than the new share, nothing more comes."""
        driver = self.driver
        if not self.per_consumer or driver is None or not self.consuming:
            return
        share = self._per_consumer(prefetch_count - acked_running)
        if share == self.per_consumer:
            return
        self.per_consumer = share
        self._guarded(partial(driver.send_qos, per_consumer=True), self.consumers[0].channel,
                      share)
        # A consumer started again may be sent its whole share at once, whatever its
        # predecessor was sent and is still held: it starts only once the window has room
        # for all of it (``_pace``), so the window holds while it changes; until then the
        # children run what is held.
        if not self.paused:
            self.paused = True
            for consumer in self.consumers:
                self._guarded(consumer.cancel)
        self._restarting = True
        self._pace()

    def _pace(self) -> None:
        """Per-consumer prefetch where the window is smaller than what the consumers could
        be sent (``_per_consumer``): consume only while there is room for one more from
        each; paused (cancelled) before the ack that would free one, which follows it on
        the channel."""
        if self._restarting:
            if self._room() >= self.per_consumer * len(self.consumers):
                self._restarting = self.paused = False
                for consumer in self.consumers:
                    self._guarded(consumer.consume)
            return
        if not self._paced:
            return
        room = self._room()
        if not self.paused and room < len(self.consumers):
            self.paused = True
            for consumer in self.consumers:
                self._guarded(consumer.cancel)
        elif self.paused and room >= len(self.consumers):
            self.paused = False
            for consumer in self.consumers:
                self._guarded(consumer.consume)

    # -- leases
    def renew(self, messages: list[Message]) -> list[Message]:
        """Renew the leases of held messages, each through the channel it came from; return
        those whose lease was lost (another worker may hold them now: they must not be run
        or settled here). A channel that cannot be reached now is tried again next time."""
        by_channel: dict[Any, dict[str, Message]] = {}
        for message in messages:
            if hasattr(message.channel, "renew"):
                by_channel.setdefault(message.channel, {})[message.delivery_tag] = message
        lost: list[Message] = []
        for channel, by_tag in by_channel.items():
            if channel in self._channels:
                tags = self._guarded(channel.renew, list(by_tag)) or []
            else:
                try:
                    tags = channel.renew(list(by_tag))
                except Exception as exc:  # noqa: BLE001 - an old connection, still down
                    log.debug("renewing leases of an earlier connection: %r", exc)
                    continue
            lost += [by_tag[tag] for tag in tags]
        return lost

    # -- settling
    def ack(self, message: Message) -> None:
        self._settling(message.channel, message.ack)

    def ack_many(self, messages: list[Message], fetch: bool = False) -> list[Exception | None]:
        """Ack several messages, in one round trip per channel where the channel can (Redis);
        return each one's error, or None. ``fetch``: then take what there is room for, in
        the same round trip as the consuming channel's acks where the driver can (Redis)."""
        errors: list[Exception | None] = [None] * len(messages)
        by_channel: dict[Any, list[int]] = {}
        for n, message in enumerate(messages):
            by_channel.setdefault(message.channel, []).append(n)
        driver = self.driver if self.consuming else None
        taking = driver if fetch and self.capabilities.takes_with_acks else None
        combined = taking.ack_and_take if taking is not None else None
        consuming = self.consumers[0].channel if self.consumers else None
        more = True         # may a fetch still find messages?
        for channel, numbers in by_channel.items():
            if combined is not None and channel is consuming:
                more = self._ack_batch(channel, combined, messages, numbers, errors)
                combined = None
            else:
                # RabbitMQ: the frames of every ack written at once; Redis and SQLite:
                # several acks in one round trip.
                batch = getattr(channel, "ack_tags", None)
                if batch is None and len(numbers) > 1:
                    batch = getattr(getattr(channel, "qos", None), "ack_many", None)
                self._ack_batch(channel, batch, messages, numbers, errors)
        if fetch and more and self.connected:
            self.poll()
        return errors

    def _ack_batch(self, channel: Any, batch: Callable[[Sequence[str]], Any] | None,
                   messages: list[Message], numbers: list[int],
                   errors: list[Exception | None]) -> bool:
        """Ack ``messages[n]`` for ``numbers``, all of ``channel``: by ``batch(tags)`` in
        one round trip, else one by one; each error goes to ``errors[n]``. Returns True
        if ``batch`` said so (``ack_and_take``: there may be more to take) or failed."""
        if batch is None:
            for n in numbers:
                try:
                    self.ack(messages[n])
                except Exception as exc:  # noqa: BLE001 - handed back, per message
                    errors[n] = exc
            return True
        ready = _not_acked(messages, numbers, errors)
        try:
            said = self._settling(channel, partial(batch, [m.delivery_tag for m in ready]))
        except Exception as exc:  # noqa: BLE001 - handed back, per message
            for n in numbers:
                errors[n] = errors[n] or exc
            return True
        for message in ready:
            message._state = "ACK"
        return said is True

    def take_now(self, messages: list[Message],
                 take: bool = True) -> list[Exception | None] | None:
        """``ack_many(messages, fetch=take)`` if it can be done at once, never waiting (the
        loop thread calls it while the broker thread is parked): on SQLite, where a take is
        a transaction on a local file, not a round trip. None if it cannot (another
        broker; acks of an older connection's channel; the file busy or in trouble):
        nothing was done, and the broker thread is to do it, waiting as it may."""
        driver = self._taking_here(messages, "takes_inline")
        if driver is None:
            return None
        errors: list[Exception | None] = [None] * len(messages)
        ready = _not_acked(messages, range(len(messages)), errors)
        try:
            driver.take_now([message.delivery_tag for message in ready], take)
        except StoreBusy:
            return None
        for message in ready:
            message._state = "ACK"
        return errors

    def ack_now(self, messages: list[Message]) -> bool | None:
        """Ack ``messages`` if it can be done without waiting (the loop thread calls it
        while the broker thread is parked): on RabbitMQ, their frames written to the socket
        at once. True: written whole; False: written in part, the rest sent by
        ``finish_write`` (the broker thread's), and only then are they acked; None: nothing
        was done (another broker; a message of an older connection's channel, or one
        settled already; a socket that is full or cannot be written so; a connection that
        failed, whose loss the broker thread finds and reports), and the broker thread is
        to ack them."""
        driver = self._taking_here(messages, "acks_inline")
        if driver is None or any(message.acknowledged for message in messages):
            return None
        channel = messages[0].channel
        failures: tuple[type[BaseException], ...] = (OSError, *self._errors())
        try:
            written = channel.ack_tags_now([message.delivery_tag for message in messages])
        except failures:
            return None     # nothing was written
        if written is not None:
            for message in messages:
                message._state = "ACK"
        return written

    def check_alive(self) -> None:
        """After the loop was away (frozen): check the broker's heartbeats and deliver
        all the connection holds, never waiting, so that a connection the broker closed
        meanwhile (RabbitMQ: a consumer silent past its heartbeat timeout) is found lost
        and reported. A connection whose heartbeats stopped while we were away is lost
        too, even if the broker kept it: it is replaced, and the broker gives back what
        it held, which is what it would do had it closed it."""
        if self.connection is None or self.driver is None:
            return
        # First the heartbeats, before anything read now counts as the broker's: silent
        # for two intervals, it is lost; else ours goes out if one is due.
        if self.connection.get_heartbeat_interval():
            self._guarded(self.connection.heartbeat_check, 2)
        # Then all the socket holds, to its end: a broker that closed the connection
        # sent its last heartbeats before the close, and one read would stop at them.
        if self.connection is not None:
            for fd in self.fds():
                self.on_readable(fd)

    def read_now(self) -> bool | None:
        """Deliver what the connection's socket holds now, never waiting (the loop thread
        calls it while the broker thread is parked): RabbitMQ's frames, each handed over
        once it is in whole. True: done (perhaps nothing was there); None: nothing was
        read (another broker, TLS, a socket with a timeout of its own, no connection, or
        a connection found lost, which is reported as the broker thread reports it), and
        the broker thread is to read."""
        driver = self.driver
        if driver is None or not (self.consuming and driver.capabilities.reads_inline):
            return None
        read: bool | None = self._guarded(driver.read_now)
        return read

    def counts_with_publish(self, message: Message) -> bool:
        """Would ``count_delivery`` publish (a copy of a message RabbitMQ redelivered,
        carrying its counts), which waits for the broker's confirm?"""
        rabbitmq = self.rabbitmq
        return rabbitmq is not None and bool(
            rabbitmq.losses(message.delivery_info or {}, message.headers or {}))

    def finish_write(self, channel: Any) -> None:
        """Send what ``ack_now`` wrote in part on ``channel``, waiting for the socket.
        Raises if that channel's connection is gone meanwhile: those acks are not made
        (their messages come back from the broker)."""
        transport = getattr(getattr(channel, "connection", None), "transport", None)
        if (transport is None or not self.consuming
                or channel is not self.consumers[0].channel):
            raise BrokerUnavailable(
                "the connection closed before the acks written in part were sent")
        self._settling(channel, transport.finish_write)

    def take_send(self, messages: list[Message], pipe: Any = None) -> SentAcks | None:
        """``ack_many(messages, fetch=True)``'s request sent, never waiting, on ``pipe``
        after the ones sent on it before, or on a new pipe (``SentAcks.pipe``); the answers
        are read by ``take_read`` when the pipe's ``fd`` is readable (the loop thread calls
        both while the broker thread is kept parked): on Redis. None if it cannot be sent
        at once (another broker; acks of an older connection's channel; see
        ``Channel.take_send``): nothing was sent, and the broker thread is to do it."""
        driver = self._taking_here(messages, "takes_split")
        if driver is None:
            return None
        errors: list[Exception | None] = [None] * len(messages)
        ready = _not_acked(messages, range(len(messages)), errors)
        sent = driver.take_send([message.delivery_tag for message in ready], pipe)
        return None if sent is None else SentAcks(sent, sent.pipe, ready, errors)

    def _taking_here(self, messages: list[Message], capability: str) -> Driver | None:
        """The driver, if it has ``capability`` and the connection consumes, and every one
        of ``messages`` came through its channel (not an older connection's)."""
        driver = self.driver
        if driver is None or not (self.consuming and getattr(driver.capabilities, capability)):
            return None
        channel = self.consumers[0].channel
        if any(message.channel is not channel for message in messages):
            return None
        return driver

    def take_read(self, pipe: Any, out: deque[SentAcks]) -> list[SentAcks]:
        """The takes sent on ``pipe`` (``out``, in the order they were sent) answered now,
        taken off ``out``, their acks made (each one's errors in its ``errors``). Raises if
        the pipe failed: the takes left in ``out`` are over, their acks to be made again."""
        assert self.driver is not None
        answered = self.driver.take_read(pipe)
        done = []
        for sent in answered:
            acks = out.popleft()
            assert acks.sent is sent
            for message in acks.ready:
                message._state = "ACK"
            done.append(acks)
        return done

    def found_empty(self) -> bool:
        """Did the last take find the queues empty (it took less than it asked for)?"""
        return bool(getattr(self.driver, "dry", False))

    @property
    def takes_split(self) -> bool:
        """Can ``take_send`` be asked of this connection (Redis)?"""
        return self.capabilities.takes_split

    @property
    def acks_at_once(self) -> bool:
        """Can ``ack_now`` be asked of this connection (RabbitMQ)?"""
        return self.capabilities.acks_inline

    @property
    def reads_at_once(self) -> bool:
        """Can ``read_now`` be asked of this connection (RabbitMQ, while it consumes: once
        cancelled, the broker thread reads what is left, the consumer's cancel-ok among
        it)?"""
        return self.consuming and self.capabilities.reads_inline

    @property
    def takes_at_once(self) -> bool:
        """Can ``take_now`` be asked of this connection (SQLite)?"""
        return self.capabilities.takes_inline

    def has_unburied(self) -> bool:
        """Did a ``take_now`` lease unreadable entries that wait for ``bury_unburied``?"""
        return self.driver is not None and self.driver.has_unburied()

    def bury_unburied(self) -> None:
        """Bury the unreadable entries that ``take_now`` leased (burying may wait)."""
        if self.driver is not None:
            self._guarded(self.driver.bury_unburied)

    def forget(self, message: Message) -> None:
        """Drop a message whose lease was lost (``renew`` said so) from its channel's
        bookkeeping. Nothing is settled at the broker, where the message is waiting or held
        by another worker; only the delivery count our take added is taken back (SQLite,
        Redis): this delivery did not end in a loss."""
        forget = getattr(message.channel, "forget", None)
        if forget is None:
            self._settling(message.channel, message.ack)
        else:
            self._settling(message.channel, partial(forget, message.delivery_tag))

    # -- the delivery count
    def count_delivery(self, queue: str, message: Message) -> int | None:
        """Count this delivery: return the message's delivery count, this delivery
        included (docs/delivery.md "delivery count").

        SQLite and Redis counted it when the message was taken (and a dead worker's
        journal, read by ``recover``, took the count back where it only held it).
        RabbitMQ only marks a redelivery, with a flag that cannot add up repeated losses:
        a redelivered message is replaced here by a copy carrying its counts (published,
        confirmed, to the end of ``queue``) and acked. What the loss counts as is what the
        journals on this host say: a start (or nothing known: it may have started) is a
        delivery, a message only held a held loss. None: that happened, and the copy is
        the one to run, or it could not happen now and the broker has the message back,
        still marked.
        """
        earlier = self._earlier(message)
        rabbitmq = self.rabbitmq
        if rabbitmq is None or not rabbitmq.losses(message.delivery_info or {},
                                                   message.headers or {}):
            return earlier + 1
        headers = message.headers or {}
        label = f"{headers.get('task')}[{headers.get('id')}]"
        deaths = self.dead_workers
        verdict = deaths.verdict(self.journal_key(message)) if deaths is not None else None
        if verdict is None or verdict.started:
            counts = {**after_loss(headers, verdict or _UNKNOWN), DELIVERIES_HEADER: earlier}
            said = f"delivery count ({earlier})"
        else:
            counts = {**after_loss(headers, verdict),
                      DELIVERIES_HEADER: carried_deliveries(headers)}
            said = "held loss (it was only held by a worker that died)"
        try:
            self.hand_back(queue, message, counts)
        except Exception as exc:  # noqa: BLE001 - the broker keeps it, marked redelivered
            log.warning("%s: redelivered, but no copy carrying its %s could be published "
                        "(%r); the broker delivers it again", label, said, exc)
            if self.connected and not self.is_connection_error(exc):
                self._return_marked(message)
            return None
        log.info("%s: redelivered by RabbitMQ after a loss; replaced by a copy carrying its "
                 "%s at the end of %s", label, said, queue)
        return None

    def _return_marked(self, message: Message) -> None:
        """Give a redelivered message back through the broker, which keeps it marked (the
        loss still counts next time)."""
        try:
            self._settling(message.channel, partial(message.reject, requeue=True))
        except Exception as exc:  # noqa: BLE001 - it returns when the connection closes
            log.debug("could not return a redelivered message: %r", exc)

    def _earlier(self, message: Message) -> int:
        """Deliveries of ``message`` before this one that count."""
        return earlier_deliveries(message.headers, message.delivery_info, self.rabbitmq)

    def requeue(self, queue: str, message: Message) -> None:
        """Back to its queue, not a delivery that counts: a clean hand-back by a live
        worker. SQLite and Redis put it back in place and take back the count its take
        added, in one step. RabbitMQ's own requeue would mark it redelivered, which the
        next worker reads as a loss: there a copy carrying its count goes to the end of
        ``queue`` instead, and the original is acked."""
        if self.rabbitmq is not None:
            self.hand_back(queue, message)
        else:
            self._settling(message.channel, partial(message.reject, requeue=True))

    def republish(self, queue: str, message: Message, headers: Mapping[str, Any], *,
                  exchange: str = "") -> None:
        """Publish a copy with extra headers (to ``queue``, or through ``exchange`` with
        routing key ``queue``); the caller then acks the original."""
        producer, connection = self.producer, self.connection
        if producer is None or connection is None:
            raise BrokerUnavailable("not connected to the broker (reconnecting)")
        merged = {k: v for k, v in (message.headers or {}).items() if k not in BROKER_HEADERS}
        merged.update(headers)
        properties = {k: message.properties[k] for k in _KEPT_PROPERTIES
                      if message.properties.get(k) is not None}

        def publish() -> None:
            if not exchange and queue not in self._queues_ready:
                ensure_queue(connection, queue, self.app.queue_type(queue))
                self._queues_ready.add(queue)
            # No kombu retry: it would reconnect this connection in place, closing the
            # consuming channel behind our back. A failure is a lost connection (below).
            producer.publish(
                message.body, exchange=exchange, routing_key=queue, headers=merged,
                content_type=message.content_type, content_encoding=message.content_encoding,
                delivery_mode=2, retry=False, timeout=BROKER_TIMEOUT, **properties)
        self._settling(producer.channel, publish)

    def hand_back(self, queue: str, message: Message,
                  headers: Mapping[str, Any] | None = None) -> None:
        """A fresh copy to the end of its queue, then ack: not a delivery that counts (the
        copy carries the deliveries before this one that did, or ``headers``)."""
        self._still_held(message)
        self.republish(queue, message,
                       headers if headers is not None
                       else {DELIVERIES_HEADER: self._earlier(message)})
        self.ack(message)

    def delayable(self) -> frozenset[str]:
        """The queues whose messages RabbitMQ can hold for a while for us: the quorum
        queues, bound to Celery's delay levels (``hand_back_later``)."""
        return frozenset(q for q, kind in self.queue_types.items() if kind == "quorum")

    def hand_back_later(self, queue: str, message: Message, seconds: int) -> None:
        """A fresh copy through RabbitMQ's delay levels (Celery's delayed delivery, which
        the queue is bound to), back in ``queue`` in ``seconds``; then ack. Not a delivery
        that counts (the copy carries the deliveries before this one that did)."""
        self._still_held(message)
        self.republish(delayed_routing_key(seconds, queue), message,
                       {DELIVERIES_HEADER: self._earlier(message)},
                       exchange=delay_level(DELAY_LEVELS - 1))
        self.ack(message)

    def requeue_counted(self, queue: str, message: Message, deliveries: int) -> None:
        """Back to the queue as a delivery that counts: a copy carrying ``deliveries`` (its
        delivery count, this delivery included), then ack."""
        self._still_held(message)
        self.republish(queue, message, {DELIVERIES_HEADER: deliveries})
        self.ack(message)

    def requeue_held_loss(self, queue: str, message: Message) -> None:
        """Back to the end of its queue as a held loss, not a delivery that counts: a copy
        carrying the deliveries before this one and one more held loss, then ack. (It ran
        beside the task that got its child killed.)"""
        self.hand_back(queue, message, {
            DELIVERIES_HEADER: self._earlier(message),
            HELD_LOSSES_HEADER: carried_held_losses(message.headers) + 1})

    def _still_held(self, message: Message) -> None:
        """Before replacing an unacked message by a copy: RabbitMQ took back what a lost
        connection held (and delivers it again), so a copy published now would be a
        duplicate. (SQLite and Redis keep our leases across a reconnect.)"""
        if self.push and message.channel not in self._channels:
            raise BrokerUnavailable("its RabbitMQ connection was lost: the broker has taken "
                                    "it back")

    def dead_letter(self, queue: str, message: Message, reason: str, task_id: str | None,
                    worker: str, *, acked: bool) -> None:
        """A copy with the reason into ``<queue>.dead`` (or the RabbitMQ queue's own
        dead-letter exchange), then ack (unless acked already)."""
        headers = {
            DEAD_REASON_HEADER: reason,
            DEAD_TASK_HEADER: task_id,
            DEAD_AT_HEADER: datetime.now(UTC).isoformat(),
            DEAD_QUEUE_HEADER: queue,
            DEAD_WORKER_HEADER: worker,
        }
        if not acked:
            self._still_held(message)
        target = self.dead_letter_targets.get(queue)
        if target is not None:
            routing_key = target.routing_key or undelayed(
                (message.delivery_info or {}).get("routing_key") or queue)
            self.republish(routing_key, message, headers, exchange=target.exchange)
        else:
            self.republish(dead_letter_queue(queue), message, headers)
        if not acked:
            self.ack(message)


#: A loss no journal on this host explains: it may have been a start, and counts as one.
_UNKNOWN = Verdict(started=True, held_loss=False)


class SentAcks(NamedTuple):
    """A take sent with acks (``BrokerConsumer.take_send``), its answer still to read."""

    sent: Any
    pipe: Any
    ready: list[Message]
    errors: list[Exception | None]


def _not_acked(messages: list[Message], numbers: Iterable[int],
               errors: list[Exception | None]) -> list[Message]:
    """``messages[n]`` for ``numbers`` that are not settled yet; the error of each that is
    goes to ``errors[n]``."""
    ready: list[Message] = []
    for n in numbers:
        if messages[n].acknowledged:
            errors[n] = Message.MessageStateError(
                f"Message already acknowledged with state: {messages[n]._state}")
        else:
            ready.append(messages[n])
    return ready


def _rabbitmq(connection: Connection) -> RabbitMQ:
    """The server's version decides what its delivery marks mean (see counting.RabbitMQ)."""
    properties = getattr(connection.connection, "server_properties", None) or {}
    server = RabbitMQ(parse_version(properties.get("version")))
    log.info("RabbitMQ %s: delivery counts from the redelivered flag%s",
             ".".join(map(str, server.version or ())) or "of unknown version",
             " and quorum queues' x-delivery-count" if server.counts_returns else "")
    return server


def _is_auth_failure(exc: BaseException) -> bool:
    """RabbitMQ's ACCESS_REFUSED, Redis's WRONGPASS/NOAUTH and the like."""
    names = {type(e).__name__ for e in (exc, exc.__cause__, exc.__context__) if e is not None}
    text = str(exc).upper()
    return bool(names & {"AccessRefused", "AuthenticationError",
                         "AuthenticationWrongNumberOfArgsError"}) or any(
        word in text for word in ("ACCESS_REFUSED", "WRONGPASS", "NOAUTH", "AUTHENTICATION"))


def _discard(connection: Connection) -> None:
    """Close a connection that failed or half-opened, whatever state it is in."""
    try:
        connection.release()
    except Exception as exc:  # noqa: BLE001 - closing what is broken already
        log.debug("closing a broken broker connection: %r", exc)
