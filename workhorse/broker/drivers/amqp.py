"""RabbitMQ (AMQP 0-9-1): the broker pushes deliveries up to a credit the worker keeps
moving, and takes back what a lost connection held."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from amqp import spec as amqp_spec
from kombu import Connection

from .base import Capabilities, Driver, drain


class AmqpDriver(Driver):
    capabilities = Capabilities(push=True, acks_inline=True, reads_inline=True)

    def __init__(self, connection: Connection) -> None:
        super().__init__(connection)
        # As kombu's own event-loop hookup does: an empty non-blocking read raises
        # socket.timeout instead of spinning on EAGAIN.
        connection.connection.transport.raise_on_initial_eintr = True

    def send_qos(self, channel: Any, count: int, per_consumer: bool = False) -> None:
        # global=True: RabbitMQ fixes a per-consumer limit (global=False) when the consumer
        # starts and ignores later changes; the channel-wide limit applies at once, and
        # covers all our queues together, which is what the window means. Quorum queues
        # refuse it: there the limit is each consumer's (``BrokerConsumer._per_consumer``).
        # Sent without waiting for QosOk (py-amqp drops an unawaited QosOk).
        channel.send_method(amqp_spec.Basic.Qos, "lBb", (0, count, not per_consumer))

    def fds(self) -> set[int]:
        return {self.connection.connection.sock.fileno()}

    def tick(self) -> None:
        """Deliver the frames read ahead of the drain that read them (a wait for a publish
        confirm reads on past it; see ``ReadAheadTransport``): select() cannot see them."""
        buffered = getattr(self.connection.connection.transport, "frame_buffered", None)
        while buffered is not None and buffered():
            drain(self.connection)

    def read_now(self) -> bool | None:
        deliver = getattr(self.connection.connection, "deliver_ready", None)
        return deliver() if deliver is not None else None

    def periodic(self) -> list[tuple[float, Callable[[], None]]]:
        heartbeat = self.connection.get_heartbeat_interval()
        if not heartbeat:
            return []
        return [(heartbeat / 4, lambda: self.connection.heartbeat_check(rate=4))]
