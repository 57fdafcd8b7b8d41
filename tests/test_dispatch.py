"""Tier 1: starting tasks (``Dispatch``) and placing arrivals (``Intake``) against fakes,
for what a worker's death may cost: each start is in the journal before its job reaches
a child; a suspect (running when a worker died) goes first and runs alone; a message held
at too many deaths is dead-lettered without being read."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tests.fakes import FakeBroker, FakeClock, fake_settings, make_slots, message
from workhorse.config.types import QueueName, queue_list
from workhorse.daemon import intake as intake_module
from workhorse.daemon.current import Current
from workhorse.daemon.dispatch import Dispatch
from workhorse.daemon.intake import Intake
from workhorse.daemon.loop import STALL
from workhorse.outcome import Outcome
from workhorse.pool.ipc import Done, Job, encode
from workhorse.protocol import HELD_LOSSES_HEADER, SUSPECT_HEADER

from .test_supervisor_parts import make_settlement

pytestmark = pytest.mark.timeout(10)


class Journal:
    """Records starts, and what the child had been given when each was recorded."""

    def __init__(self, slots: Any) -> None:
        self.slots = slots
        self.started: list[tuple[str, bool]] = []

    def started_(self, key: str) -> None:
        handed = any(c.job is not None and c.job.key == key for c in self.slots.children())
        self.started.append((key, handed))


class Broker(FakeBroker):
    push = False

    def ack_then(self, message: Any, then: Any) -> None:
        self.ack(message)
        then(None)

    def republish(self, queue: str, message: Any, headers: Any) -> None:
        self._do("republish", message)


def make(size: int = 2, **settings: Any):  # type: ignore[no-untyped-def]
    clock = FakeClock()
    settlement, app, broker, loop, holding = make_settlement(clock)
    holding.window = 8
    current = Current(app, fake_settings(concurrency=size, **settings))
    intake = Intake(current, loop, holding, settlement, clock, clock.now, lambda: None,
                    lambda: True)
    slots, os_, _, events, _ = make_slots(clock, size=size)
    dispatch = Dispatch(current, holding, intake, slots, Broker(), lambda: True,
                        lambda: None, lambda seq: f"owner:{seq}", loop, clock)
    journal = Journal(slots)
    dispatch.journal = SimpleNamespace(started=journal.started_)  # type: ignore[assignment]
    return SimpleNamespace(intake=intake, dispatch=dispatch, holding=holding, slots=slots,
                           os=os_, journal=journal, broker=broker, app=app)


def arrive(parts: Any, key: str, **headers: Any) -> Any:
    parts.intake.accept("q", message(**headers), 1, key)
    return next(d for d in parts.holding.all() if d.key == key)


def finish(parts: Any, delivery: Any) -> None:
    """Its child reports the task done; the supervisor settles it."""
    child = next(c for c in parts.slots.children() if c.job is delivery)
    handle = next(h for h in parts.os.handles if h.pid == child.pid)
    handle.inbox.append(Done(child.pid, delivery.seq, Outcome.SUCCEEDED.value))
    parts.slots.on_readable(child)
    parts.holding.settle(delivery)


def running(parts: Any) -> list[str]:
    return sorted(d.key for d in parts.holding.running)


def test_a_message_whose_lease_is_too_old_to_be_sure_of_waits_for_a_renewal():
    """A lease set more than half the visibility timeout ago (the supervisor was frozen,
    renewals failed): the message keeps its place, others pass it, and every lease is
    renewed now; found ours, it starts; found lost, it is dropped (``Leases``). Where no
    lease is known (RabbitMQ), nothing waits."""
    parts = make(size=2, visibility_timeout=30.0)
    broker, dispatch = parts.dispatch.broker, parts.dispatch
    asked: list[int] = []
    dispatch.renew_now = lambda: asked.append(1)
    now = 5000.0
    dispatch.wall = lambda: now
    old, fresh, unknown = (arrive(parts, key) for key in ("old", "fresh", "unknown"))
    broker.leases = {old.request.id: now - 15.5, fresh.request.id: now - 14.5}
    dispatch.dispatch()
    assert running(parts) == ["fresh", "unknown"]
    assert old.stage.value == "buffered" and asked
    broker.leases[old.request.id] = now - 0.01       # the renewal found it ours
    finish(parts, fresh)
    dispatch.dispatch()
    assert running(parts) == ["old", "unknown"]


def test_after_the_loop_was_away_an_unleased_message_waits_for_the_connection_check():
    """No lease (RabbitMQ), and the loop was away STALL seconds or more in this turn so
    far: the start waits while the supervisor has the connection checked; once checked
    (and the loop turned), it starts. An acked message (an ack at start) waits too: its
    ack may have been written after the freeze, to a connection already closed. Where
    the supervisor needs no check (a leased broker), nothing waits."""
    parts = make(size=2)
    dispatch, loop, clock = parts.dispatch, parts.dispatch.loop, parts.dispatch.clock
    asked: list[float] = []

    def check(away: float) -> bool:
        asked.append(away)
        loop.took_away()
        dispatch.checking = True
        return True
    dispatch.check_connection = check
    loop.wait(0)
    waits, acked = arrive(parts, "waits"), arrive(parts, "acked")
    acked.acked = True
    clock.t += STALL + 1
    dispatch.dispatch()
    assert running(parts) == [] and asked == [pytest.approx(STALL + 1)]
    assert waits.stage.value == acked.stage.value == "buffered"
    dispatch.dispatch()
    assert running(parts) == [] and len(asked) == 1
    dispatch.checking = False
    loop.wait(0)
    dispatch.dispatch()
    assert running(parts) == ["acked", "waits"] and len(asked) == 1

    parts = make(size=2)
    dispatch, loop, clock = parts.dispatch, parts.dispatch.loop, parts.dispatch.clock
    dispatch.check_connection = lambda away: False
    loop.wait(0)
    arrive(parts, "k")
    clock.t += STALL + 1
    dispatch.dispatch()
    assert running(parts) == ["k"]


def test_a_start_is_in_the_journal_before_its_job_reaches_the_child():
    parts = make()
    arrive(parts, "k1")
    parts.dispatch.dispatch()
    assert running(parts) == ["k1"]
    assert parts.journal.started == [("k1", False)]


def test_a_suspect_goes_first_waits_for_busy_children_and_runs_alone():
    parts = make()
    busy = arrive(parts, "busy")
    parts.dispatch.dispatch()
    arrive(parts, "plain")
    suspect = arrive(parts, "suspect", **{SUSPECT_HEADER: 1})
    assert [d.key for d in parts.holding.buffer] == ["suspect", "plain"]
    parts.dispatch.dispatch()                   # a child is idle, but one is busy
    assert running(parts) == ["busy"]
    finish(parts, busy)
    parts.dispatch.dispatch()
    assert running(parts) == ["suspect"]        # alone, though a child is idle
    parts.dispatch.dispatch()
    assert running(parts) == ["suspect"]
    finish(parts, suspect)
    parts.dispatch.dispatch()
    assert running(parts) == ["plain"]


def test_a_message_held_at_too_many_deaths_is_dead_lettered_unread(monkeypatch):
    parts = make()

    def never(*args: Any) -> Any:
        raise AssertionError("read_request: the message was read")
    monkeypatch.setattr(intake_module, "read_request", never)
    poison = message(**{HELD_LOSSES_HEADER: 20})
    parts.intake.accept("q", poison, 1, "k")
    assert parts.broker.calls == [("dead_letter", poison.headers["id"])]
    assert parts.app.backend.stored == [("FAILURE", poison.headers["id"], "TooManyDeliveries")]
    assert not list(parts.holding.all())


def test_a_message_held_at_fewer_deaths_runs_and_is_seen_as_redelivered():
    """Its task may have been over when its worker died: the child looks for its stored
    SUCCESS before running it."""
    parts = make()
    d = arrive(parts, "k", **{HELD_LOSSES_HEADER: 19})
    parts.dispatch.dispatch()
    assert running(parts) == ["k"]
    assert d.held_losses == 19
    (child,) = [c for c in parts.slots.children() if c.job is d]
    handle = next(h for h in parts.os.handles if h.pid == child.pid)
    job = handle.sent[-1]
    assert job.delivery_info["redelivered"] is True


def test_a_job_from_a_configured_queue_crosses_marshalled():
    """The queue's name comes from the settings as a QueueName, a str subclass: in a job it
    made marshal refuse the frame, and pickle reduce it in Python, ten times the cost of
    the frame, on every task, in the supervisor and again in the child."""
    parts = make()
    [queue] = queue_list().parse("payments:quorum")
    assert type(queue) is QueueName         # (what the settings give)
    parts.intake.accept(queue, message(), 1, "k")
    parts.dispatch.dispatch()
    [job] = [f for h in parts.os.handles for f in h.sent if isinstance(f, Job)]
    assert type(job.queue) is str and job.queue == "payments"
    assert encode(job)[4] != 0x80           # marshalled, not pickled
