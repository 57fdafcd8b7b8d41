"""Tier 1: the supervisor's parts against fakes (no fork, no broker, no sleeping)."""
from __future__ import annotations

from datetime import timedelta

import signal
from contextlib import nullcontext
from types import SimpleNamespace
from typing import Any

import pytest

from tests.fakes import (
    FakeBroker,
    FakeClock,
    FakeLoop,
    delivery,
    fake_app,
    fake_settings,
    make_slots,
    message,
    retry_policy,
)
from workhorse.daemon.current import Current
from workhorse.daemon.delivery import Stage
from workhorse.daemon.holding import Holding
from workhorse.daemon.intake import Intake
from workhorse.daemon.leases import Leases
from workhorse.broker.backoff import RECONNECT_BACKOFF_MAX, backoff
from workhorse.daemon.settlement import Settlement
from workhorse.daemon.slots import CRASH_BACKOFF_MAX, Recycling, crash_delay
from workhorse.outcome import Outcome
from workhorse.pool.child import ChildState, InvalidTransition
from workhorse.pool.ipc import Done, Job

pytestmark = pytest.mark.timeout(10)


# ---------------------------------------------------------------------- holding
def test_holding_moves_a_delivery_through_its_stages_and_guards_each_move():
    h = Holding(window=2)
    d = delivery()
    h.buffer_last(d)
    assert (d.stage, h.held) == (Stage.BUFFERED, 1)
    assert h.next_buffered() is d
    h.start(d)
    assert d in h.running and h.held == 1
    h.store(d)
    assert d in h.storing and h.held == 0
    h.settle(d)
    assert d.stage is Stage.SETTLED and not list(h.all())
    with pytest.raises(InvalidTransition, match="is settled, expected"):
        h.start(d)


def test_holding_cancels_the_timer_of_a_delivery_leaving_the_schedule():
    h = Holding(window=2)
    d = delivery()
    cancelled = []
    d.timer = SimpleNamespace(cancel=lambda: cancelled.append(True))
    h.schedule(d)
    h.settle(d)
    assert cancelled == [True] and d.timer is None


def test_credit_is_the_window_plus_scheduled_and_unacked_storing_minus_acked_running():
    h = Holding(window=4)
    running_acked, running, scheduled, storing = (delivery(i) for i in range(4))
    running_acked.acked = True
    for d in (running_acked, running):
        h.buffer_last(d)
        h.next_buffered()
        h.start(d)
    h.schedule(scheduled)
    h.store(storing)
    assert h.credit(now=0.0) == 4 + 1 + 1 - 1
    acking = delivery(5)
    h.ack_at_start(acking)                      # its ack is on its way: shrink first
    assert h.credit(now=0.0) == 4 + 1 + 1 - 2
    h.paused_until = 10.0
    assert h.credit(now=5.0) == 0 and not h.has_room(5.0)


def test_window_bounds_received_buffered_and_running_not_scheduled():
    h = Holding(window=2)
    h.inbox.append(("q", message()))
    h.buffer_last(delivery(1))
    assert not h.has_room(0.0)
    h.inbox.clear()
    h.schedule(delivery(2))
    assert h.has_room(0.0)


def test_take_waiting_returns_buffered_then_scheduled_in_arrival_order():
    h = Holding(window=5)
    late, early, buffered = delivery(3), delivery(1), delivery(2)
    h.schedule(late)
    h.schedule(early)
    h.buffer_last(buffered)
    assert h.take_waiting() == [buffered, early, late]
    assert all(d.stage is Stage.SETTLED for d in (late, early, buffered))


# ---------------------------------------------------------------------- settlement
def make_settlement(clock: FakeClock, retries: int = 3):
    app = fake_app("t.add")
    broker = FakeBroker()
    loop = FakeLoop(clock)
    holding = Holding(window=4)
    changes = []
    settlement = Settlement(Current(app, fake_settings(max_scheduled=10)), broker, loop,
                            holding, "w@h", retry_policy(retries), lambda: changes.append(1))
    return settlement, app, broker, loop, holding


def current_of(app) -> Current:
    return Current(app, fake_settings())


def running(holding: Holding, d):
    holding.buffer_last(d)
    holding.next_buffered()
    holding.start(d)
    d.started = True
    d.deliveries = 1
    return d


