"""A kombu Connection for a failover list of broker URLs (``amqp://h1//;amqp://h2//``).

kombu tries the next URL of the list when a connect fails (``ensure_connection`` with
enough retries), but its ``switch`` to the next URL puts the transport named by the URL's
bare scheme in place of the one the connection was made with: workhorse's RabbitMQ and
Redis transports (publishes that fail on a blocked connection, leases) would silently
become kombu's plain ones on the second host. This class keeps the chosen transport."""
from __future__ import annotations

from typing import Any

from kombu import Connection


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
