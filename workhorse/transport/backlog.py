"""What a queue holds, as a broker can tell it without taking anything, and when a message
was sent.

Every message a workhorse process publishes is stamped with the time it was sent, once (a
copy of it keeps the first stamp): on SQLite and Redis in the envelope's ``timestamp``
property (seconds, a float); on RabbitMQ in the ``timestamp`` property (whole seconds, as
AMQP 0-9-1 has it) and, for the milliseconds, in the ``timestamp_in_ms`` header (the name
RabbitMQ's message-timestamp plugin uses). A producer that stamps nothing (Celery's, through
kombu's own transports) leaves ``sent_at`` unknown: the worker then measures a wait from
when it received the message, and says so (``workhorse_task_wait_seconds{since}``).
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, UTC
from typing import Any

#: The header that carries the send time in milliseconds on RabbitMQ.
MS_HEADER = "timestamp_in_ms"


@dataclass(frozen=True)
class Backlog:
    """One queue, as its broker tells it (``Channel.backlog``)."""

    #: Messages ready to be taken (not held by any worker).
    ready: int
    #: When the oldest of them was sent (epoch seconds), where the broker can tell it and
    #: its producer stamped it; None otherwise.
    oldest_sent: float | None = None
    #: Consumers of the queue, where the broker counts them (RabbitMQ).
    consumers: int | None = None


def stamp_properties(properties: dict[str, Any]) -> None:
    """A virtual transport's envelope (SQLite, Redis): the send time, unless it has one."""
    properties.setdefault("timestamp", time.time())


def stamp_amqp(properties: dict[str, Any]) -> None:
    """A py-amqp message's properties: whole seconds in ``timestamp``, milliseconds in a
    header; a message stamped before (a copy) keeps its stamps."""
    if "timestamp" in properties:
        return
    now = time.time()
    properties["timestamp"] = int(now)
    headers = properties.get("application_headers")
    # A copy: the caller may publish the same headers again.
    properties["application_headers"] = {MS_HEADER: int(now * 1000),
                                         **(headers if isinstance(headers, dict) else {})}


def sent_at(properties: Mapping[str, Any] | None,
            headers: Mapping[str, Any] | None) -> float | None:
    """When a message was sent (epoch seconds), from its stamps; None if it has none."""
    if headers:
        ms = headers.get(MS_HEADER)
        if isinstance(ms, int | float) and not isinstance(ms, bool):
            return ms / 1000.0
    value = (properties or {}).get("timestamp")
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, datetime):     # py-amqp reads the property as a naive UTC time
        return (value if value.tzinfo else value.replace(tzinfo=UTC)).timestamp()
    return None
