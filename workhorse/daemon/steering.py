"""What remote control's commands do to the supervisor, on its loop thread (the control
thread runs them there through ``ControlThread.steer``).

A revoke: what it names and is held here without having started (buffered, scheduled) is
settled REVOKED at once (stored, acked); what arrives or comes up later is caught by
``Intake.cancelled``; with terminate, a running one's child is signalled
(``Slots.terminate``) and its job settled as TERMINATED when it dies.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

from ..control.commands import RevokeResult
from ..control.revoked import Revoked
from ..outcome import Outcome
from .current import Current
from .delivery import Stage
from .events import EventThread
from ..broker.port import BrokerPort
from .holding import Holding
from .intake import Intake
from .reload import POOL_MAX, POOL_MIN, Reload
from .slots import Slots


class Steering:
    """``workhorse.control.commands.Steerable``, made of the supervisor's parts."""

    def __init__(self, current: Current, intake: Intake, holding: Holding, slots: Slots,
                 reloading: Reload, warm_shutdown: Callable[[str], None],
                 events: EventThread | None, link: BrokerPort) -> None:
        self.events = events
        self.link = link
        self.current = current
        self.intake = intake
        self.holding = holding
        self.slots = slots
        self.reloading = reloading
        self.warm_shutdown = warm_shutdown

    def revoke(self, entries: Mapping[str, float], terminate: bool,
               sig: int) -> RevokeResult:
        self.intake.revoked.merge(entries)
        these = Revoked()
        these.merge(entries)
        held: set[str] = set()
        terminated: list[str] = []
        for delivery in list(self.holding.all()):
            task_id = delivery.request.id
            held.add(task_id)
            reason = these.match(task_id, delivery.request.headers)
            if reason is None:
                continue
            if delivery.stage in (Stage.BUFFERED, Stage.SCHEDULED):
                self.intake.settlement.settle(delivery, Outcome.REVOKED, reason)
            elif (delivery.stage is Stage.RUNNING and terminate
                  and self.slots.terminate(delivery, sig)):
                terminated.append(task_id)
        return RevokeResult(held=frozenset(held), terminated=terminated)

    def pool_size(self) -> int:
        return self.slots.size

    def resize_pool(self, size: int, why: str) -> int:
        if not POOL_MIN <= size <= POOL_MAX:
            raise ValueError(f"the pool stays at {self.slots.size} children: it may have "
                             f"{POOL_MIN} to {POOL_MAX}, not {size}")
        before = self.slots.size
        self.reloading.resize(size, why)
        return before

    def set_time_limits(self, task: str, soft: float | None, hard: float | None) -> bool:
        found = self.current.app.tasks.get(task)
        if found is None:
            return False
        found.soft_time_limit, found.time_limit = soft, hard
        return True

    def set_task_events(self, on: bool) -> bool:
        """Switch task events; returns whether they were on."""
        if self.events is None:
            raise ValueError("this worker sends no events (send_events, heartbeat_events and "
                             "remote_control are all off)")
        was, self.events.task_events = self.events.task_events, on
        return was

    def heartbeat(self) -> None:
        if self.events is None:
            raise ValueError("this worker sends no events")
        self.events.worker("worker-heartbeat")

    def add_consumer(self, queue: str) -> threading.Event | None:
        return self.link.add_queue(queue)

    def cancel_consumer(self, queue: str) -> threading.Event | None:
        return self.link.cancel_queue(queue)
