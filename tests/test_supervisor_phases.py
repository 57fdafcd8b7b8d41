"""Tier 1: the supervisor's phases, signal handlers and shutdown order, against a fake OS
and a fake broker connection (no fork, no broker, no real signal)."""
from __future__ import annotations

import logging
import time

import pytest

from tests.fakes import FakeClock, FakeLink, FakeOS, fake_app, fake_settings, message
from workhorse.daemon.supervisor import (
    CHECK_ANSWER_WAIT,
    REVOKES_READ_WAIT,
    Phase,
    Supervisor,
)
from workhorse.outcome import Outcome
from workhorse.pool.ipc import Done, Job, Stop

pytestmark = pytest.mark.timeout(10)


def running_supervisor(revokes_known: bool = True, app=None, **settings):
    """A supervisor past its start; ``revokes_known``: remote control has read the revokes
    kept in the result store (else it consumes nothing yet)."""
    clock = FakeClock()
    os_ = FakeOS(clock)
    consumer = FakeLink()
    supervisor = Supervisor(app or fake_app("t.add"), fake_settings(**settings), system=os_,
                            link=consumer)
    supervisor.slots.spawn_all()
    for child in list(supervisor.slots.children()):
        supervisor.slots.on_readable(child)          # Hello
    supervisor.phase = Phase.RUNNING
    if revokes_known:
        supervisor._revokes_known = True
    return supervisor, clock, os_, consumer


def receive(supervisor, *messages):
    for m in messages:
        supervisor.receive("q", m, 1)
    supervisor._after_events()


def finish(supervisor, os_, index: int, seq: int) -> None:
    """Child ``index`` reports its job ``seq`` done, then (if told to stop) exits."""
    handle = os_.handles[index]
    handle.inbox.append(Done(handle.pid, seq, Outcome.SUCCEEDED.value))
    child = next(c for c in supervisor.slots.children() if c.pid == handle.pid)
    supervisor.slots.on_readable(child)
    supervisor._after_events()


def test_warm_shutdown_requeues_waiting_messages_in_order_and_lets_running_tasks_finish():
    supervisor, clock, os_, consumer = running_supervisor(concurrency=1)
    running, buffered = message(), message()
    later = message(eta=clock.now().replace(hour=5).isoformat())
    receive(supervisor, running, buffered, later)
    assert [type(f) for f in os_.handles[0].sent] == [Job]
    supervisor.handle_term()
    assert supervisor.phase is Phase.WARM and consumer.cancelled
    assert consumer.calls == [("requeue", buffered.headers["id"]),
                              ("requeue", later.headers["id"])]
    finish(supervisor, os_, 0, 1)
    assert consumer.calls[-1] == ("ack", running.headers["id"])
    os_.handles[0].code = 0
    supervisor.handle_chld()
    supervisor._after_events()
    assert supervisor.phase is Phase.STOPPED and len(os_.handles) == 1


def test_graceful_timeout_turns_a_warm_shutdown_cold_and_requeues_uncounted():
    supervisor, clock, os_, consumer = running_supervisor(concurrency=1, graceful_timeout=5.0)
    task = message()
    receive(supervisor, task)
    supervisor.handle_term()
    clock.advance(supervisor.loop, 5.1)
    assert supervisor.phase is Phase.COLD and os_.handles[0].killed == 1
    supervisor.handle_chld()
    supervisor._after_events()
    assert consumer.calls == [("requeue", task.headers["id"])]
    assert supervisor.phase is Phase.STOPPED


def test_a_second_sigint_is_a_cold_shutdown():
    supervisor, _, os_, _ = running_supervisor()
    supervisor.handle_int()
    assert supervisor.phase is Phase.WARM
    supervisor.handle_int()
    assert supervisor.phase is Phase.COLD and all(h.killed for h in os_.handles)
    supervisor.handle_chld()
    supervisor._after_events()
    assert supervisor.phase is Phase.STOPPED and len(os_.handles) == 2   # none replaced


