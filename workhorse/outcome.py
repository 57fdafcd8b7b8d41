"""What became of a message, and how it is settled: docs/delivery.md's Outcomes table as code.

Pure: no I/O. The supervisor asks ``decide`` and carries the answer out.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Outcome(str, enum.Enum):
    SUCCEEDED = "succeeded"          # the task returned; its result is stored
    FAILED = "failed"                # the task raised (incl. an uncaught soft limit); stored
    STORE_FAILED = "store_failed"    # the task ran but its result could not be stored
    CONTINUATION_FAILED = "continuation_failed"  # stored, but a callback/next step unsent
    MALFORMED = "malformed"          # headers or body unreadable: no task to run
    UNKNOWN_TASK = "unknown_task"    # no such task registered
    EXPIRED = "expired"              # `expires` passed before it started
    REVOKED = "revoked"              # revoked (by id or stamped header) before it started
    TERMINATED = "terminated"        # revoked with terminate: its child was killed
    TOO_MANY_DELIVERIES = "too_many_deliveries"
    TIME_LIMIT = "time_limit"        # hard limit: the child was killed
    CHILD_LOST = "child_lost"        # the child died mid-task (signal, OOM, os._exit)
    SHUTDOWN_KILLED = "shutdown_killed"  # a cold shutdown killed the child mid-task
    SIBLING_LOST = "sibling_lost"    # its child was killed for another async task
    RETRY = "retry"                  # the retry is published (and RETRY stored)
    ALREADY_DONE = "already_done"    # its SUCCESS (or idempotency key) is done: not run
    CLAIMED_ELSEWHERE = "claimed_elsewhere"  # idempotent: another delivery runs it now
    NOT_RUN = "not_run"              # the store, asked whether it may run, did not answer
    IGNORED = "ignored"              # raise Ignore(): no result
    REJECTED = "rejected"            # raise Reject(requeue=False): FAILURE stored
    REJECTED_REQUEUE = "rejected_requeue"  # raise Reject(requeue=True): no result


class Action(str, enum.Enum):
    NONE = "none"                    # already settled (acked at start)
    ACK = "ack"
    REQUEUE = "requeue"              # back to its queue; does not count as a delivery
    REQUEUE_COUNTED = "requeue_counted"  # back to its queue as a started delivery
    REQUEUE_HELD_LOSS = "requeue_held_loss"  # back to its queue, counted as a held loss
    DEAD_LETTER = "dead_letter"      # a copy to the dead-letter queue, then ack (if not acked)


class Store(str, enum.Enum):
    """What the supervisor itself writes to the result store (the child wrote the rest)."""

    NOTHING = "nothing"
    TIME_LIMIT = "time_limit"        # FAILURE(TimeLimitExceeded)
    WORKER_LOST = "worker_lost"      # FAILURE(WorkerLostError)
    NOT_REGISTERED = "not_registered"  # FAILURE(NotRegistered)
    REVOKED = "revoked"              # REVOKED
    TOO_MANY = "too_many"            # FAILURE(TooManyDeliveries)
    MALFORMED = "malformed"          # FAILURE(MalformedMessage), under the id it gives


# Reading an attribute of an Enum class (``Outcome.FAILED``) goes through the slow path of
# EnumType.__getattr__ on Python 3.11: about 15 times the cost of reading a global. The
# supervisor read some 60 a task, 9% of its instructions (benchmarks/instructions.py), so
# the code every message passes through compares against members held in module names:
# here, beside Stage (daemon/delivery.py), ChildState (pool/child.py) and in the modules
# that read them. (Python 3.12 dropped that __getattr__; a member read there still costs
# about three globals'.)
_OUTCOMES = {outcome.value: outcome for outcome in Outcome}


def outcome_of(value: str) -> Outcome:
    """``Outcome(value)`` (a ValueError for a value that is none), without Enum's call."""
    found = _OUTCOMES.get(value)
    return found if found is not None else Outcome(value)


@dataclass(frozen=True)
class Policy:
    """The ack options in force for one task (task option, else configuration)."""

    acks_late: bool = True
    reject_on_worker_lost: bool = True
    acks_on_failure: bool = True
    acks_on_timeout: bool = True
    max_deliveries: int = 3


@dataclass(frozen=True)
class Decision:
    action: Action
    store: Store = Store.NOTHING