def test_a_killed_task_stores_time_limit_failure_then_acks():
    clock = FakeClock()
    settlement, app, broker, _, holding = make_settlement(clock)
    d = running(holding, delivery())
    settlement.settle(d, Outcome.TIME_LIMIT, "hard time limit (4 s) exceeded")
    assert app.backend.stored == [("FAILURE", d.request.id, "TimeLimitExceeded")]
    assert broker.calls == [("ack", d.request.id)] and d.stage is Stage.SETTLED


def test_a_store_outage_holds_the_message_and_retries_from_timers_until_stored():
    clock = FakeClock()
    settlement, app, broker, loop, holding = make_settlement(clock)
    d = running(holding, delivery())
    app.backend.fail = ConnectionError("store down")
    settlement.settle(d, Outcome.TIME_LIMIT, "hard time limit (4 s) exceeded")
    assert d.stage is Stage.STORING and broker.calls == []
    clock.advance(loop, 0.5)                 # the first retry fails again: still held
    assert d.stage is Stage.STORING and broker.calls == []
    app.backend.fail = None
    clock.advance(loop, 1.0)
    assert app.backend.stored == [("FAILURE", d.request.id, "TimeLimitExceeded")]
    assert broker.calls == [("ack", d.request.id)]


def test_a_store_that_never_comes_back_requeues_counted_never_acks_without_a_result():
    clock = FakeClock()
    settlement, app, broker, loop, holding = make_settlement(clock, retries=2)
    d = running(holding, delivery())
    app.backend.fail = ConnectionError("store down")
    settlement.settle(d, Outcome.TIME_LIMIT, "hard time limit (1 s) exceeded")
    for _ in range(3):
        clock.advance(loop, 1.0)
    assert broker.calls == [("requeue_counted:1", d.request.id)]


def test_a_broker_error_while_settling_is_contained():
    clock = FakeClock()
    settlement, _, broker, _, holding = make_settlement(clock)
    d = running(holding, delivery())
    broker.fail = ConnectionError("broker gone")
    settlement.settle(d, Outcome.SUCCEEDED, None)     # does not raise
    assert d.stage is Stage.SETTLED


def test_giving_up_storing_at_shutdown_requeues_instead_of_acking():
    clock = FakeClock()
    settlement, app, broker, _, holding = make_settlement(clock)
    d = running(holding, delivery())
    app.backend.fail = ConnectionError("store down")
    settlement.settle(d, Outcome.TIME_LIMIT, "hard time limit (1 s) exceeded")
    settlement.give_up_storing()
    assert broker.calls == [("requeue_counted:1", d.request.id)] and not holding.storing


# ---------------------------------------------------------------------- intake
def make_intake(clock: FakeClock, max_scheduled: int = 10):
    settlement, app, broker, loop, holding = make_settlement(clock)
    current = Current(app, fake_settings(max_scheduled=max_scheduled))
    intake = Intake(current, loop, holding, settlement, clock, clock.now, lambda: None,
                    lambda: True)
    return intake, app, broker, loop, holding


def test_an_unknown_task_is_dead_lettered_with_not_registered_stored():
    clock = FakeClock()
    intake, app, broker, _, holding = make_intake(clock)
    m = message("t.nope")
    intake.accept("q", m, 1)
    assert broker.calls == [("dead_letter", m.headers["id"])]
    assert app.backend.stored == [("FAILURE", m.headers["id"], "NotRegistered")]
    assert not list(holding.all())


def test_a_malformed_message_with_an_id_is_dead_lettered_with_malformed_message_stored():
    clock = FakeClock()
    intake, app, broker, _, holding = make_intake(clock)
    m = message()
    m.headers["retries"] = "many"
    intake.accept("q", m, 1)
    assert broker.calls == [("dead_letter", m.headers["id"])]
    assert app.backend.stored == [("FAILURE", m.headers["id"], "MalformedMessage")]
    assert not list(holding.all())


def test_a_malformed_message_without_an_id_is_dead_lettered_and_nothing_stored():
    clock = FakeClock()
    intake, app, broker, _, _ = make_intake(clock)
    m = message()
    del m.headers["id"]
    intake.accept("q", m, 1)
    assert broker.calls == [("dead_letter", None)] and app.backend.stored == []