def test_ttin_and_ttou_resize_the_pool_and_the_window_follows():
    supervisor, _, os_, consumer = running_supervisor(concurrency=2, prefetch_multiplier=3)
    consumer.push = True                    # a broker with a credit (RabbitMQ)
    supervisor.handle_ttin()
    assert (supervisor.slots.size, supervisor.holding.window) == (3, 9)
    assert consumer.credits[-1] == 9 and len(os_.handles) == 3
    supervisor.handle_ttou()
    supervisor.handle_ttou()
    assert (supervisor.slots.size, supervisor.holding.window) == (1, 3)
    supervisor.handle_ttou()                           # never below one child
    assert supervisor.slots.size == 1


def test_sighup_applies_the_reloaded_settings_but_keeps_those_that_need_a_restart():
    supervisor, _, os_, _ = running_supervisor(concurrency=1)
    new_app = fake_app("t.add", "t.new")
    new_settings = fake_settings(concurrency=2, max_deliveries=7, broker_url="memory://other")
    supervisor.reloading.load = lambda: (new_settings, new_app)
    supervisor.handle_hup()
    assert supervisor.app is new_app and supervisor.intake.current.app is new_app
    assert supervisor.settings.max_deliveries == 7
    assert supervisor.settings.broker_url == "memory://"
    assert supervisor.slots.size == 2
    assert isinstance(os_.handles[0].sent[-1], Stop)      # forked before the reload: replaced


def test_a_failing_reload_keeps_everything_as_it_was():
    supervisor, _, os_, _ = running_supervisor(concurrency=1)
    app, settings = supervisor.app, supervisor.settings

    def broken():
        raise ValueError("config: bad")
    supervisor.reloading.load = broken
    supervisor.handle_hup()
    assert (supervisor.app, supervisor.settings) == (app, settings)
    assert os_.handles[0].sent == [] and supervisor.phase is Phase.RUNNING


def test_nothing_is_consumed_until_the_revokes_kept_in_the_store_are_known(caplog):
    """A worker started after a revoke must not take (and run) the revoked task before
    remote control has read the revokes kept in the result store; it says it is ready
    (once per connection) only when it consumes, and remote control answers by then."""
    supervisor, clock, _, consumer = running_supervisor(revokes_known=False, remote_control=True)
    caplog.set_level(logging.INFO, "workhorse")
    supervisor._connected()
    supervisor._changed()
    assert consumer.rooms[-1] == 0
    assert "ready: consuming" not in caplog.text
    supervisor._revokes_read({"id:gone": time.time() + 60})
    assert consumer.rooms[-1] == supervisor.holding.window
    assert supervisor.intake.revoked.match("gone", {}) is not None
    supervisor._revokes_read({})                    # remote control reconnected
    assert caplog.text.count("ready: consuming q") == 1
    supervisor._connected()                         # the broker reconnected
    assert caplog.text.count("ready: consuming q") == 2


def test_a_store_that_cannot_say_what_was_revoked_delays_consuming_only_so_long():
    supervisor, clock, _, consumer = running_supervisor(revokes_known=False, remote_control=True)
    supervisor._start_timers()
    clock.advance(supervisor.loop, REVOKES_READ_WAIT - 0.1)
    supervisor._changed()
    assert consumer.rooms[-1] == 0
    clock.advance(supervisor.loop, 0.2)
    assert consumer.rooms[-1] == supervisor.holding.window


def test_without_remote_control_consuming_starts_at_once():
    supervisor, _, _, consumer = running_supervisor(remote_control=False)
    supervisor._changed()
    assert consumer.rooms[-1] == supervisor.holding.window


def test_a_broker_without_a_credit_is_sent_none():
    """Only RabbitMQ pushes up to a credit; Redis and SQLite are never sent one (each was
    a wakeup of the broker thread for nothing)."""
    supervisor, _, os_, consumer = running_supervisor(concurrency=1)
    for _ in range(3):
        receive(supervisor, message())
        finish(supervisor, os_, 0, supervisor.intake._seq)
        supervisor._changed()
    assert consumer.credits == [] and [verb for verb, _ in consumer.calls] == ["ack"] * 3


