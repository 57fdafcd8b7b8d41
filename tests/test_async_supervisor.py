"""Tier 1: the supervisor's side of async tasks, against fakes: the two windows, where each
kind of message starts, who pays when a child with many tasks dies, the blocked-loop
check, and a pipe to a child that reads nothing never blocking the supervisor."""
from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest

from tests.fakes import FakeBroker, FakeClock, fake_settings, make_slots, message
from workhorse.daemon.current import Current
from workhorse.daemon.delivery import Delivery
from workhorse.daemon.dispatch import Dispatch
from workhorse.daemon.holding import Holding, windows
from workhorse.daemon.intake import Intake
from workhorse.daemon.slots import BLOCK_CHECK
from workhorse.outcome import Action, Outcome, Policy, Store, decide
from workhorse.pool.heart import Heart
from workhorse.pool.ipc import Done, FrameStream, Job
from workhorse.pool.spawn import ForkedProcess

from .test_supervisor_parts import make_settlement

pytestmark = pytest.mark.timeout(10)


def test_the_windows_of_an_app_with_and_without_async_tasks():
    sync, nap = SimpleNamespace(is_async=False), SimpleNamespace(is_async=True)
    assert windows(2, 4, 100, [sync]) == (8, 0)
    assert windows(2, 4, 100, [sync, nap]) == (8, 800)


def kinded(asynchronous: bool) -> Delivery:
    d = Delivery(0, "q", message(), SimpleNamespace(), None, Policy())  # type: ignore[arg-type]
    d.asynchronous = asynchronous
    return d


def test_the_room_is_that_of_the_kinds_seen_lately_and_each_bound_is_exact():
    holding = Holding(window=2, async_window=10)
    assert holding.room() == 2                    # nothing seen yet: what both can take
    for _ in range(2):
        d = kinded(True)
        assert holding.fits(d)
        holding.buffer_last(d)
    assert holding.room() == 8                    # only async lately: its own room
    s = kinded(False)
    assert holding.fits(s)
    holding.buffer_last(s)
    assert holding.room() == 1                    # both kinds lately: the least
    s2 = kinded(False)
    assert holding.fits(s2)
    holding.buffer_last(s2)
    assert not holding.fits(kinded(False))        # the sync bound, exact
    assert holding.room() == 0
    for _ in range(8):
        d = kinded(True)
        assert holding.fits(d)
        holding.buffer_last(d)
    assert not holding.fits(kinded(True))         # the async bound, exact
    assert holding.held_async == 10
    taken = holding.next_buffered()
    assert taken is not None and taken.asynchronous and holding.held_async == 9


def make(size: int = 2, window: int = 8, async_window: int = 16, **settings: Any):
    clock = FakeClock()
    settlement, app, broker, loop, holding = make_settlement(clock)
    app.tasks["t.nap"] = SimpleNamespace(name="t.nap", is_async=True, time_limit=None,
                                         soft_time_limit=None, async_concurrency=None)
    app.tasks["t.add"].is_async = False
    holding.set_windows(window, async_window)
    current = Current(app, fake_settings(concurrency=size, async_concurrency=4, **settings))
    intake = Intake(current, loop, holding, settlement, clock, clock.now, lambda: None,
                    lambda: True)
    slots, os_, _, events, _ = make_slots(clock, size=size)
    dispatch = Dispatch(current, holding, intake, slots, FakeBroker(), lambda: True,
                        lambda: None, lambda seq: f"owner:{seq}", loop, clock)
    return SimpleNamespace(intake=intake, dispatch=dispatch, holding=holding, slots=slots,
                           os=os_, broker=broker, events=events, clock=clock)


def arrive(parts: Any, task: str, deliveries: int = 1) -> Delivery:
    m = message(task)
    parts.intake.accept("q", m, deliveries, m.headers["id"])
    parts.dispatch.dispatch()
    return next(d for d in (*parts.holding.all(), None) if d is None
                or d.request.id == m.headers["id"])


def loads(parts: Any) -> list[int]:
    return [len(c.jobs) for c in parts.slots.children()]


def finish(parts: Any, delivery: Delivery) -> None:
    child = next(c for c in parts.slots.children() if c.running(delivery))
    handle = next(h for h in parts.os.handles if h.pid == child.pid)
    handle.inbox.append(Done(child.pid, delivery.seq, Outcome.SUCCEEDED.value))
    parts.slots.on_readable(child)
    parts.holding.settle(delivery)
    parts.dispatch.dispatch()


def test_async_tasks_go_to_the_least_loaded_child_up_to_async_concurrency():
    parts = make()
    naps = [arrive(parts, "t.nap") for _ in range(9)]
    assert loads(parts) == [4, 4]                 # async_concurrency 4 a child
    assert [d.stage.value for d in naps].count("buffered") == 1
    sent = [h.sent for h in parts.os.handles]
    assert all(isinstance(f, Job) and f.asynchronous for frames in sent for f in frames)
    finish(parts, naps[0])
    assert loads(parts) == [4, 4] and naps[8].stage.value == "running"


def test_a_sync_task_gets_a_child_kept_free_of_new_async_tasks():
    parts = make()
    naps = [arrive(parts, "t.nap") for _ in range(4)]
    assert loads(parts) == [2, 2]
    add = arrive(parts, "t.add")
    assert add.stage.value == "buffered"
    reserved = [c for c in parts.slots.children() if c.reserved]
    assert len(reserved) == 1
    later = arrive(parts, "t.nap")                # goes to the other child only
    other = next(c for c in parts.slots.children() if not c.reserved)
    assert other.running(later) is not None
    for d in naps:
        if reserved[0].running(d):
            finish(parts, d)
    assert add.stage.value == "running" and reserved[0].running(add) is not None
    assert not reserved[0].asynchronous