def test_a_store_outage_holds_a_malformed_message_until_its_failure_is_stored():
    clock = FakeClock()
    intake, app, broker, loop, holding = make_intake(clock)
    m = message()
    m.headers["eta"] = "tomorrow"
    app.backend.fail = ConnectionError("store down")
    intake.accept("q", m, 1)
    assert broker.calls == [] and len(holding.storing) == 1
    app.backend.fail = None
    clock.advance(loop, 1.0)
    assert app.backend.stored == [("FAILURE", m.headers["id"], "MalformedMessage")]
    assert broker.calls == [("dead_letter", m.headers["id"])]


def test_a_protocol_v1_message_is_read_from_its_body_and_buffered():
    clock = FakeClock()
    intake, _, broker, _, holding = make_intake(clock)
    m = message()
    m.headers = {}
    m.body = (b'{"task": "t.add", "id": "v1-id", "args": [1, 2], "kwargs": {}, '
              b'"retries": 0, "eta": null, "expires": null, "utc": true}')
    intake.accept("q", m, 1)
    (buffered,) = holding.buffer
    assert (buffered.request.task, buffered.request.id) == ("t.add", "v1-id")
    assert broker.calls == []


def test_a_body_the_child_found_malformed_is_dead_lettered_with_malformed_message_stored():
    clock = FakeClock()
    settlement, app, broker, _, holding = make_settlement(clock)
    d = running(holding, delivery())
    settlement.settle(d, Outcome.MALFORMED, "body is not valid application/json: ...")
    assert app.backend.stored == [("FAILURE", d.request.id, "MalformedMessage")]
    assert broker.calls == [("dead_letter", d.request.id)] and d.stage is Stage.SETTLED


def test_an_expired_message_is_revoked_and_acked_without_running():
    clock = FakeClock()
    intake, app, broker, _, _ = make_intake(clock)
    m = message(expires=(clock.now().replace(year=2025)).isoformat())
    intake.accept("q", m, 1)
    assert app.backend.stored == [("REVOKED", m.headers["id"], "")]
    assert broker.calls == [("ack", m.headers["id"])]


def test_a_delivery_past_max_deliveries_is_dead_lettered_before_it_runs():
    clock = FakeClock()
    intake, app, broker, _, holding = make_intake(clock)
    m = message()
    intake.accept("q", m, 4)                    # max_deliveries: 3
    assert broker.calls == [("dead_letter", m.headers["id"])]
    assert app.backend.stored == [("FAILURE", m.headers["id"], "TooManyDeliveries")]
    assert not list(holding.all())


def test_the_last_allowed_delivery_runs_and_carries_its_count():
    clock = FakeClock()
    intake, _, broker, _, holding = make_intake(clock)
    intake.accept("q", message(), 3)
    (buffered,) = holding.buffer
    assert buffered.deliveries == 3 and broker.calls == []


def test_an_eta_message_waits_scheduled_then_goes_first_in_line():
    clock = FakeClock()
    intake, _, _, loop, holding = make_intake(clock)
    holding.buffer_last(delivery(99))
    m = message(eta=(clock.now().replace(second=30)).isoformat())
    intake.accept("q", m, 1)
    (scheduled,) = holding.scheduled
    clock.advance(loop, 29.0)
    assert scheduled.stage is Stage.SCHEDULED
    clock.advance(loop, 1.5)
    assert holding.buffer[0] is scheduled and not holding.scheduled


def test_past_max_scheduled_eta_messages_are_handed_back_and_fetching_pauses():
    clock = FakeClock()
    intake, _, broker, loop, holding = make_intake(clock, max_scheduled=1)
    eta = (clock.now().replace(minute=5)).isoformat()
    first, second = message(eta=eta), message(eta=eta)
    intake.accept("q", first, 1)
    intake.accept("q", second, 1)
    assert broker.calls == [("hand_back", second.headers["id"])]
    assert not holding.has_room(clock())
    clock.advance(loop, 1.1)
    assert holding.has_room(clock())


def test_a_far_eta_message_on_a_delayable_queue_goes_back_through_the_broker():
    """A quorum queue's consumers have a fixed prefetch: an ETA message held here would
    take a place in it until due. One 10 s or more away goes back through the broker's
    delay levels (rounded up: never early); a nearer one, or one on a queue the broker
    cannot delay, is held as before."""
    clock = FakeClock()
    intake, _, broker, _, holding = make_intake(clock)
    broker.delayable = frozenset({"q"})
    far = message(eta=(clock.now() + timedelta(seconds=29.2)).isoformat())
    near = message(eta=(clock.now() + timedelta(seconds=5)).isoformat())
    elsewhere = message(eta=(clock.now() + timedelta(seconds=60)).isoformat())
    intake.accept("q", far, 1)
    intake.accept("q", near, 1)
    intake.accept("classic", elsewhere, 1)
    assert broker.calls == [("hand_back_later:30", far.headers["id"])]
    assert sorted(d.message.headers["id"] for d in holding.scheduled) == sorted(
        [near.headers["id"], elsewhere.headers["id"]])
    assert not any(d.message is far for d in holding.all())