def test_messages_a_broker_pushes_before_the_revokes_are_known_wait_for_them():
    """RabbitMQ pushes up to its credit without being asked: what arrives before remote
    control has read the revokes kept in the store waits, held, and a revoked one among
    them is never started."""
    supervisor, _, os_, consumer = running_supervisor(revokes_known=False, remote_control=True)
    revoked, kept = message(), message()
    receive(supervisor, revoked, kept)
    assert os_.handles[0].sent == [] and supervisor.holding.held == 2
    supervisor._revokes_read({f"id:{revoked.headers['id']}": time.time() + 60})
    supervisor._after_events()
    jobs = [frame for handle in os_.handles for frame in handle.sent]
    assert [job.headers["id"] for job in jobs] == [kept.headers["id"]]
    assert consumer.calls == [("ack", revoked.headers["id"])]


def test_a_child_left_idle_by_rate_limited_messages_has_the_loop_fetch_at_once():
    """Children with work buffered wait for half the window to be free before the next
    fetch (one round trip takes several). But buffered messages that must wait for their
    rate limit are no work for an idle child: the loop is starved, and fetches at once."""
    app = fake_app("t.add", "t.rated")
    app.tasks["t.rated"].rate_limit = 0.1            # one start every 10 s
    supervisor, clock, os_, link = running_supervisor(app=app, prefetch_multiplier=4)
    receive(supervisor, message("t.add"), message("t.add"), message("t.add"))
    supervisor._changed()
    assert link.rooms[-1] == 5 and link.starved[-1] is False    # both busy, one buffered
    finish(supervisor, os_, 0, 1)                    # the third starts there
    finish(supervisor, os_, 1, 2)
    receive(supervisor, message("t.rated"), message("t.rated"))   # the first starts
    finish(supervisor, os_, 0, 3)
    assert [type(f) for f in os_.handles[1].sent] == [Job, Job]
    assert [type(f) for f in os_.handles[0].sent] == [Job, Job]   # idle now
    assert len(supervisor.holding.buffer) == 1       # the second waits for its rate
    supervisor._changed()
    assert link.starved[-1] is True, "a child is idle and nothing buffered may start"


def test_a_copy_held_back_while_its_twin_runs_goes_to_its_child_as_redelivered():
    """The same message twice (a Redis restart that lost the take gave it again): the
    second waits while the first runs, then goes to its child marked redelivered, so the
    child acks it without running it once the first's SUCCESS is stored (CI once saw it
    run twice). One published twice under the same id is not marked: only the
    idempotency guard keeps that from running twice."""
    supervisor, clock, os_, _ = running_supervisor(concurrency=2)
    first = message()
    first.properties = {"delivery_tag": "tag-1"}
    twin = message(id=first.headers["id"])
    twin.properties = {"delivery_tag": "tag-1"}     # the broker's, not a second publish
    other = message(id=first.headers["id"])
    other.properties = {"delivery_tag": "tag-2"}    # published twice under one id
    receive(supervisor, first, twin, other)
    jobs = [f for handle in os_.handles for f in handle.sent if isinstance(f, Job)]
    assert len(jobs) == 1 and not jobs[0].delivery_info.get("redelivered")
    for _ in range(2):      # each runs once the one before it has ended
        index, job = next((n, f) for n, h in enumerate(os_.handles) for f in h.sent
                          if isinstance(f, Job) and f is jobs[-1])
        finish(supervisor, os_, index, job.seq)
        clock.advance(supervisor.loop, 1.0)
        supervisor._after_events()
        jobs = [f for handle in os_.handles for f in handle.sent if isinstance(f, Job)]
        jobs.sort(key=lambda j: j.seq)
    marked = {j.properties["delivery_tag"]: j.delivery_info.get("redelivered") is True
              for j in jobs[1:]}
    assert len(jobs) == 3 and marked == {"tag-1": True, "tag-2": False}


