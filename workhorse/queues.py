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


def task_queue(name: str) -> Queue:
    """A queue declared the way Celery declares it: durable, on a direct exchange of its name."""
    return Queue(name, Exchange(name, type="direct"), routing_key=name)


@dataclass(frozen=True)
class DeadLetterTarget:
    """Where RabbitMQ's own dead-lettering of a queue sends messages."""

    exchange: str
    routing_key: str | None    # None: keep the message's routing key


def ensure_queue(connection: Connection, name: str) -> Queue:
    """Declare ``name`` if it is missing; return a Queue to consume or publish with."""
    if connection.transport.driver_type != "amqp":
        queue = task_queue(name)
        queue(connection.default_channel).declare()
        return queue
    if _amqp_queue_exists(connection, name):
        return Queue(name, no_declare=True)
    queue = task_queue(name)
    queue(connection.default_channel).declare()
    return queue


def _amqp_queue_exists(connection: Connection, name: str) -> bool:
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
    if connection.transport.driver_type != "amqp" or not _amqp_queue_exists(connection, name):
        return None
    exchange = _probe_argument(connection, name, "x-dead-letter-exchange")
    if exchange is None:
        return None
    return DeadLetterTarget(exchange, _probe_argument(connection, name,
                                                      "x-dead-letter-routing-key"))


def _probe_argument(connection: Connection, name: str, argument: str) -> str | None:
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
                return value if isinstance(value, str) else None
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