# ---------------------------------------------------------------------- leases
def test_a_lost_lease_drops_a_buffered_message_but_not_a_running_one():
    clock = FakeClock()
    _, app, broker, _, holding = make_settlement(clock)
    leases = Leases(current_of(app), broker, holding, 30.0, lambda: None)
    waiting, active = delivery(1), running(holding, delivery(2))
    holding.buffer_last(waiting)
    broker.lost = {waiting.request.id, active.request.id}
    leases.renew()
    assert waiting.stage is Stage.SETTLED and active.stage is Stage.RUNNING
    assert broker.calls == [("forget", waiting.request.id)]


def test_renewing_now_waits_for_the_answer_out_and_never_comes_twice_a_second():
    """``renew_now`` (a buffered lease too old to be sure of) renews at once, but not
    while a renewal's answer is awaited, nor again within a second of the last."""
    clock = FakeClock()
    _, app, broker, _, holding = make_settlement(clock)
    answers: list[Any] = []
    broker.renew = lambda messages, then: answers.append(then)  # type: ignore[method-assign]
    leases = Leases(current_of(app), broker, holding, 30.0, lambda: None, clock)
    holding.buffer_last(delivery(1))
    leases.renew_now()
    assert len(answers) == 1
    clock.t += 5
    leases.renew_now()              # the answer is not in
    assert len(answers) == 1
    answers[0]([])
    leases.renew_now()
    assert len(answers) == 2
    answers[1]([])
    clock.t += 0.5
    leases.renew_now()              # (a broker that cannot be reached answers at once)
    assert len(answers) == 2
    clock.t += 0.5
    leases.renew_now()
    assert len(answers) == 3


# ---------------------------------------------------------------------- reconnect
def test_reconnect_backs_off_doubling_to_a_cap():
    assert [backoff(n) for n in range(4)] == [0.0, 0.5, 1.0, 2.0]
    assert backoff(50) == RECONNECT_BACKOFF_MAX


# ---------------------------------------------------------------------- slots
JOB = Job(1, "t.add", b"[]", "application/json", "utf-8", {}, {}, False)


def test_a_hard_time_limit_kills_the_child_and_reports_it_in_words():
    clock = FakeClock()
    slots, os_, loop, events, _ = make_slots(clock)
    (child,) = slots.idle()
    d = delivery()
    assert slots.start(child, d, JOB, hard=4.0, soft=3.0)
    clock.advance(loop, 3.05)
    assert os_.signals == [(child.pid, signal.SIGUSR1)]
    clock.advance(loop, 1.0)
    assert os_.handles[0].killed == 1
    slots.reap()
    assert events.lost == [(d.request.id, Outcome.TIME_LIMIT,
                            "hard time limit (4 s) exceeded")]
    new = slots.slots[0].child
    assert new is not None and new is not child and os_.handles[1].pid == new.pid


def test_a_child_lost_mid_task_is_reported_with_how_it_died_and_replaced():
    clock = FakeClock()
    slots, os_, _, events, _ = make_slots(clock)
    (child,) = slots.idle()
    d = delivery()
    slots.start(child, d, JOB, None, None)
    os_.handles[0].code = -signal.SIGSEGV
    slots.reap()
    ((task_id, outcome, detail),) = events.lost
    assert (task_id, outcome) == (d.request.id, Outcome.CHILD_LOST)
    assert "SIGSEGV" in detail
    assert len(os_.handles) == 2


def test_repeated_crashes_back_off_before_the_next_spawn():
    assert crash_delay(1) == 0.0 and crash_delay(2) > 0 and crash_delay(99) == CRASH_BACKOFF_MAX
    clock = FakeClock()
    slots, os_, loop, _, _ = make_slots(clock)
    os_.handles[-1].code = 1
    slots.reap()
    assert len(os_.handles) == 2               # the first crash is replaced at once
    os_.handles[-1].code = 1
    slots.reap()
    assert len(os_.handles) == 2               # the second waits
    clock.advance(loop, crash_delay(2) + 0.01)
    assert len(os_.handles) == 3


