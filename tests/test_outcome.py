"""docs/delivery.md's Outcomes table, row by row, as the pure decision function sees it."""
from __future__ import annotations

import pytest

from workhorse.outcome import Action, Decision, Outcome, Policy, Store, decide, outcome_of

DEFAULT = Policy()
EARLY = Policy(acks_late=False)


@pytest.mark.parametrize("outcome, policy, expected", [
    (Outcome.SUCCEEDED, DEFAULT, Decision(Action.ACK)),
    (Outcome.SUCCEEDED, EARLY, Decision(Action.NONE)),
    (Outcome.FAILED, DEFAULT, Decision(Action.ACK)),
    (Outcome.FAILED, Policy(acks_on_failure=False), Decision(Action.DEAD_LETTER)),
    (Outcome.FAILED, EARLY, Decision(Action.NONE)),
    (Outcome.TIME_LIMIT, DEFAULT, Decision(Action.ACK, Store.TIME_LIMIT)),
    (Outcome.TIME_LIMIT, Policy(acks_on_timeout=False), Decision(Action.REQUEUE_COUNTED)),
    (Outcome.TIME_LIMIT, EARLY, Decision(Action.NONE, Store.TIME_LIMIT)),
    (Outcome.CHILD_LOST, DEFAULT, Decision(Action.REQUEUE_COUNTED)),
    (Outcome.CHILD_LOST, Policy(reject_on_worker_lost=False),
     Decision(Action.DEAD_LETTER, Store.WORKER_LOST)),
    (Outcome.CHILD_LOST, EARLY, Decision(Action.NONE, Store.WORKER_LOST)),
    (Outcome.SHUTDOWN_KILLED, DEFAULT, Decision(Action.REQUEUE)),
    (Outcome.SHUTDOWN_KILLED, Policy(reject_on_worker_lost=False),
     Decision(Action.DEAD_LETTER, Store.WORKER_LOST)),
    (Outcome.STORE_FAILED, DEFAULT, Decision(Action.REQUEUE_COUNTED)),
    (Outcome.CONTINUATION_FAILED, DEFAULT, Decision(Action.REQUEUE_COUNTED)),
    (Outcome.CONTINUATION_FAILED, EARLY, Decision(Action.NONE)),
    (Outcome.ALREADY_DONE, DEFAULT, Decision(Action.ACK)),
    (Outcome.ALREADY_DONE, EARLY, Decision(Action.NONE)),
    (Outcome.RETRY, DEFAULT, Decision(Action.ACK)),
    (Outcome.RETRY, EARLY, Decision(Action.NONE)),
    (Outcome.IGNORED, DEFAULT, Decision(Action.ACK)),
    (Outcome.IGNORED, EARLY, Decision(Action.NONE)),
    (Outcome.CLAIMED_ELSEWHERE, DEFAULT, Decision(Action.REQUEUE)),
    (Outcome.CLAIMED_ELSEWHERE, EARLY, Decision(Action.NONE)),
])
def test_started_outcomes(outcome, policy, expected):
    assert decide(outcome, policy, started=True, deliveries=1) == expected


@pytest.mark.parametrize("policy", [DEFAULT, EARLY])
def test_outcomes_before_start_do_not_depend_on_ack_mode(policy):
    assert decide(Outcome.UNKNOWN_TASK, policy, started=False) == Decision(
        Action.DEAD_LETTER, Store.NOT_REGISTERED)
    assert decide(Outcome.EXPIRED, policy, started=False) == Decision(Action.ACK, Store.REVOKED)
    assert decide(Outcome.TOO_MANY_DELIVERIES, policy, started=False) == Decision(
        Action.DEAD_LETTER, Store.TOO_MANY)


@pytest.mark.parametrize("outcome", [Outcome.SUCCEEDED, Outcome.RETRY, Outcome.IGNORED,
                                     Outcome.ALREADY_DONE])
@pytest.mark.parametrize("policy", [DEFAULT, EARLY])
def test_a_plain_outcome_never_started_is_acked_in_both_modes(outcome, policy):
    """Not acked at start (it never reached a child): an ack settles it, whatever the mode."""
    assert decide(outcome, policy, started=False) == Decision(Action.ACK)


def test_a_dones_outcome_is_read_as_the_enum_reads_it():
    for outcome in Outcome:
        assert outcome_of(outcome.value) is outcome
    with pytest.raises(ValueError, match="not a valid Outcome"):
        outcome_of("exploded")


@pytest.mark.parametrize("policy", [DEFAULT, EARLY])
def test_malformed_is_dead_lettered_in_both_modes(policy):
    assert decide(Outcome.MALFORMED, policy, started=True).action is Action.DEAD_LETTER


def test_a_counted_requeue_past_max_deliveries_dead_letters_instead():
    policy = Policy(max_deliveries=3)
    assert decide(Outcome.CHILD_LOST, policy, started=True, deliveries=2).action is \
        Action.REQUEUE_COUNTED
    assert decide(Outcome.CHILD_LOST, policy, started=True, deliveries=3) == Decision(
        Action.DEAD_LETTER, Store.WORKER_LOST)
    assert decide(Outcome.TIME_LIMIT, Policy(acks_on_timeout=False, max_deliveries=1),
                  started=True, deliveries=1) == Decision(Action.DEAD_LETTER, Store.TIME_LIMIT)


def test_time_limit_precedence_header_then_task_then_config():
    from workhorse.pool.limits import effective_limit
    assert effective_limit(5.0, 10.0, 20.0) == 5.0      # header (call option) wins
    assert effective_limit(None, 10.0, 20.0) == 10.0    # then the task decorator
    assert effective_limit(None, None, 20.0) == 20.0    # then the configuration
    assert effective_limit(None, None, None) is None