def test_an_async_task_charged_before_runs_alone_in_its_child():
    parts = make()
    charged = arrive(parts, "t.nap", deliveries=2)
    child = next(c for c in parts.slots.children() if c.running(charged))
    for _ in range(5):
        arrive(parts, "t.nap")
    assert len(child.jobs) == 1 and child.reserved


def test_a_message_that_fits_neither_window_goes_back_uncharged():
    parts = make(size=1, window=1, async_window=4)
    arrive(parts, "t.add")
    arrive(parts, "t.add")                        # the sync window (1) is full
    assert ("hand_back", parts.broker.calls[-1][1]) == parts.broker.calls[-1]
    assert parts.holding.held - parts.holding.held_async == 1


def async_child(parts: Any, n: int = 3) -> tuple[Any, list[Delivery], Heart]:
    naps = [arrive(parts, "t.nap") for _ in range(n)]
    child = next(c for c in parts.slots.children() if c.jobs)
    handle = next(h for h in parts.os.handles if h.pid == child.pid)
    handle.heart = Heart()
    mine = [d for d in naps if child.running(d)]
    return child, mine, handle.heart


def lost(parts: Any) -> dict[str, Outcome]:
    return {task_id: outcome for task_id, outcome, _ in parts.events.lost}


def test_a_child_killed_for_one_task_charges_it_and_only_it():
    parts = make(size=1)
    child, naps, _ = async_child(parts)
    child.kill(Outcome.TIME_LIMIT, "hard time limit", culprit=naps[1].seq)
    parts.slots.reap()
    assert lost(parts) == {naps[0].request.id: Outcome.SIBLING_LOST,
                           naps[1].request.id: Outcome.TIME_LIMIT,
                           naps[2].request.id: Outcome.SIBLING_LOST}


def test_a_child_that_dies_charges_the_task_its_heart_names_else_all():
    parts = make(size=1)
    child, naps, heart = async_child(parts)
    heart.running(naps[2].seq)
    next(h for h in parts.os.handles if h.pid == child.pid).code = 3
    parts.slots.reap()
    assert lost(parts)[naps[2].request.id] is Outcome.CHILD_LOST
    assert [lost(parts)[d.request.id] for d in naps[:2]] == [Outcome.SIBLING_LOST] * 2
    parts2 = make(size=1)
    child2, naps2, _ = async_child(parts2)        # its heart names nobody
    next(h for h in parts2.os.handles if h.pid == child2.pid).code = -9
    parts2.slots.reap()
    assert set(lost(parts2).values()) == {Outcome.CHILD_LOST} and len(lost(parts2)) == 3


def test_a_cold_shutdown_charges_none_of_them():
    parts = make(size=1)
    async_child(parts)
    parts.slots.kill_all("cold shutdown")
    parts.slots.reap()
    assert set(lost(parts).values()) == {Outcome.SHUTDOWN_KILLED}


def test_a_loop_that_stops_beating_gets_its_child_killed_for_the_task_on_it():
    parts = make(size=1, loop_block_limit=2.0)
    parts.slots.loop_block_limit = 2.0
    child, naps, heart = async_child(parts)
    heart.running(naps[0].seq)
    for _ in range(int(1.5 / BLOCK_CHECK)):
        heart.beat()                              # turning: never killed
        parts.clock.t += BLOCK_CHECK
        parts.slots.check_loops()
    assert child.kill_reason is None
    for _ in range(int(2.5 / BLOCK_CHECK)):
        parts.clock.t += BLOCK_CHECK
        parts.slots.check_loops()
    assert child.kill_reason is Outcome.CHILD_LOST and child.culprit == naps[0].seq
    assert "did not turn" in (child.kill_detail or "")


def test_siblings_are_requeued_as_held_losses_or_reported_when_acked_at_start():
    late = decide(Outcome.SIBLING_LOST, Policy(), started=True, deliveries=1)
    assert late.action is Action.REQUEUE_HELD_LOSS
    early = decide(Outcome.SIBLING_LOST, Policy(acks_late=False), started=True)
    assert (early.action, early.store) == (Action.NONE, Store.WORKER_LOST)


def test_a_child_that_reads_nothing_never_blocks_the_supervisors_writes():
    to_child_r, to_child_w = os.pipe2(os.O_CLOEXEC)
    from_child_r, from_child_w = os.pipe2(os.O_CLOEXEC)
    os.set_blocking(to_child_w, False)
    handle = ForkedProcess(os.getpid(), to_child_w, from_child_r)
    pending = []
    handle.on_pending = lambda: pending.append(1)
    frames = [Job(n, "t", b"x" * 1000, None, None, {}, {}, False) for n in range(500)]
    try:
        for frame in frames:
            handle.send(frame)                    # 500 kB into a 64 kB pipe, at once
        assert handle.pending and pending == [1]
        stream, got = FrameStream(to_child_r), []
        while len(got) < len(frames):
            handle.flush()
            got.append(stream.read())
        assert [f.seq for f in got] == list(range(500)) and handle.flush()
    finally:
        handle.close()
        for fd in (to_child_r, from_child_w):
            os.close(fd)
