"""Queues as workhorse declares and finds them.

A queue that does not exist is declared the way Celery declares it (durable, bound to a
direct exchange of its name). One that exists is used as it is: RabbitMQ refuses a
re-declaration whose arguments differ (a quorum queue, a dead-letter exchange, a TTL), so
workhorse never re-declares what an operator set up.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from amqp.exceptions import NotFound, PreconditionFailed
from kombu import Connection, Exchange, Queue


def task_queue(name: str, queue_type: str = "classic") -> Queue:
    """A queue declared the way Celery declares it: durable, on a direct exchange of its
    name; on RabbitMQ as a quorum queue if ``queue_type`` says so."""
    arguments = {"x-queue-type": "quorum"} if queue_type == "quorum" else None
    return Queue(name, Exchange(name, type="direct"), routing_key=name,
                 queue_arguments=arguments)


@dataclass(frozen=True)
class DeadLetterTarget:
    """Where RabbitMQ's own dead-lettering of a queue sends messages."""

    exchange: str
    routing_key: str | None    # None: keep the message's routing key


def ensure_queue(connection: Connection, name: str, queue_type: str = "classic") -> Queue:
    """Declare ``name`` (as ``queue_type`` on RabbitMQ) if it is missing; return a Queue to
    consume or publish with."""
    if connection.transport.driver_type != "amqp":
        queue = task_queue(name)
        queue(connection.default_channel).declare()
        return queue
    if amqp_queue_exists(connection, name):
        return Queue(name, no_declare=True)
    queue = task_queue(name, queue_type)
    queue(connection.default_channel).declare()
    return queue


def declared_type(connection: Connection, name: str) -> str:
    """The type of an existing RabbitMQ queue (read from RabbitMQ's refusal of a probe, as
    ``rabbitmq_dead_letter_target`` reads): classic where it declares none."""
    kind = probe_argument(connection, name, "x-queue-type")
    return kind if isinstance(kind, str) else "classic"


def amqp_queue_exists(connection: Connection, name: str) -> bool:
    """Does RabbitMQ have a queue ``name`` (a passive declare, on a channel of its own)?"""
    channel = connection.channel()   # a failed passive declare closes its channel
    try:
        channel.queue_declare(name, passive=True)
    except NotFound:
        return False
    finally:
        _close_quietly(channel)
    return True


#: RabbitMQ's refusal of an inequivalent declaration names the argument and its value.
_REFUSAL = re.compile(r"inequivalent arg '(?P<arg>[^']+)'.*?but current is "
                      r"(?:the value '(?P<typed>.*)' of type '(?P<type>\w+)'"
                      r"|'(?P<plain>.*)'|none)$")
_TYPES: dict[str, Callable[[str], object]] = {
    "longstr": str, "bool": lambda v: v == "true", "double": float, "float": float}
PROBE_VALUE = "\x00workhorse-probe"


def rabbitmq_dead_letter_target(connection: Connection, name: str) -> DeadLetterTarget | None:
    """The dead-letter exchange configured on an existing RabbitMQ queue, if any.

    AMQP cannot read a queue's arguments; RabbitMQ does name an argument's current value
    when a declaration disagrees with it. So declare with a value it cannot hold and read
    the refusal (repeating the queue's other arguments as the refusals reveal them). Only
    queue arguments are seen this way, not policies.
    """
    if connection.transport.driver_type != "amqp" or not amqp_queue_exists(connection, name):
        return None
    exchange = probe_argument(connection, name, "x-dead-letter-exchange")
    if not isinstance(exchange, str):
        return None
    key = probe_argument(connection, name, "x-dead-letter-routing-key")
    return DeadLetterTarget(exchange, key if isinstance(key, str) else None)


def probe_argument(connection: Connection, name: str, argument: str) -> object:
    """The value of ``argument`` on the existing RabbitMQ queue ``name`` (None: it has
    none), from RabbitMQ's refusal of a declaration that cannot match it."""
    known: dict[str, object] = {}
    for _ in range(16):
        channel = connection.channel()
        try:
            channel.queue_declare(name, durable=True, auto_delete=False,
                                  arguments={**known, argument: PROBE_VALUE})
        except PreconditionFailed as exc:
            refusal = parse_refusal(str(exc))
            if refusal is None:
                return None
            arg, value = refusal
            if arg == argument:
                return value
            if value is None or arg in known:
                return None
            known[arg] = value   # another argument the queue has: repeat it, ask again
        else:
            return None   # accepted: nothing was configured (cannot happen on an existing queue)
        finally:
            _close_quietly(channel)
    return None


