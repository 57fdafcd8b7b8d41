"""Where a message goes when it arrives: dead letters for what cannot run, REVOKED for
what expired or was revoked, the schedule for ETA messages, else the buffer. Also the
schedule itself: ETA timers, and the pause in fetching once ``max_scheduled`` is
reached."""
from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any

from kombu.message import Message

from ..control.revoked import Revoked
from ..exceptions import MalformedMessage, NotRegistered
from ..outcome import Outcome, Policy
from ..protocol import (
    Request,
    carried_held_losses,
    header_request,
    is_suspect,
    malformed_request,
    read_request,
)
from .current import Current
from .delivery import Delivery, Stage
from .events import TaskEvents
from .holding import Holding
from .settlement import Settlement

if TYPE_CHECKING:
    from ..config import Settings
    from .loop import Loop

log = logging.getLogger("workhorse.supervisor")

#: After handing back an ETA message over max_scheduled, stop fetching for this long, so a
#: queue of far-future messages is not cycled through the worker at full speed.
SCHEDULE_FULL_PAUSE = 1.0
#: An ETA message due this many seconds or more from now, on a queue whose broker can hold
#: it (a RabbitMQ quorum queue, whose consumers' prefetch is fixed: one held here takes a
#: place in it), goes back through the broker's delay levels instead of waiting here.
DELAY_ON_BROKER = 10.0


def task_policy(task: Any, settings: Settings) -> Policy:
    """The ack options in force for ``task``: its own option, else the configuration."""
    def pick(name: str) -> Any:
        value = getattr(task, name, None) if task is not None else None
        return settings[name] if value is None else value
    return Policy(acks_late=pick("acks_late"),
                  reject_on_worker_lost=pick("reject_on_worker_lost"),
                  acks_on_failure=pick("acks_on_failure"),
                  acks_on_timeout=pick("acks_on_timeout"),
                  max_deliveries=pick("max_deliveries"))


