"""kombu transports that ship with workhorse."""
from __future__ import annotations

from kombu.transport import TRANSPORT_ALIASES

SQLITE = "workhorse.transport.sqlite:Transport"
REDIS = "workhorse.transport.redis:Transport"
REDIS_SENTINEL = "workhorse.transport.redis:SentinelTransport"
RABBITMQ = "workhorse.transport.rabbitmq:Transport"
RABBITMQ_TLS = "workhorse.transport.rabbitmq:SSLTransport"


def register() -> None:
    """Make ``sqlite://`` URLs mean workhorse's SQLite transport in kombu (idempotent)."""
    TRANSPORT_ALIASES.setdefault("sqlite", SQLITE)
