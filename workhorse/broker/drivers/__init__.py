"""One driver per kind of broker (``driver_for`` picks it by the transport's kind); what
each kind does is data, ``Capabilities``, which the rest of the worker reads."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kombu import Connection

from ...transport.redis import Channel as RedisChannel
from .amqp import AmqpDriver
from .base import POLL_INTERVAL, SAFETY_POLL, Capabilities, Driver, PolledDriver
from .redis import RedisDriver
from .sqlite import SqliteDriver

__all__ = ["POLL_INTERVAL", "SAFETY_POLL", "Capabilities", "Driver", "driver_for"]

def _redis(connection: Connection, channel: Any, room: Callable[[], int]) -> Driver:
    if not isinstance(channel, RedisChannel):
        raise ValueError("Redis brokers are consumed through workhorse.transport.redis "
                         "(App.connection() chooses it)")
    return RedisDriver(connection, channel, room)


_BY_KIND: dict[str, Callable[[Connection, Any, Callable[[], int]], Driver]] = {
    "amqp": lambda connection, channel, room: AmqpDriver(connection),
    "redis": _redis,
    "sqlite": SqliteDriver,
}


def driver_for(connection: Connection, channel: Any, room: Callable[[], int]) -> Driver:
    """The driver for the kind of broker ``connection`` speaks to; a transport workhorse
    has no driver for (kombu's memory://, in tests) is polled."""
    make = _BY_KIND.get(connection.transport.driver_type)
    if make is None:
        return PolledDriver(connection)
    return make(connection, channel, room)