@pytest.mark.parametrize("before_wait", [False, True])
def test_a_settled_task_says_its_freed_place_at_once_or_at_the_next_turn(before_wait):
    """A task's end frees a place in the window. Where the broker side reads the room only
    before the loop waits (SQLite and Redis, taking on the loop thread), the next turn's
    room says it, once for the turn; elsewhere (RabbitMQ's credit, a broker thread that
    fetches) it is said at once. A place taken away is said at once on every broker."""
    supervisor, clock, os_, link = running_supervisor(concurrency=1, prefetch_multiplier=2)
    link.room_read_before_wait = before_wait
    receive(supervisor, message(), message())
    supervisor._changed()
    assert link.rooms[-1] == 0                       # one runs, one waits: the window full
    said = len(link.rooms)
    finish(supervisor, os_, 0, 1)                    # acked; the second starts
    assert link.calls[-1][0] == "ack"
    assert len(link.rooms) == (said if before_wait else said + 1)
    supervisor._changed()                            # the top of the loop's next turn
    assert link.rooms[-1] == 1
    said = len(link.rooms)
    supervisor.intake._pause_fetching(5.0)           # less room: at once, whatever the link
    assert len(link.rooms) == said + 1 and link.rooms[-1] == 0


@pytest.mark.parametrize("before_wait", [False, True])
def test_an_ack_at_start_says_the_room_at_once_or_at_the_next_turn(before_wait):
    """An ack at start keeps its message held (acking, then running): it cannot make the
    room less. Where the broker side reads the room only before the loop waits (SQLite,
    Redis), neither the ack nor its answer says it: the next turn's room does. RabbitMQ's
    credit, which the ack shrinks, is said at once and before the ack goes."""
    supervisor, clock, os_, link = running_supervisor(concurrency=1, prefetch_multiplier=2,
                                                      acks_late=False)
    link.room_read_before_wait = before_wait
    link.push = not before_wait
    order: list[str] = []
    credit, ack = link.set_credit, link.ack_then
    link.set_credit = lambda count: (order.append(f"credit {count}"), credit(count))
    link.ack_then = lambda m, then: (order.append("ack"), ack(m, then))
    said = len(link.rooms)
    receive(supervisor, message())                   # acked at start (answered at once)
    supervisor._after_events()                       # and started
    assert [verb for verb, _ in link.calls] == ["ack"]
    assert [type(f).__name__ for f in os_.handles[0].sent] == ["Job"]
    if before_wait:
        assert len(link.rooms) == said and order == ["ack"]
        supervisor._changed()                        # the top of the loop's next turn
        assert link.rooms[-1] == 1
    else:
        assert len(link.rooms) == said + 2           # at the ack, and at its answer
        assert order[:2] == ["credit 1", "ack"]      # the window (2) less the one acked


def test_a_start_after_the_loop_was_away_waits_for_the_connection_check(caplog):
    """Frozen past STALL anywhere in a turn (here: after its wait returned, before a
    child's Done is read), on RabbitMQ, which may have closed the connection meanwhile
    and given what we hold to others: nothing starts until the broker thread has checked
    the connection; a loss it finds takes the buffered messages back first."""
    supervisor, clock, os_, link = running_supervisor(concurrency=1)
    link.push = True
    answers: list = []
    link.check_alive = answers.append               # type: ignore[method-assign]
    first, buffered = message(), message()
    receive(supervisor, first, buffered)
    supervisor.loop.wait(0)
    clock.t += 61.0
    with caplog.at_level(logging.WARNING, logger="workhorse.supervisor"):
        finish(supervisor, os_, 0, 1)
    assert "away for 61 s" in caplog.text and len(answers) == 1
    assert [type(f) for f in os_.handles[0].sent] == [Job], "nothing more started"
    supervisor._after_events()
    assert [type(f) for f in os_.handles[0].sent] == [Job] and len(answers) == 1
    answers[0]()                                     # connected still
    supervisor.loop.wait(0)                          # (the answer comes in a later turn)
    supervisor._after_events()
    assert [f.headers["id"] for f in os_.handles[0].sent] == [
        first.headers["id"], buffered.headers["id"]]


