"""Handing buffered messages to idle children, one job each: the start of a task.

With ``acks_late = false`` the message is acked first (at-most-once); the time limits
are armed as the child takes it. Each start is in the worker's journal before the job
reaches its child. A suspect (it may have been running when a worker died) starts only
once every child is idle, and nothing starts beside it: should the worker die again, the
journal names it, not a neighbour.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any


from ..pool.child import Child
from ..pool.ipc import Job
from ..pool.limits import effective_limit
from ..ratelimit import RateLimits
from ..broker.port import BrokerPort
from ..transport.backlog import sent_at
from .current import Current
from .delivery import ACKING, Delivery, Stage
from .events import TaskEvents
from .holding import Holding
from .intake import Intake
from ..broker.journal import Journal
from .loop import Loop, Timer
from .metrics import Metrics
from .slots import Slots

log = logging.getLogger("workhorse.supervisor")

#: A message whose task id is running here already (RabbitMQ gave it back when the
#: connection was lost, and delivered it again) waits this long before it is looked at.
SAME_ID_RECHECK = 1.0
#: A buffered message starts only while its lease was set or renewed less than this part
#: of ``visibility_timeout`` ago; renewals come every quarter of it.
LEASE_TRUSTED_FOR = 0.5


class Dispatch:
    def __init__(self, current: Current, holding: Holding, intake: Intake, slots: Slots,
                 broker: BrokerPort, accepting: Callable[[], bool],
                 on_change: Callable[[], None], claim_owner: Callable[[int], str],
                 loop: Loop, clock: Callable[[], float]) -> None:
        self.current = current
        self.holding = holding
        self.intake = intake
        self.slots = slots
        self.broker = broker
        self.accepting = accepting
        #: Credit and room follow what is held: called after an ack at start changes it
        #: (never to less room: ``Supervisor._no_less_room``).
        self.on_change = on_change
        self.claim_owner = claim_owner
        self.loop = loop
        self.clock = clock
        self.rate_limits = RateLimits()
        #: Task wait times go here when metrics are served; ``wall`` is the epoch clock.
        self.metrics: Metrics | None = None
        self.wall: Callable[[], float] = time.time
        #: Task events (task-started), set by the supervisor.
        self.events = TaskEvents()
        self._rate_wakeup: Timer | None = None    # set while a rate-limited message waits
        #: Did the last dispatch leave a child idle, for want of a message that may start?
        self.left_idle = False
        #: The worker's journal (set by the supervisor once it is open).
        self.journal: Journal | None = None
        #: A suspect that runs (or waits for its ack at start), alone.
        self._alone: Delivery | None = None
        #: Renew every lease held now (``Leases.renew_now``), set by the supervisor.
        self.renew_now: Callable[[], None] = _nothing
        #: Called when an unleased message (RabbitMQ) would start after the loop was away
        #: (frozen) that many seconds: True if it is to wait while the connection is
        #: checked (``checking``). Set by the supervisor.
        self.check_connection: Callable[[float], bool] = _no_check
        self.checking = False
        #: The settings ``_trusted_for`` was read from (a reload brings others).
        self._settings: Any = None
        self._trusted_for = 0.0

    def dispatch(self) -> None:
        """Give each idle child the next buffered message that may start now. One whose
        ack at start is on its way has an idle child kept for it."""
        idle = self.slots.idle()
        self.left_idle = False
        settings = self.current.settings
        if settings is not self._settings:
            self._settings = settings
            self._trusted_for = settings.visibility_timeout * LEASE_TRUSTED_FOR
        alone = self._alone
        if alone is not None:
            if alone.stage in (Stage.RUNNING, Stage.ACKING, Stage.NEW):
                return
            self._alone = None
        if self.holding.async_window:
            self._dispatch_mixed(idle)
            return
        for child in idle[len(self.holding.acking):]:
            delivery = self._next_startable(self._must_wait)
            if delivery is None:
                self.left_idle = True
                return
            if delivery.suspect:
                if self.holding.running or self.holding.acking:
                    self.holding.buffer_first(delivery)     # once the others are over
                    return
                self._alone = delivery
            if delivery.policy.acks_late or delivery.acked:
                self._start(child, delivery)
            else:
                self._ack_at_start(delivery)
            if delivery.suspect:
                return

    def _dispatch_mixed(self, idle: list[Child]) -> None:
        """Where the app has async tasks: a sync message goes to an idle child; an async
        one to the child with the fewest async tasks that has room for one more (an idle
        child has none). A sync message that finds no idle child has one reserved for
        it: that child is given no more async tasks until it is idle. An async message
        charged before runs in an idle child, alone (``_alone_in_child``)."""
        holding = self.holding
        idle = idle[sum(1 for d in holding.acking if not d.asynchronous):]
        # (Not one whose pipe is full: its loop is slow or blocked; no more for it now.)
        busy = [c for c in self.slots.children()
                if c.busy and c.asynchronous and not c.draining and not c.reserved
                and not getattr(c.handle, "pending", False) and not self.slots.spent(c)]
        default = self.current.settings.async_concurrency
        waiting_sync = False
        if not idle and not any(len(c.jobs) < default for c in busy):
            # Nothing can start: no pass over a buffer of thousands each turn.
            self._reserve_for_sync(busy, len(holding.buffer) > holding.buffered_async)
            self.left_idle = False
            return

        def place(delivery: Delivery) -> Child | None:
            if not delivery.asynchronous or _alone_in_child(delivery):
                return idle[0] if idle else None
            limit = min(getattr(delivery.task, "async_concurrency", None) or default, default)
            candidates = [c for c in busy if len(c.jobs) < limit]
            if idle:
                return idle[0]
            return min(candidates, key=lambda c: len(c.jobs)) if candidates else None

        def must_wait(delivery: Delivery) -> bool:
            nonlocal waiting_sync
            if place(delivery) is None:
                waiting_sync = waiting_sync or not delivery.asynchronous
                return True
            return self._must_wait(delivery)

        while (delivery := self._next_startable(must_wait)) is not None:
            child = place(delivery)
            assert child is not None
            if delivery.suspect:
                if holding.running or holding.acking:
                    holding.buffer_first(delivery)
                    break
                self._alone = delivery
            if delivery.policy.acks_late or delivery.acked:
                was_idle = not child.busy
                started = self._start(child, delivery)
                if was_idle:
                    idle.remove(child)
                    # One charged before runs with no async task beside it.
                    child.reserved = _alone_in_child(delivery)
                    if (started and delivery.asynchronous and not child.reserved
                            and not self.slots.spent(child)):
                        busy.append(child)
                elif not started or self.slots.spent(child):
                    busy.remove(child)      # its pipe failed (it is killed), or it is spent
            else:
                self._ack_at_start(delivery)
                if not delivery.asynchronous:
                    idle.remove(child)      # kept for it while its ack is on its way
            if delivery.suspect:
                break
        if not idle:
            self._reserve_for_sync(busy, waiting_sync)
        self.left_idle = bool(idle) or any(len(c.jobs) < default for c in busy)

    def _reserve_for_sync(self, busy: list[Child], waiting_sync: bool) -> None:
        """A sync message waits and every child runs async tasks: the least busy gets no
        new ones (unless one is kept from them already), so it is soon idle for it."""
        if waiting_sync and busy and not any(
                c.reserved for c in self.slots.children() if c.busy):
            min(busy, key=lambda c: len(c.jobs)).reserved = True

    def _next_startable(self, wait: Callable[[Delivery], bool]) -> Delivery | None:
        while (delivery := self.holding.next_buffered(wait)) is not None:
            if self.intake.cancelled(delivery):   # it expired or was revoked while it waited
                continue
            twin = self.holding.twin(delivery.request.id or "")
            if twin is not None:
                log.info("%s: a copy of it runs here already; looking again in %.0f s",
                         delivery.label, SAME_ID_RECHECK)
                # The same message twice (its publisher's delivery tag: the broker gave
                # it twice) is a redelivery, whatever its count says; one published twice
                # under one id is not (only the idempotency guard stops that running twice).
                tag = (delivery.message.properties or {}).get("delivery_tag")
                if tag is not None and tag == (twin.message.properties or {}).get(
                        "delivery_tag"):
                    delivery.copy_seen = True
                self.intake.schedule(delivery, SAME_ID_RECHECK)
                continue
            return delivery
        return None

    def _must_wait(self, delivery: Delivery) -> bool:
        """Must this buffered message wait (it keeps its place, others pass it)? For its
        task's rate limit; or, on a leased broker (SQLite, Redis), because its lease may
        be gone: taken or last renewed ``_trusted_for`` (half the visibility timeout) ago
        or more, by the clock the broker's sweep reads. Renewals come every quarter of
        it, so a loop that runs and reaches its broker never sees that; one that was
        frozen (SIGSTOP, a VM paused) or whose renewals could not get through may have
        lost the lease, and another worker may run the message already. Every lease held
        is renewed now: one found ours is fresh again and the message starts; one found
        lost is dropped (``Leases``), not run here. (An ack at start's message, acked,
        has no lease left to lose.) On RabbitMQ, which has no lease: after the loop was
        away STALL seconds or more, while the connection is checked (a connection found
        lost takes the buffered messages back before they could start)."""
        set_at = self.broker.lease_set_at(delivery.message)
        if set_at is None:
            # No lease (RabbitMQ): if the loop was away, the broker may have closed the
            # connection meanwhile and given the message to another consumer. Checked
            # here, at the start itself, wherever in a turn the freeze landed. An ack at
            # start's message too: its ack may have been written after the freeze, to a
            # connection the broker had closed already (a loss the check finds drops it,
            # not run: at most once).
            if self.checking or (
                    (away := self.loop.away_for()) and self.check_connection(away)):
                return True
        elif self.wall() - set_at >= self._trusted_for and not delivery.acked:
            self.renew_now()
            return True
        return self._rate_limited(delivery)

    def _rate_limited(self, delivery: Delivery) -> bool:
        """Must this buffered message wait for its task's rate limit? It keeps its place
        in the buffer (and in the prefetch window: a worker does not hoard what it may not
        start), others pass it, and the loop wakes when it may start."""
        rate = getattr(delivery.task, "rate_limit", None)
        if rate is None:
            return False
        now = self.clock()
        wait = self.rate_limits.wait(delivery.request.task, rate, now)
        if wait <= 0:
            return False
        wakeup = self._rate_wakeup
        if wakeup is None or wakeup.cancelled or wakeup.when > now + wait:
            if wakeup is not None:
                wakeup.cancel()
            self._rate_wakeup = self.loop.call_later(wait, self._rate_woken)
        return True

    def _rate_woken(self) -> None:
        self._rate_wakeup = None       # the loop turns, and dispatches, after its timers

    def _start(self, child: Child, delivery: Delivery) -> bool:
        hard, soft = self._limits(delivery)
        if self.journal is not None and delivery.key is not None:
            self.journal.started(delivery.key)      # before the child can run it
        if not self.slots.start(child, delivery, self._job(delivery), hard, soft):
            self.holding.buffer_first(delivery)     # never started: first in line again
            return False
        self.holding.start(delivery)
        delivery.started = True
        self.rate_limits.take(delivery.request.task, self.clock())
        if self.metrics is not None:
            self._waited(delivery)
        if self.events.on:
            self.events.started(delivery)
        return True

    def _waited(self, delivery: Delivery) -> None:
        """How long it waited to start: since it was due (an ETA later than its send),
        sent (a stamped message), or received here."""
        message, eta = delivery.message, delivery.request.eta
        now = self.wall()
        sent = sent_at(message.properties, message.headers)
        due = eta.timestamp() if eta is not None else None
        assert self.metrics is not None
        if due is not None and (sent is None or due > sent):
            self.metrics.waited("due", now - due)
        elif sent is not None:
            self.metrics.waited("sent", now - sent)
        else:
            self.metrics.waited("received", self.clock() - delivery.received)

    def _job(self, delivery: Delivery) -> Job:
        request, message = delivery.request, delivery.message
        delivery_info = dict(message.delivery_info or {})
        if delivery.deliveries > 1 or delivery.copy_seen or delivery.held_losses:
            # Delivered before (a counted requeue's copy, a lease that ran out, another
            # copy that was held here, whose count a broker restart may have lost, or held
            # by a worker that died, maybe once its task was over): the task sees it as
            # redelivered, as kombu marks the messages it restores, and the child acks it
            # without running it if its SUCCESS is stored already.
            delivery_info["redelivered"] = True
        priority = (message.properties or {}).get("priority")
        delivery_info.setdefault("priority", priority)      # as Celery's request has it
        # The message's headers and properties as they are, not copies: the frame is
        # encoded as the job is written (ipc.encode; a mapping that is not a dict goes
        # pickled), and nothing keeps the Job after that.
        job = Job(delivery.seq, request.task, message.body, message.content_type,
                  message.content_encoding, message.headers or {},
                  delivery_info, self._track_started(delivery.task),
                  str(delivery.queue), priority,   # (not a QueueName: see ipc.encode)
                  delivery.policy.acks_late, claim_owner=self.claim_owner(delivery.seq),
                  claim_ttl=self.current.settings.visibility_timeout,
                  properties=message.properties or {}, events=self.events.on)
        if delivery.asynchronous:       # its child keeps its limits
            hard, soft = self._limits(delivery)
            job = job._replace(asynchronous=True, soft_limit=soft, hard_limit=hard)
        return job

    def _ack_at_start(self, delivery: Delivery) -> None:
        """At-most-once: acked before a child gets it, so an ack that fails never lets it
        run twice. It waits (ACKING, counted in the window) for the broker thread's answer;
        the credit shrinks first, so the freed place is not taken as room for one more."""
        self.holding.ack_at_start(delivery)
        self.on_change()
        self.broker.ack_then(delivery.message, lambda error: self._acked(delivery, error))

    def _acked(self, delivery: Delivery, error: BaseException | None) -> None:
        """The broker thread's answer to an ack at start (on the loop thread)."""
        if delivery.stage is not ACKING:
            return
        if error is None:
            delivery.acked = True
            if self.accepting():
                self.holding.buffer_first(delivery)     # next to start
            else:
                # Stopping, and acked: no child will take it now. A copy goes back to its
                # queue, so an at-most-once task is not lost to a shutdown either.
                self.holding.settle(delivery)
                log.info("%s: acked at start as the worker stopped; a copy is back in %s",
                         delivery.label, delivery.queue)
                self.broker.republish(delivery.queue, delivery.message, {})
        elif self.broker.push:          # RabbitMQ took it back with the connection
            self.holding.settle(delivery)
            log.warning("%s: could not ack it at start (%r); not started, the broker "
                        "delivers it again", delivery.label, error)
        else:                            # still leased to us: try again shortly
            log.warning("%s: could not ack it at start (%r); trying again in %.0f s",
                        delivery.label, error, SAME_ID_RECHECK)
            self.intake.schedule(delivery, SAME_ID_RECHECK)
        self.on_change()

    def _track_started(self, task: Any) -> bool:
        value = getattr(task, "track_started", None)
        return self.current.settings.track_started if value is None else bool(value)

    def _limits(self, delivery: Delivery) -> tuple[float | None, float | None]:
        """Header (which carries the call's options) > task decorator > configuration."""
        request, task, s = delivery.request, delivery.task, self.current.settings
        return (effective_limit(request.time_limit, task.time_limit, s.time_limit),
                effective_limit(request.soft_time_limit, task.soft_time_limit, s.soft_time_limit))


def _alone_in_child(delivery: Delivery) -> bool:
    """An async message charged a delivery before (its child died with it, maybe for it)
    runs in a child of its own: should it kill that child again, no task beside it pays."""
    return delivery.asynchronous and (delivery.deliveries > 1 or delivery.suspect)


def _nothing() -> None:
    pass


def _no_check(away: float) -> bool:
    return False
