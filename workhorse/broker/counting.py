"""The delivery count (docs/delivery.md): how many deliveries of a message may have started
and ended in a loss. Pure: it reads what a message says.

A message's count has two parts. What a copy carries in its header
(``protocol.DELIVERIES_HEADER``): workhorse republishes a message, with its count, when it
requeues it counted, hands it back, or replaces a RabbitMQ redelivery. And what the broker
counted for this very message, this delivery included:

- SQLite and Redis count each take in the step that takes it (``delivery_info
  ["delivery_count"]``), so a supervisor killed outright has counted already; a clean
  hand-back by a live worker takes it back, and so does the recovery of a dead worker's
  messages for those its journal says were only held (``broker.recovery``).
- RabbitMQ only marks a redelivery: the ``redelivered`` flag, which after a lost
  connection or a dead worker means at least one loss (workhorse never requeues through
  the broker, whose requeue sets the flag too). On quorum queues the header
  ``x-delivery-count`` also says how often the message went back to its queue, but its
  meaning depends on the server's version (``RabbitMQ``). A boolean cannot add up repeated
  losses, so the consumer replaces each redelivered message by a copy carrying the count,
  or a held loss where the journals on the host say it was only held.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..protocol import carried_deliveries

#: Headers a broker sets on what it delivers: a copy workhorse publishes must not carry
#: them, or a classic queue would hand the stale value back as if it were the broker's.
BROKER_HEADERS = frozenset({"x-delivery-count", "x-acquired-count"})


def parse_version(text: Any) -> tuple[int, ...] | None:
    """``"3.10.8"`` -> (3, 10, 8); None when the server does not say."""
    if not isinstance(text, (str, bytes)):
        return None
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    numbers = re.match(r"\d+(?:\.\d+)*", text.strip())
    return tuple(int(n) for n in numbers.group().split(".")) if numbers else None


@dataclass(frozen=True)
class RabbitMQ:
    """What a RabbitMQ server's delivery marks mean, by its version.

    3.x (tested against 3.10.8): on a quorum queue, ``x-delivery-count`` counts every
    return of the message to its queue — requeued by a consumer, or held by a channel or
    connection that closed. workhorse never requeues through the broker, so each return is
    a loss, and the count is used as it is. 4.x changed it: 4.0 counts returns after a
    lost consumer separately, and 4.3 splits ``x-delivery-count`` (failed deliveries only)
    from ``x-acquired-count``; a lost connection may not show in either the way 3.x
    counts it. There, and when the version is unknown, only the ``redelivered`` flag is
    used: each redelivery counts one loss, never more than happened.
    """

    version: tuple[int, ...] | None

    @property
    def counts_returns(self) -> bool:
        """Does ``x-delivery-count`` count every return to the queue?"""
        return self.version is not None and self.version[0] == 3

    def losses(self, delivery_info: Mapping[str, Any], headers: Mapping[str, Any]) -> int:
        """Deliveries of this message, before this one, that ended in a loss."""
        if not delivery_info.get("redelivered"):
            return 0
        returns = headers.get("x-delivery-count")
        if (self.counts_returns and isinstance(returns, int) and not isinstance(returns, bool)
                and returns > 1):
            return returns
        return 1


def earlier_deliveries(headers: Mapping[str, Any] | None,
                       delivery_info: Mapping[str, Any] | None,
                       rabbitmq: RabbitMQ | None) -> int:
    """How many deliveries of this message before this one count: what the copy carries,
    plus what its broker counted (``rabbitmq``: the server it came from, if RabbitMQ)."""
    headers, delivery_info = headers or {}, delivery_info or {}
    carried = carried_deliveries(headers)
    if rabbitmq is not None:
        return carried + rabbitmq.losses(delivery_info, headers)
    taken = delivery_info.get("delivery_count")
    if isinstance(taken, int) and not isinstance(taken, bool) and taken > 1:
        return carried + taken - 1
    return carried