def test_after_the_loop_was_away_leased_brokers_check_no_connection():
    """SQLite and Redis: each start checks its lease instead (``Dispatch._must_wait``)."""
    supervisor, clock, os_, link = running_supervisor(concurrency=1)
    receive(supervisor, message(), message())
    supervisor.loop.wait(0)
    clock.t += 61.0
    finish(supervisor, os_, 0, 1)
    assert [type(f) for f in os_.handles[0].sent] == [Job, Job]
    assert link.alive_checks == 0


def test_an_ack_at_start_written_after_a_freeze_starts_only_once_the_connection_is_checked():
    """RabbitMQ, acks at start: the freeze came between the dispatch and the ack's write,
    so the ack went to a connection RabbitMQ may have closed already (a write to it
    succeeds all the same). The acked message waits for the check; the loss the check
    finds drops it, not run here (RabbitMQ gives it to another consumer)."""
    supervisor, clock, os_, link = running_supervisor(concurrency=1, acks_late=False)
    link.push = True
    answers: list = []
    link.check_alive = answers.append               # type: ignore[method-assign]
    acks: list = []
    link.ack_then = lambda m, then: acks.append(then)  # type: ignore[method-assign]
    supervisor.loop.wait(0)
    receive(supervisor, message())
    assert len(acks) == 1 and not os_.handles[0].sent
    clock.t += 61.0                                  # frozen before the ack's write
    acks[0](None)                                    # written: no error
    supervisor._after_events()
    assert not os_.handles[0].sent and len(answers) == 1
    supervisor._broker_lost(ConnectionError("closed by the broker"))     # the check found
    answers[0]()
    supervisor.loop.wait(0)
    supervisor._after_events()
    assert not os_.handles[0].sent, "not run here"
    assert not supervisor.holding.unsettled()


def test_a_connection_check_not_answered_is_asked_again_and_a_new_connection_ends_it():
    supervisor, clock, os_, link = running_supervisor(concurrency=1)
    link.push = True
    answers: list = []
    link.check_alive = answers.append               # type: ignore[method-assign]
    supervisor.loop.wait(0)
    receive(supervisor, message(), message())
    clock.t += 61.0
    finish(supervisor, os_, 0, 1)
    assert len(answers) == 1 and supervisor.dispatch.checking
    clock.advance(supervisor.loop, CHECK_ANSWER_WAIT + 0.1)
    assert len(answers) == 2 and supervisor.dispatch.checking
    answers[0]()                                     # the first answer, late: enough
    assert not supervisor.dispatch.checking
    clock.advance(supervisor.loop, CHECK_ANSWER_WAIT + 0.1)
    assert len(answers) == 2, "answered: not asked again"
    supervisor.dispatch.checking = True
    supervisor._connected()
    assert not supervisor.dispatch.checking


def test_a_wait_that_came_back_late_has_the_connection_checked_at_once(caplog):
    """A freeze found by the wait (not by a start): checked at once, nothing to start
    or not, so the check's log and its answer come right after the freeze."""
    supervisor, clock, os_, link = running_supervisor(concurrency=1)
    link.push = True
    answers: list = []
    link.check_alive = answers.append               # type: ignore[method-assign]
    supervisor.loop.away = 61.0
    with caplog.at_level(logging.WARNING, logger="workhorse.supervisor"):
        supervisor._after_events()
    assert "away for 61 s" in caplog.text and len(answers) == 1
    assert supervisor.loop.away == 0.0 and supervisor.dispatch.checking
    receive(supervisor, message())
    assert not os_.handles[0].sent and len(answers) == 1
    answers[0]()
    supervisor._after_events()
    assert [type(f) for f in os_.handles[0].sent] == [Job]


def test_the_supervisor_measures_being_away_by_its_systems_boottime():
    supervisor, _, os_, _ = running_supervisor()
    assert supervisor.loop.away_clock == os_.boottime
