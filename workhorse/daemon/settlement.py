"""Settling a held message: decide, store what only the supervisor can store, then ack,
requeue or dead-letter it, as docs/delivery.md's Outcomes table says.

Nothing here raises into the loop: a step that fails is logged and contained (the broker
delivers the message again), and a result store that fails is retried from a loop timer,
the message held meanwhile, never by sleeping.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kombu.message import Message

from ..backends import RetryPolicy, reply_of
from ..chords import chord_part_return, fail_chain
from ..exceptions import (
    MalformedMessage,
    NotRegistered,
    TaskRevokedError,
    TimeLimitExceeded,
    TooManyDeliveries,
    WorkerLostError,
)
from ..outcome import Action, Decision, Outcome, Store, decide
from ..protocol import read_message
from ..sqlitedb import said
from ..states import FAILURE, REVOKED
from ..broker.port import MAX_DELAY, BrokerPort
from .apart import Apart
from .current import Current
from .delivery import Delivery, Stage
from .events import TaskEvents
from .metrics import Metrics
from .holding import Holding

if TYPE_CHECKING:
    from .loop import Loop

# Read for every task (see workhorse/outcome.py on Enum attributes).
_SIBLING_LOST, _NOTHING = Outcome.SIBLING_LOST, Store.NOTHING
_ACK, _NO_ACTION = Action.ACK, Action.NONE

log = logging.getLogger("workhorse.supervisor")


class Settlement:
    def __init__(self, current: Current, broker: BrokerPort, loop: Loop, holding: Holding,
                 hostname: str, retry: RetryPolicy, on_change: Callable[[], None]) -> None:
        self.current = current
        self.broker = broker
        self.loop = loop
        self.holding = holding
        self.hostname = hostname
        self.retry = retry
        #: Called after a message is settled or held to store: credit and fetching follow.
        self.on_change = on_change
        #: Where the stores go when the result store's calls may block (made on first use).
        self._apart: Apart | None = None
        #: Task events (how each task ended), set by the supervisor.
        self.events = TaskEvents()
        #: Prometheus counts, when served (metrics_port).
        self.metrics: Metrics | None = None

    def settle(self, delivery: Delivery, outcome: Outcome, detail: str | None) -> None:
        """Carry out the Outcomes table for ``delivery``: store what only the supervisor
        can store, then ack, requeue or dead-letter. Never lets an error escape."""
        decision = decide(outcome, delivery.policy, started=delivery.started,
                          deliveries=delivery.deliveries)
        if outcome is _SIBLING_LOST and delivery.acked:
            log.error("%s: lost: %s, and it was acked when it started (acks_late = false); "
                      "FAILURE(WorkerLostError) stored, not run again", delivery.label, detail)
        if self.events.on:
            self.events.settled(delivery, outcome, decision, detail)
        if self.metrics is not None:
            self.metrics.settled(delivery.request.task, outcome.value)
            if decision.action is Action.DEAD_LETTER:
                self.metrics.dead_lettered += 1
        self._store_then_settle(delivery, outcome, decision, detail, 0)

    def _store_then_settle(self, delivery: Delivery, outcome: Outcome, decision: Decision,
                           detail: str | None, attempt: int) -> None:
        if (decision.store is not _NOTHING
                and getattr(self.current.app.backend, "calls_block", False)):
            self._store_apart(delivery, outcome, decision, detail, attempt)
            return
        try:
            self._store(delivery, decision, detail)
        except Exception as exc:  # noqa: BLE001 - the store's trouble, not the loop's
            if self._retry_later(delivery, outcome, decision, detail, attempt, exc):
                return
            decision = self._without_result(delivery, decision)
        self.carry_out(delivery, outcome, decision, detail)

    def _retry_later(self, delivery: Delivery, outcome: Outcome, decision: Decision,
                     detail: str | None, attempt: int, exc: Exception) -> bool:
        """After a failed store: hold the message and retry from a timer (True), or say
        the result cannot be stored (False)."""
        backend, policy = self.current.app.backend, self.retry
        if (policy.always_retry and attempt < policy.max_retries
                and backend.exception_safe_to_retry(exc)):
            delay = policy.delay(attempt)
            (log.debug if said(exc) else log.warning)(
                "%s: result store: storing its %s result failed (%r); retry %d of %d in "
                "%.2f s, the message held until then", delivery.label,
                decision.store.value, exc, attempt + 1, policy.max_retries, delay)
            backend.on_connection_error(exc)
            self.holding.store(delivery)
            delivery.settlement = (outcome, decision, detail)
            delivery.timer = self.loop.call_later(delay, lambda: self._store_then_settle(
                delivery, outcome, decision, detail, attempt + 1))
            self.on_change()
            return True
        log.error("%s: could not store its %s result (%r)", delivery.label,
                  decision.store.value, exc)
        return False

    def _store_apart(self, delivery: Delivery, outcome: Outcome, decision: Decision,
                     detail: str | None, attempt: int) -> None:
        """The store on the Apart thread, the message held meanwhile; settled when it
        ends, unless settled otherwise first (stopping: give_up_storing)."""
        self.holding.store(delivery)
        settlement = delivery.settlement = (outcome, decision, detail)
        self.on_change()
        if self._apart is None:
            self._apart = Apart(self.loop, "result-store")

        def then(exc: BaseException | None) -> None:
            if delivery.stage is not Stage.STORING or delivery.settlement is not settlement:
                return
            if exc is None:
                self.carry_out(delivery, outcome, decision, detail)
            elif not (isinstance(exc, Exception) and self._retry_later(
                    delivery, outcome, decision, detail, attempt, exc)):
                self.carry_out(delivery, outcome, self._without_result(delivery, decision),
                               detail)
        self._apart.submit(lambda: self._store(delivery, decision, detail), then)

    def _without_result(self, delivery: Delivery, decision: Decision) -> Decision:
        """The result could not be stored: never ack it away without one. Dead letters keep
        the message anyway; an ack becomes a requeue (counted if it started)."""
        if decision.action is not Action.ACK or delivery.acked:
            return decision
        if not delivery.started:
            return Decision(Action.REQUEUE)
        return decide(Outcome.STORE_FAILED, delivery.policy, started=True,
                      deliveries=delivery.deliveries)

    def carry_out(self, delivery: Delivery, outcome: Outcome, decision: Decision,
                  detail: str | None) -> None:
        """Ack, requeue or dead-letter with the broker; the delivery is ours no longer."""
        self.holding.settle(delivery)
        message, queue = delivery.message, delivery.queue
        action = decision.action
        try:
            if action is _ACK or action is _NO_ACTION:     # (nearly every task)
                if action is _ACK and not delivery.acked:
                    self.broker.ack(message)
            elif action is Action.REQUEUE:
                self.broker.requeue(queue, message)
            elif action is Action.REQUEUE_COUNTED:
                log.warning("%s: %s; requeued (started %d of at most %d times)", delivery.label,
                            detail, delivery.deliveries, delivery.policy.max_deliveries)
                self.broker.requeue_counted(queue, message, delivery.deliveries)
            elif action is Action.REQUEUE_HELD_LOSS:
                log.info("%s: %s; requeued, not charged a delivery (held losses: %d of "
                         "at most %d)", delivery.label, detail, delivery.held_losses + 1,
                         self.current.settings.max_held_losses)
                self.broker.requeue_held_loss(queue, message)
            elif action is Action.DEAD_LETTER:
                reason = f"{outcome.value}: {detail}" if detail else outcome.value
                log.error("%s: dead-lettered to %s.dead: %s", delivery.label, queue, reason)
                self.broker.dead_letter(queue, message, reason, delivery.request.id,
                                        self.hostname, acked=delivery.acked)
        except Exception as exc:  # noqa: BLE001 - the broker decides what happens to it now
            self._broker_failed(delivery.label, decision.action.value, exc)
        self.on_change()

    def _broker_failed(self, label: str, what: str, exc: Exception) -> None:
        if self.broker.is_connection_error(exc):
            (log.debug if said(exc) else log.warning)(
                "%s: could not %s the message, its broker connection is gone (%r); the "
                "broker will deliver it again", label, what, exc)
        else:
            log.error("%s: could not %s the message; the broker will deliver it again",
                      label, what, exc_info=exc)

    def give_up_storing(self) -> None:
        """Stopping with results still unstored: settle those messages without them."""
        for delivery in sorted(self.holding.storing, key=lambda d: d.seq):
            log.error("%s: stopping before its result could be stored", delivery.label)
            assert delivery.settlement is not None
            outcome, decision, detail = delivery.settlement
            self.carry_out(delivery, outcome, self._without_result(delivery, decision), detail)

    # ------------------------------------------------------------------ not run here
    def requeue(self, delivery: Delivery) -> None:
        """Back to its queue, not counted: it did not run (warm shutdown, stopping)."""
        self.holding.settle(delivery)
        if not delivery.acked:
            self.give_back(delivery.queue, delivery.message, delivery.label)

    def hand_back(self, delivery: Delivery) -> None:
        """A fresh copy to the end of its queue, then ack (ETA messages over
        max_scheduled, or held for long on RabbitMQ)."""
        self._hand_back(delivery, lambda: self.broker.hand_back(delivery.queue,
                                                                delivery.message))

    def _hand_back(self, delivery: Delivery, send: Callable[[], None]) -> None:
        self.holding.settle(delivery)
        try:
            send()
        except Exception as exc:  # noqa: BLE001 - the broker returns it when the lease ends
            log.error("%s: could not hand it back (%r); the broker returns it when its lease "
                      "ends or the connection closes", delivery.label, exc)

    def hand_back_later(self, delivery: Delivery, delay: float) -> bool:
        """An ETA message due in ``delay`` s, on a queue whose broker can hold it that long
        (RabbitMQ's delay levels, for a quorum queue, where a message held here takes a
        place in the consumer's fixed prefetch): a fresh copy through them, back at its
        ETA, then ack. False (held here instead) on any other queue."""
        seconds = math.ceil(delay)
        if delivery.queue not in self.broker.delayable or not 0 < seconds <= MAX_DELAY:
            return False
        self._hand_back(delivery, lambda: self.broker.hand_back_later(
            delivery.queue, delivery.message, seconds))
        return True

    def give_back(self, queue: str, message: Message, label: str = "a message") -> None:
        """Requeue, uncounted; if even that fails, the broker has it back anyway once our
        lease runs out or the connection closes."""
        try:
            self.broker.requeue(queue, message)
        except Exception as exc:  # noqa: BLE001 - see the log line
            log.warning("%s: could not give it back (%r); the broker returns it when its "
                        "lease ends or the connection closes", label, exc)

    def dead_letter_malformed(self, queue: str, message: Message, reason: str, *,
                              kind: Outcome = Outcome.MALFORMED) -> None:
        """A message that gives no task id, dead-lettered for ``kind`` (malformed, or
        held by too many workers that died): there is no result to fail, so it is only
        dead-lettered (one that gives an id is settled as ``kind``)."""
        if self.metrics is not None:
            self.metrics.dead_lettered += 1
        log.error("%s message on %s, giving no task id (no result stored), dead-lettered "
                  "to %s.dead: %s", kind.value, queue, queue, reason)
        try:
            self.broker.dead_letter(queue, message, f"{kind.value}: {reason}", None,
                                    self.hostname, acked=False, or_requeue=True)
        except Exception as exc:  # noqa: BLE001 - the broker delivers it again
            self._broker_failed(f"a {kind.value} message on {queue}", "dead-letter", exc)

    # ------------------------------------------------------------------ results
    def _store(self, delivery: Delivery, decision: Decision, detail: str | None) -> None:
        """Write the results only the supervisor can write (the child is gone or never ran)."""
        if decision.store is _NOTHING:
            return
        request = delivery.request
        task_id = request.id
        assert task_id is not None      # read_request and malformed_request require one
        info = {"task": request.task, "hostname": self.hostname,
                "retries": request.retries, "group": request.group,
                "parent_id": request.parent_id,
                "delivery_info": dict(delivery.message.delivery_info or {}),
                **reply_of(delivery.message.properties)}
        backend = self.current.app.backend
        if decision.store is Store.REVOKED:
            backend.mark_as_revoked(task_id, detail or "revoked", request=info)
            self._chord_part(delivery, REVOKED, TaskRevokedError(detail or "revoked"))
            return
        exc = _stored_exception(decision.store, request.task, detail)
        backend.mark_as_failure(task_id, exc, None, request=info)
        if decision.store is not Store.MALFORMED:
            fail_chain(self.current.app, self._embed(delivery).get("chain"), exc, None,
                       inline_errbacks=False)
        self._chord_part(delivery, FAILURE, exc)

    def _chord_part(self, delivery: Delivery, state: str, result: Any) -> None:
        """A chord header task that ended here (killed, lost, unknown) still counts toward
        its chord, or the chord would wait forever. Errbacks are sent, not run here: the
        supervisor never runs task code."""
        request = delivery.request
        if not request.group or request.id is None:
            return
        embed = self._embed(delivery)
        if embed.get("chord"):
            chord_part_return(self.current.app, request.group, request.id,
                              request.group_index, state, result, embed["chord"],
                              inline_errbacks=False)

    @staticmethod
    def _embed(delivery: Delivery) -> dict[str, Any]:
        """The message's workflow fields (callbacks, chain, chord); none if unreadable."""
        message = delivery.message
        try:
            _, (_, _, embed) = read_message(message.headers, message.body, message.content_type,
                                            message.content_encoding)
        except MalformedMessage:
            return {}
        return embed


def _stored_exception(store: Store, task_name: str, detail: str | None) -> BaseException:
    if store is Store.TIME_LIMIT:
        return TimeLimitExceeded(detail)
    if store is Store.WORKER_LOST:
        return WorkerLostError(detail)
    if store is Store.NOT_REGISTERED:
        return NotRegistered(task_name)
    if store is Store.TOO_MANY:
        return TooManyDeliveries(detail)
    if store is Store.MALFORMED:
        return MalformedMessage(detail)
    raise ValueError(f"the supervisor stores no result for {store!r}")  # pragma: no cover