def parse_refusal(text: str) -> tuple[str, object] | None:
    """("x-message-ttl", 600000) from RabbitMQ's PRECONDITION_FAILED text; value None
    when the queue has no such argument."""
    match = _REFUSAL.search(text.strip())
    if match is None:
        return None
    if match.group("typed") is not None:
        convert = _TYPES.get(match.group("type"), int)
        try:
            return match.group("arg"), convert(match.group("typed"))
        except ValueError:
            return None
    return match.group("arg"), match.group("plain")


def _close_quietly(channel: object) -> None:
    try:
        channel.close()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - the broker may already have closed it
        pass


# ------------------------------------------------------------ Celery's delayed delivery
#: Celery 5.5+ sends a countdown or ETA task bound for a quorum queue (on an exchange that
#: is not direct) through RabbitMQ instead of holding it in a worker: 28 levels of queues
#: whose messages expire after 2**level seconds into the next level, the delay's bits
#: written in front of the routing key, and at the end the topic exchange below, which a
#: worker binds its queues to with ``#.<routing key>``.
DELAY_LEVELS = 28
DELAYED_DELIVERY_EXCHANGE = "celery_delayed_delivery"


def delay_level(level: int) -> str:
    return f"celery_delayed_{level}"


def declare_delayed_delivery(connection: Connection, queue_type: str) -> None:
    """Declare the delay levels as Celery 5.5+ does (idempotent where they exist as
    declared here): level L's topic exchange and queue (its messages live 2**L s, then go
    to level L-1, and from level 0 to DELAYED_DELIVERY_EXCHANGE); a message whose bit L is
    1 waits in level L's queue, one whose bit is 0 passes straight to the next level."""
    channel = connection.channel()
    try:
        for level in reversed(range(DELAY_LEVELS)):
            name = delay_level(level)
            exchange = Exchange(name, type="topic", durable=True)
            exchange(channel).declare()
            arguments: dict[str, object] = {
                "x-queue-type": queue_type, "x-overflow": "reject-publish",
                "x-message-ttl": 2 ** level * 1000,
                "x-dead-letter-exchange": (delay_level(level - 1) if level
                                           else DELAYED_DELIVERY_EXCHANGE)}
            if queue_type == "quorum":
                arguments["x-dead-letter-strategy"] = "at-least-once"
            queue = Queue(name, exchange, routing_key=_bit_key(level, "1"),
                          queue_arguments=arguments)
            queue(channel).declare()
        delivery = Exchange(DELAYED_DELIVERY_EXCHANGE, type="topic", durable=True)
        delivery(channel).declare()
        for level in reversed(range(DELAY_LEVELS)):
            target = delay_level(level - 1) if level else DELAYED_DELIVERY_EXCHANGE
            channel.exchange_bind(destination=target, source=delay_level(level),
                                  routing_key=_bit_key(level, "0"))
    finally:
        _close_quietly(channel)


def _bit_key(level: int, bit: str) -> str:
    """The binding key that matches bit ``level`` (of DELAY_LEVELS, the highest first)."""
    return "*." * (DELAY_LEVELS - 1 - level) + bit + ".#"


def bind_delayed_delivery(connection: Connection, queue: str, routing_key: str) -> None:
    """What comes out of the delay levels for ``routing_key`` lands in ``queue``."""
    channel = connection.channel()
    try:
        channel.queue_bind(queue, DELAYED_DELIVERY_EXCHANGE,
                           routing_key if routing_key.startswith("#") else f"#.{routing_key}")
    finally:
        _close_quietly(channel)


_DELAY_BITS = re.compile(rf"^(?:[01]\.){{{DELAY_LEVELS}}}")


def undelayed(routing_key: str) -> str:
    """A routing key without the delay bits a message that came through the levels has."""
    return _DELAY_BITS.sub("", routing_key)


def delayed_routing_key(seconds: int, routing_key: str) -> str:
    """The routing key of a message to deliver ``seconds`` from now through the levels."""
    return ".".join(f"{seconds:0{DELAY_LEVELS}b}") + "." + undelayed(routing_key)


def events_exchange(connection: Connection, name: str) -> Exchange:
    """Celery's event exchange as Celery declares it on this broker: fanout on Redis (and
    on SQLite, the other virtual transport, likewise), topic elsewhere."""
    fanout = connection.transport.driver_type in ("redis", "sqlite")
    return Exchange(name, type="fanout" if fanout else "topic", durable=True,
                    auto_delete=False)
