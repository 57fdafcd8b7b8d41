"""Connections to the broker: which kombu transport each kind of broker URL gets, with the
options workhorse relies on, and the failover form of URL (``amqp://h1//;amqp://h2//``).

kombu tries the next URL of a failover list when a connect fails (``ensure_connection``
with enough retries), but its ``switch`` to the next URL puts the transport named by the
URL's bare scheme in place of the one the connection was made with: workhorse's RabbitMQ
and Redis transports (publishes that fail on a blocked connection, leases) would silently
become kombu's plain ones on the second host. ``FailoverConnection`` keeps the chosen one."""
from __future__ import annotations

import ssl
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kombu import Connection

from ..transport import RABBITMQ, RABBITMQ_TLS, REDIS, REDIS_SENTINEL
from ..urls import SENTINEL, as_redis, scheme_of, split_master_name

if TYPE_CHECKING:
    from ..config import Settings

#: Seconds a broker call may wait on a silent server (connect, read, publish confirm).
BROKER_TIMEOUT = 10.0


class FailoverConnection(Connection):
    def switch(self, conn_str: str) -> None:
        chosen: Any = self._initial_params.get("transport")
        super().switch(conn_str)
        if chosen is not None:
            self.transport_cls = chosen

    def retries(self, rounds: int) -> int:
        """``max_retries`` for ``ensure_connection`` that tries each URL of the list
        ``rounds`` times (kombu waits between rounds, not between the URLs of one)."""
        return rounds * max(1, len(self.alt)) - 1


def open_connection(settings: Settings, heartbeat: float = 0,
                    transport_options: Mapping[str, Any] | None = None) -> FailoverConnection:
    """A new, unconnected kombu Connection to the configured broker. ``heartbeat``
    (RabbitMQ): only for a connection whose owner calls ``heartbeat_check``;
    ``transport_options``: the user's (broker_transport_options, or a Celery app's), under
    workhorse's own."""
    url, master_name = split_master_name(as_redis(settings.broker_url))
    options: dict[str, Any] = {}
    transport_options = {
        **(transport_options or {}),
        "visibility_timeout": settings.visibility_timeout,
        # RabbitMQ: publish returns once the broker has the message (publisher
        # confirms), so "sent, then ack the original" can never lose it.
        "confirm_publish": True}
    if master_name:
        transport_options["master_name"] = master_name
    scheme = scheme_of(url)
    if scheme in ("redis", "rediss", SENTINEL):
        # kombu's Redis transport with renewable leases and lease-checked acks (on the
        # master that Sentinel names, for a sentinel:// list).
        options["transport"] = REDIS_SENTINEL if scheme == SENTINEL else REDIS
        transport_options["foreign_visibility_timeout"] = settings.celery_visibility_timeout
        # A silent server (a network partition) fails a call instead of blocking the
        # worker's loop until TCP gives up.
        transport_options.update(socket_timeout=BROKER_TIMEOUT,
                                 socket_connect_timeout=BROKER_TIMEOUT,
                                 socket_keepalive=True)
        if scheme == "rediss":
            # kombu turns on TLS for the scheme name, which a transport class hides;
            # verify the server's certificate (kombu would not).
            options["ssl"] = {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    elif scheme in ("amqp", "pyamqp", "amqps"):
        # kombu's py-amqp transport, but a publish on a connection RabbitMQ blocks
        # (memory or disk alarm) fails at once instead of waiting for ever.
        options["transport"] = RABBITMQ_TLS if scheme == "amqps" else RABBITMQ
    return FailoverConnection(url, transport_options=transport_options, heartbeat=heartbeat,
                              connect_timeout=BROKER_TIMEOUT, **options)