def test_a_finished_job_reports_done_and_a_child_over_max_tasks_is_recycled():
    clock = FakeClock()
    slots, os_, _, events, _ = make_slots(clock, recycling=Recycling(max_tasks=1))
    (child,) = slots.idle()
    d = delivery()
    slots.start(child, d, JOB, None, None)
    os_.handles[0].inbox.append(Done(os_.handles[0].pid, 1, Outcome.SUCCEEDED.value))
    slots.on_readable(child)
    assert events.done == [(d.request.id, "succeeded")]
    assert child.state is ChildState.STOPPING
    os_.handles[0].code = 0
    slots.reap()
    assert events.lost == [] and len(os_.handles) == 2


def test_cold_shutdown_kills_running_children_as_shutdown_and_does_not_replace_them():
    clock = FakeClock()
    slots, os_, _, events, accepting = make_slots(clock)
    (child,) = slots.idle()
    d = delivery()
    slots.start(child, d, JOB, None, None)
    accepting[0] = False
    slots.kill_all("cold shutdown (SIGQUIT)")
    slots.reap()
    assert events.lost == [(d.request.id, Outcome.SHUTDOWN_KILLED, "cold shutdown (SIGQUIT)")]
    assert slots.all_exited() and len(os_.handles) == 1


def test_an_idle_child_over_max_memory_is_recycled():
    clock = FakeClock()
    slots, os_, _, _, _ = make_slots(clock, recycling=Recycling(max_memory=100))
    (child,) = slots.idle()
    os_.memory[child.pid] = 50
    slots.check_idle_memory()
    assert child.state is ChildState.IDLE
    os_.memory[child.pid] = 500
    slots.check_idle_memory()
    assert child.state is ChildState.STOPPING


def test_resize_grows_at_once_and_shrinks_idle_children_first():
    clock = FakeClock()
    slots, os_, _, _, _ = make_slots(clock, size=2)
    busy = next(iter(slots.idle()))
    slots.start(busy, delivery(), JOB, None, None)
    slots.resize(3)
    assert slots.size == 3 and len(os_.handles) == 3
    slots.resize(1)                       # two idle children retire, the busy one stays
    assert [c.state for c in slots.children()].count(ChildState.STOPPING) == 2
    for handle in os_.handles[1:]:
        handle.code = 0
    slots.reap()
    assert list(slots.slots) == [busy.index] and len(os_.handles) == 3


def test_shrinking_a_busy_pool_retires_the_next_child_to_finish():
    clock = FakeClock()
    slots, os_, _, events, _ = make_slots(clock, size=2)
    first, second = slots.idle()
    slots.start(first, delivery(1), JOB, None, None)
    slots.start(second, delivery(2), Job(2, "t.add", b"[]", None, None, {}, {}, False),
                None, None)
    slots.resize(1)
    assert slots.size == 1 and first.busy and second.busy
    os_.handles[1].inbox.append(Done(os_.handles[1].pid, 2, Outcome.SUCCEEDED.value))
    slots.on_readable(second)
    assert second.state is ChildState.STOPPING and first.busy
    os_.handles[1].code = 0
    slots.reap()
    assert list(slots.slots) == [first.index] and len(os_.handles) == 2


def test_renew_replaces_idle_children_now_and_busy_ones_after_their_task():
    clock = FakeClock()
    slots, os_, _, _, _ = make_slots(clock, size=2)
    idle, busy = slots.idle()
    slots.start(busy, delivery(), JOB, None, None)
    slots.renew()
    assert idle.state is ChildState.STOPPING and busy.busy
    os_.handles[0].code = 0
    slots.reap()
    assert len(os_.handles) == 3              # the idle one replaced at once
    os_.handles[1].inbox.append(Done(os_.handles[1].pid, 1, Outcome.SUCCEEDED.value))
    slots.on_readable(busy)
    assert busy.state is ChildState.STOPPING
    os_.handles[1].code = 0
    slots.reap()
    assert len(os_.handles) == 4 and slots.size == 2


def dies_in_setup(handle, code: int = 1) -> None:
    """The child exits before it says Hello."""
    handle.inbox.clear()
    handle.code = code