#: Outcomes that an ack settles, with nothing for the supervisor to store (acked at start:
#: nothing at all to do). ``decide`` checks them first.
_PLAIN = (Outcome.SUCCEEDED, Outcome.RETRY, Outcome.IGNORED, Outcome.ALREADY_DONE)
_ACK, _NO_ACTION = Decision(Action.ACK), Decision(Action.NONE)


def decide(outcome: Outcome, policy: Policy, *, started: bool, deliveries: int = 0) -> Decision:
    """How to settle ``outcome``.

    ``started``: the message was handed to a child (with early ack it is then already acked).
    ``deliveries``: the message's delivery count, this delivery included; a counted
    requeue that would allow more than ``max_deliveries`` deliveries dead-letters instead.
    """
    if outcome in _PLAIN:       # (nearly every task: first, and no Decision made)
        return _ACK if policy.acks_late or not started else _NO_ACTION
    if outcome is Outcome.MALFORMED:
        # Even when acked at start, a copy goes to the dead-letter queue: never a silent loss.
        # The supervisor stores the failure wherever the message was found malformed (the
        # child only reports it), so a client waiting on its id does not wait for ever.
        return Decision(Action.DEAD_LETTER, Store.MALFORMED)
    if outcome is Outcome.UNKNOWN_TASK:
        return Decision(Action.DEAD_LETTER, Store.NOT_REGISTERED)
    if outcome in (Outcome.EXPIRED, Outcome.REVOKED):
        return Decision(Action.ACK, Store.REVOKED)
    if outcome is Outcome.TERMINATED:
        # Never run again: an operator stopped it on purpose.
        return Decision(Action.NONE if started and not policy.acks_late else Action.ACK,
                        Store.REVOKED)
    if outcome is Outcome.TOO_MANY_DELIVERIES:
        return Decision(Action.DEAD_LETTER, Store.TOO_MANY)
    if not policy.acks_late:
        # At-most-once: acked when the child started it; only the result remains to write.
        store = {Outcome.TIME_LIMIT: Store.TIME_LIMIT, Outcome.CHILD_LOST: Store.WORKER_LOST,
                 Outcome.SHUTDOWN_KILLED: Store.WORKER_LOST,
                 Outcome.SIBLING_LOST: Store.WORKER_LOST}.get(outcome, Store.NOTHING)
        return Decision(Action.NONE if started else Action.ACK, store)
    if outcome in (Outcome.CLAIMED_ELSEWHERE, Outcome.NOT_RUN):
        # The supervisor holds such a message and tries again later; settled, it would
        # be given back uncounted (it did not run).
        return Decision(Action.REQUEUE)
    if outcome is Outcome.REJECTED:
        return Decision(Action.DEAD_LETTER)
    if outcome is Outcome.REJECTED_REQUEUE:
        return _requeue_counted(policy, deliveries, Store.NOTHING)
    if outcome is Outcome.FAILED:
        return Decision(Action.ACK if policy.acks_on_failure else Action.DEAD_LETTER)
    if outcome in (Outcome.STORE_FAILED, Outcome.CONTINUATION_FAILED):
        # Redelivered, a CONTINUATION_FAILED message finds its SUCCESS stored and sends
        # its continuations without running again.
        return _requeue_counted(policy, deliveries, Store.NOTHING)
    if outcome is Outcome.TIME_LIMIT:
        if policy.acks_on_timeout:
            return Decision(Action.ACK, Store.TIME_LIMIT)
        return _requeue_counted(policy, deliveries, Store.TIME_LIMIT)
    if outcome is Outcome.CHILD_LOST:
        if policy.reject_on_worker_lost:
            return _requeue_counted(policy, deliveries, Store.WORKER_LOST)
        return Decision(Action.DEAD_LETTER, Store.WORKER_LOST)
    if outcome is Outcome.SIBLING_LOST:
        # It did nothing wrong: not a delivery. A held loss all the same, so that a poison
        # blamed on the wrong task cannot come back for ever (max_held_losses).
        return Decision(Action.REQUEUE_HELD_LOSS)
    if outcome is Outcome.SHUTDOWN_KILLED:
        if policy.reject_on_worker_lost:
            return Decision(Action.REQUEUE)
        return Decision(Action.DEAD_LETTER, Store.WORKER_LOST)
    raise ValueError(f"no settlement rule for {outcome!r}")  # pragma: no cover


def _requeue_counted(policy: Policy, deliveries: int, store_if_dead: Store) -> Decision:
    if deliveries >= policy.max_deliveries:
        return Decision(Action.DEAD_LETTER, store_if_dead)
    return Decision(Action.REQUEUE_COUNTED)