class Intake:
    def __init__(self, current: Current, loop: Loop, holding: Holding,
                 settlement: Settlement, clock: Callable[[], float],
                 now: Callable[[], datetime], on_change: Callable[[], None],
                 accepting: Callable[[], bool]) -> None:
        self.current = current
        self.loop = loop
        self.holding = holding
        self.settlement = settlement
        self.clock = clock
        self.now = now
        self.on_change = on_change
        #: Is the worker taking work? Stopping, nothing new is held.
        self.accepting = accepting
        #: What remote control revoked (by id, by stamped header): never started.
        self.revoked = Revoked()
        #: Task events (task-received), set by the supervisor.
        self.events = TaskEvents()
        self._seq = 0
        self._policies: dict[int, tuple[Any, Settings, Policy]] = {}

    def accept(self, queue: str, message: Message, deliveries: int,
               key: str | None = None) -> None:
        """Look at one received message and place it. ``deliveries``: its delivery count,
        this delivery included, as the broker thread counted it on arrival; ``key``: how
        the worker's journal names it."""
        held = carried_held_losses(message.headers)
        if held >= self.current.settings.max_held_losses:
            self._held_too_often(queue, message, held)
            return
        try:
            request = read_request(message.headers, message.body, message.content_type,
                                   message.content_encoding)
        except MalformedMessage as exc:
            self._malformed(queue, message, str(exc))
            return
        task = self.current.app.tasks.get(request.task)
        delivery = self._delivery(queue, message, request, task)
        if task is None:
            self.settlement.settle(delivery, Outcome.UNKNOWN_TASK,
                                   f"{NotRegistered(request.task)} (does the worker's app "
                                   "define it?)")
            return
        if self.cancelled(delivery):
            return
        delivery.deliveries = deliveries
        delivery.key = key
        if self.holding.async_window:
            delivery.asynchronous = getattr(task, "is_async", False)
        delivery.suspect = is_suspect(message.headers)
        delivery.held_losses = held
        policy = delivery.policy
        if deliveries > policy.max_deliveries:
            detail = (f"delivery {deliveries} of at most {policy.max_deliveries} "
                      f"(max_deliveries): the {deliveries - 1} before it may have started "
                      f"and ended in a loss")
            log.error("%s: %s; dead-lettered", delivery.label, detail)
            self.settlement.settle(delivery, Outcome.TOO_MANY_DELIVERIES, detail)
            return
        if self.events.on:
            self.events.received(delivery)
        eta = request.eta
        if eta is not None and eta > (now := self.now()):     # (a clock read only for one)
            delay = (eta - now).total_seconds()
            if (delay >= DELAY_ON_BROKER and self.accepting()
                    and self.settlement.hand_back_later(delivery, delay)):
                log.debug("%s: due at %s; back through the broker's delay levels",
                          delivery.label, eta.isoformat())
                return
            self.schedule(delivery, delay)
        elif self.holding.async_window and not self.holding.fits(delivery):
            # (taken as room for the other kind: see Holding.room)
            log.debug("%s: no place left for a %s task; handed back to %s", delivery.label,
                      "async" if delivery.asynchronous else "sync", delivery.queue)
            self.settlement.hand_back(delivery)
        elif delivery.suspect:      # first, and alone (Dispatch): soon over, or named
            self.holding.buffer_first(delivery)
        else:
            self.holding.buffer_last(delivery)

    def _held_too_often(self, queue: str, message: Message, held: int) -> None:
        """The backstop for a message that kills its supervisor before it starts (while it
        is read or waits): dead-lettered unread, from what its headers say."""
        limit = self.current.settings.max_held_losses
        detail = (f"held by {held} workers that died before it started (max_held_losses = "
                  f"{limit}): it may be what killed them; not looked at again")
        request = header_request(message.headers)
        if request is None:
            self.settlement.dead_letter_malformed(queue, message, detail,
                                                  kind=Outcome.TOO_MANY_DELIVERIES)
            return
        delivery = self._delivery(queue, message, request,
                                  self.current.app.tasks.get(request.task))
        log.error("%s: %s; dead-lettered", delivery.label, detail)
        self.settlement.settle(delivery, Outcome.TOO_MANY_DELIVERIES, detail)

    def _delivery(self, queue: str, message: Message, request: Request,
                  task: Any) -> Delivery:
        self._seq += 1
        return Delivery(self._seq, queue, message, request, task, self._policy(task),
                        received=self.clock())

    def _policy(self, task: Any) -> Policy:
        """``task_policy``, made once per task and settings in force (a reload replaces
        both, and so this)."""
        settings = self.current.settings
        cached = self._policies.get(id(task))
        if cached is None or cached[0] is not task or cached[1] is not settings:
            cached = self._policies[id(task)] = (task, settings, task_policy(task, settings))
        return cached[2]

    def _malformed(self, queue: str, message: Message, reason: str) -> None:
        """Dead-letter it; if it gives a task id, FAILURE(MalformedMessage) is stored under
        that id first, so a client waiting on the result is told instead of waiting."""
        request = malformed_request(message.headers, message.body, message.content_type,
                                    message.content_encoding)
        if request is None:
            self.settlement.dead_letter_malformed(queue, message, reason)
            return
        delivery = self._delivery(queue, message, request, None)
        self.settlement.settle(delivery, Outcome.MALFORMED, reason)

    def cancelled(self, delivery: Delivery) -> bool:
        """Settle ``delivery`` as REVOKED if it expired or was revoked (not started)."""
        if self.expired(delivery):
            return True
        if not self.revoked:        # (nearly always: match is not called)
            return False
        reason = self.revoked.match(delivery.request.id, delivery.request.headers)
        if reason is None:
            return False
        log.info("%s: %s, not run", delivery.label, reason)
        self.settlement.settle(delivery, Outcome.REVOKED, reason)
        return True

    def expired(self, delivery: Delivery) -> bool:
        """Settle ``delivery`` as REVOKED if its ``expires`` has passed (not started)."""
        expires = delivery.request.expires
        if expires is None or expires > self.now():
            return False
        log.info("%s: expired at %s, not run", delivery.label, expires.isoformat())
        self.settlement.settle(delivery, Outcome.EXPIRED, "expired before it started")
        return True

    # ------------------------------------------------------------------ the schedule
    def schedule(self, delivery: Delivery, delay: float) -> None:
        """Hold a message until its ETA (or to look at it again); it does not take a
        prefetch slot. Past max_scheduled it goes back to its queue instead, and fetching
        pauses briefly."""
        if not self.accepting():
            self.settlement.requeue(delivery)
            return
        if len(self.holding.scheduled) >= self.current.settings.max_scheduled:
            log.warning("%s: %d scheduled messages held already (max_scheduled); handed back "
                        "to %s, fetching paused for %.0f s", delivery.label,
                        len(self.holding.scheduled), delivery.queue, SCHEDULE_FULL_PAUSE)
            self.settlement.hand_back(delivery)
            self._pause_fetching(SCHEDULE_FULL_PAUSE)
            return
        self.holding.schedule(delivery)
        delivery.timer = self.loop.call_later(delay, lambda: self._due(delivery))
        self.on_change()

    def _due(self, delivery: Delivery) -> None:
        delivery.timer = None
        if delivery.stage is not Stage.SCHEDULED:
            return
        self.holding.buffer_first(delivery)   # its time has come: ahead of later arrivals
        self.on_change()

    def _pause_fetching(self, seconds: float) -> None:
        paused = self.clock() < self.holding.paused_until
        self.holding.paused_until = self.clock() + seconds
        if not paused:
            self.on_change()
            self.loop.call_later(seconds, self._resume_fetching)

    def _resume_fetching(self) -> None:
        remaining = self.holding.paused_until - self.clock()
        if remaining > 0:       # extended meanwhile (or the timer fired a hair early)
            self.loop.call_later(remaining, self._resume_fetching)
            return
        self.on_change()

    def refresh_scheduled(self, consumer_timeout: float) -> None:
        """RabbitMQ closes a channel holding an unacked message past its consumer_timeout:
        hand back scheduled messages held for half of it (a fresh copy; not counted)."""
        limit = self.clock() - consumer_timeout / 2
        for delivery in sorted(self.holding.scheduled, key=lambda d: d.seq):
            if delivery.received > limit:
                continue
            log.info("%s: scheduled for %s, held since %.0f s; handed back to %s before "
                     "RabbitMQ's consumer_timeout", delivery.label,
                     delivery.request.eta.isoformat() if delivery.request.eta else "?",
                     self.clock() - delivery.received, delivery.queue)
            self.settlement.hand_back(delivery)
        self.on_change()