def test_children_dying_before_they_are_ready_stop_the_pool_at_max_boot_failures():
    clock = FakeClock()
    slots, os_, loop, events, _ = make_slots(clock, max_boot_failures=3)
    os_.handles[-1].code = 1                    # was ready, then crashed: not a boot failure
    slots.reap()
    for _ in range(2):
        dies_in_setup(os_.handles[-1])
        slots.reap()
        clock.advance(loop, CRASH_BACKOFF_MAX)  # replaced with the crash back-off
    assert events.cannot_boot == [] and len(os_.handles) == 4
    dies_in_setup(os_.handles[-1], code=-signal.SIGSEGV)
    slots.reap()
    (reason,) = events.cannot_boot
    assert reason.startswith("children die before they are ready (3 in a row; last: killed "
                             "by SIGSEGV")
    assert reason.endswith("; see the log above for their error")
    clock.advance(loop, CRASH_BACKOFF_MAX)
    assert len(os_.handles) == 4 and slots.all_exited()    # no more replacements


def test_a_child_that_was_ready_ends_a_run_of_boot_failures():
    clock = FakeClock()
    slots, os_, loop, events, _ = make_slots(clock, max_boot_failures=2)
    os_.handles[-1].code = 1
    slots.reap()
    for ready in (False, True, False):
        handle = os_.handles[-1]
        if ready:
            new = slots.slots[0].child
            assert new is not None
            slots.on_readable(new)              # Hello, then a crash while idle
            handle.code = 1
        else:
            dies_in_setup(handle)
        slots.reap()
        clock.advance(loop, CRASH_BACKOFF_MAX)
    assert events.cannot_boot == [] and len(os_.handles) == 5
    assert slots.slots[0].crashes == 4           # the crash back-off counts them all


def test_a_child_killed_before_it_is_ready_is_not_a_boot_failure():
    clock = FakeClock()
    slots, os_, loop, events, _ = make_slots(clock, max_boot_failures=1)
    os_.handles[-1].code = 1
    slots.reap()
    child = slots.slots[0].child
    assert child is not None and child.state is ChildState.SPAWNING
    os_.handles[-1].inbox.clear()
    child.kill(None, "its pipe failed")
    slots.reap()
    assert events.cannot_boot == [] and len(os_.handles) == 3


def test_a_spawn_waits_while_another_thread_is_mid_call_then_forks():
    clock = FakeClock()
    slots, os_, loop, _, _ = make_slots(clock)
    busy = [True]
    slots.may_fork = lambda: nullcontext(not busy[0])
    os_.handles[-1].code = 0
    slots.reap()                              # replaced at once... if a fork were safe
    assert len(os_.handles) == 1
    clock.advance(loop, 0.05)
    assert len(os_.handles) == 1              # still busy: tried again, not forked
    busy[0] = False
    clock.advance(loop, 0.05)
    assert len(os_.handles) == 2


# ---------------------------------------------------------------- the link's batching
def _link(window: int):
    """A BrokerLink whose broker thread is never started: what it is handed is read off
    its command queue."""
    from workhorse import App
    from workhorse.broker.thread import Ack
    from workhorse.broker.link import BrokerLink
    from workhorse.daemon.loop import Loop
    clock = FakeClock()
    loop = Loop(clock)
    app = App("t", broker_url="memory://", result_backend="disabled")
    link = BrokerLink(app, ["q"], loop, lambda *a: None, lambda: None, lambda e: None,
                      lambda e: None, lambda: window, None, True)

    def handed() -> list[str]:
        items = link.thread.commands.take()
        return ["ack" if isinstance(i, Ack) and i.then is None else
                "ack_then" if isinstance(i, Ack) else "command" for i in items]
    return link, loop, clock, handed


def test_late_acks_travel_together_and_never_wait_past_the_delay():
    from workhorse.broker.link import ACK_DELAY
    link, loop, clock, handed = _link(window=8)
    message = SimpleNamespace(headers={"task": "t", "id": "1"})
    link.ack(message)
    link.ack(message)
    link.set_room(0, starved=False)
    assert handed() == []                          # two of a batch of four: they wait
    clock.advance(loop, ACK_DELAY)
    assert handed() == ["ack", "ack"]              # but never longer than ACK_DELAY
    for _ in range(4):
        link.ack(message)
    link.set_room(0, starved=False)
    assert handed() == ["ack"] * 4                 # a batch's worth goes at the turn's end
    link.ack(message)
    link.submit(lambda consumer: None, "something else")
    assert handed() == ["ack", "command"]          # in order with what follows
    link.ack_then(message, lambda error: None)
    link.set_room(0, starved=False)
    assert handed() == ["ack_then"]                # an ack at start goes at the turn's end
    clock.advance(loop, ACK_DELAY)
    assert handed() == []
    link.push = True                               # RabbitMQ: acks are what free credit
    link.ack(message)
    link.set_room(0, starved=False)
    assert handed() == ["ack"]                     # so they go at the end of the turn


