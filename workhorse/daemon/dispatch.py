"""Handing buffered messages to idle children, one job each: the start of a task.

With ``acks_late = false`` the message is acked first (at-most-once); the time limits
are armed as the child takes it.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kombu.message import Message

from ..pool.child import Child
from ..pool.ipc import Job
from ..pool.limits import effective_limit
from .delivery import Delivery
from .current import Current
from .holding import Holding
from .intake import Intake
from .slots import Slots

log = logging.getLogger("workhorse.supervisor")

#: A message whose task id is running here already (RabbitMQ gave it back when the
#: connection was lost, and delivered it again) waits this long before it is looked at.
SAME_ID_RECHECK = 1.0


class Dispatch:
    def __init__(self, current: Current, holding: Holding, intake: Intake, slots: Slots,
                 ack: Callable[[Message], None], push: Callable[[], bool],
                 update_flow: Callable[[int], None], claim_owner: Callable[[int], str]) -> None:
        self.current = current
        self.holding = holding
        self.intake = intake
        self.slots = slots
        self.ack = ack
        #: Does the broker take back what a lost connection held (RabbitMQ)?
        self.push = push
        #: Tell the broker our credit; the argument counts deliveries acked just now.
        self.update_flow = update_flow
        self.claim_owner = claim_owner

    def dispatch(self) -> None:
        """Give each idle child the next buffered message that may start now."""
        for child in list(self.slots.idle()):
            delivery = self._next_startable()
            if delivery is None:
                return
            self._start(child, delivery)

    def _next_startable(self) -> Delivery | None:
        while (delivery := self.holding.next_buffered()) is not None:
            if self.intake.expired(delivery):     # it waited (ETA, buffer) past its expiry
                continue
            if self.holding.has_task_id(delivery.request.id or ""):
                log.info("%s: a copy of it runs here already; looking again in %.0f s",
                         delivery.label, SAME_ID_RECHECK)
                self.intake.schedule(delivery, SAME_ID_RECHECK)
                continue
            return delivery
        return None

    def _start(self, child: Child, delivery: Delivery) -> None:
        if not (delivery.policy.acks_late or delivery.acked or self._ack_at_start(delivery)):
            return
        hard, soft = self._limits(delivery)
        if not self.slots.start(child, delivery, self._job(delivery), hard, soft):
            self.holding.buffer_first(delivery)     # never started: first in line again
            return
        self.holding.start(delivery)
        delivery.started = True

    def _job(self, delivery: Delivery) -> Job:
        request, message = delivery.request, delivery.message
        return Job(delivery.seq, request.task, message.body, message.content_type,
                   message.content_encoding, dict(message.headers or {}),
                   dict(message.delivery_info or {}), self._track_started(delivery.task),
                   delivery.queue, (message.properties or {}).get("priority"),
                   delivery.policy.acks_late, claim_owner=self.claim_owner(delivery.seq),
                   claim_ttl=self.current.settings.visibility_timeout)

    def _ack_at_start(self, delivery: Delivery) -> bool:
        """At-most-once: acked before its child gets it, so an ack that fails never lets it
        run twice. The broker would count the freed slot as room for one more: shrink its
        credit first (same channel, so in that order). False: not acked, not started."""
        delivery.acked = True
        self.update_flow(1)
        try:
            self.ack(delivery.message)
            return True
        except Exception as exc:  # noqa: BLE001 - the broker still has it
            delivery.acked = False
            self.update_flow(0)
            if self.push():              # RabbitMQ took it back with the connection
                self.holding.settle(delivery)
                log.warning("%s: could not ack it at start (%r); not started, the broker "
                            "delivers it again", delivery.label, exc)
            else:                        # still leased to us: try again shortly
                log.warning("%s: could not ack it at start (%r); trying again in %.0f s",
                            delivery.label, exc, SAME_ID_RECHECK)
                self.intake.schedule(delivery, SAME_ID_RECHECK)
            return False

    def _track_started(self, task: Any) -> bool:
        value = getattr(task, "track_started", None)
        return self.current.settings.track_started if value is None else bool(value)

    def _limits(self, delivery: Delivery) -> tuple[float | None, float | None]:
        """Header (which carries the call's options) > task decorator > configuration."""
        request, task, s = delivery.request, delivery.task, self.current.settings
        return (effective_limit(request.time_limit, task.time_limit, s.time_limit),
                effective_limit(request.soft_time_limit, task.soft_time_limit, s.soft_time_limit))