def test_less_credit_goes_at_once_and_more_waits_for_the_end_of_the_turn():
    """RabbitMQ's credit: a shrink reaches the broker before the acks that follow it; a
    growth waits for the end of the turn, where a task that finished and the ack at start
    of the next one cancel out (they cost two ``basic.qos`` a task with acks at start)."""
    from workhorse.broker.thread import Ack
    link, loop, clock, handed = _link(window=8)
    link.push = True
    told: list[object] = []
    consumer = SimpleNamespace(set_credit=lambda count: told.append(count),
                               resize=lambda window, acked: told.append("resize"))

    def to_broker() -> list[object]:
        for item in link.thread.commands.take():
            if isinstance(item, Ack):
                told.append("ack")
            else:
                item(consumer)
        said = told[:]
        told.clear()
        return said
    link.set_credit(8)
    assert to_broker() == ["resize", 8]            # the first: at once
    link.set_credit(6)
    assert to_broker() == [6]                      # less: at once
    link.set_credit(7)                             # a task finished ...
    assert to_broker() == []
    link.set_credit(6)                             # ... and the next one is acked at start
    link.ack_then(SimpleNamespace(headers={}), lambda error: None)
    link.set_room(0, starved=False)
    loop.wait(0)
    assert to_broker() == ["ack"]                  # no basic.qos at all
    link.set_credit(7)
    assert to_broker() == []
    loop.wait(0)                                   # the end of the turn
    assert to_broker() == [7]
    link.set_credit(5)                             # less, then an ack at start
    link.ack_then(SimpleNamespace(headers={}), lambda error: None)
    link.set_room(0, starved=False)
    assert to_broker() == [5, "ack"]               # in that order on the channel


def test_the_link_fetches_in_batches_unless_children_are_starved():
    link, loop, clock, handed = _link(window=8)

    def took(count: int) -> None:                  # the broker thread took, the loop got
        for _ in range(count):
            link.thread.room.took()
        link.thread.fetches_done += 1
        link.received += count
    link.set_room(8, starved=True)
    assert handed() == ["command"]                 # room and nothing buffered: fetch now
    took(8)
    link.set_room(1, starved=False)
    link.set_room(2, starved=False)
    assert handed() == []                          # work still buffered: wait for a batch
    link.set_room(2, starved=True)
    assert handed() == ["command"]                 # the buffer ran dry: fetch what fits
    took(2)
    for free in (1, 2, 3):
        link.set_room(free, starved=False)
    assert handed() == []
    link.set_room(4, starved=False)
    assert handed() == ["command"]                 # half the window free: worth a trip
    link.set_room(4, starved=True)
    assert handed() == []                          # no more room than that fetch had
    link.set_room(6, starved=True)
    assert handed() == []                          # more, but the fetch is still on its way
    took(3)
    link.set_room(4, starved=True)
    assert handed() == ["command"]                 # carried out: the room left is fetched


def test_where_the_loop_takes_itself_it_takes_before_waiting_once_three_quarters_are_free():
    """SQLite (takes_here): the take arrives before the loop waits, not a round trip
    later, so it waits for more room than a broker thread's fetch; one that cannot be
    done here goes to the broker thread (not started here: it is handed over)."""
    link, loop, clock, handed = _link(window=8)
    link.takes_here = True

    def took(count: int) -> None:
        for _ in range(count):
            link.thread.room.took()
        link.received += count
    link.set_room(8, starved=True)
    assert handed() == []                          # not mid-turn: before the loop waits
    loop.wait(0)
    assert handed() == ["command"]                 # (handed over: no broker thread here)
    took(8)
    link.thread.fetches_done += 1
    link.set_room(4, starved=False)
    loop.wait(0)
    assert handed() == []                          # half the window: not yet
    link.set_room(6, starved=False)
    loop.wait(0)
    assert handed() == ["command"]                 # three quarters: take
