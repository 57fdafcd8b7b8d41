"""The delivery contract (docs/delivery.md: prefetch buffer, ack timing, outcomes, time limits,
children) on every broker, with the real daemon and real signals. Each test asserts the
broker's state afterwards: the queue, its dead-letter queue, and the stored result."""
from __future__ import annotations

import os
import random
import re
import signal
import time

import psutil
import pytest

from workhorse.broker.consumer import DEAD_REASON_HEADER, DEAD_TASK_HEADER
from workhorse.exceptions import (
    SoftTimeLimitExceeded,
    TimeLimitExceeded,
    TooManyDeliveries,
    WorkerLostError,
)
from workhorse.protocol import DELIVERIES_HEADER

from .conftest import BROKERS, broker_fixture, process_gone, runs, wait_until

pytestmark = pytest.mark.timeout(180)

#: Also on RabbitMQ's quorum queues.
broker = broker_fixture(*BROKERS, "quorum")


def starts(tmp_path, task_id: str) -> int:
    return sum(1 for _, tid, _ in runs(tmp_path) if tid == task_id)


def failure(result, timeout: float = 30) -> BaseException:
    with pytest.raises(BaseException) as raised:
        result.get(timeout=timeout)
    return raised.value


def holds(condition, duration: float, what: str) -> None:
    """``condition`` stays true for the whole observation window (it must not drift)."""
    deadline = time.monotonic() + duration
    while time.monotonic() < deadline:
        assert condition(), what
        time.sleep(0.02)


def dead_letters(broker, expected: int) -> list:
    """Take the dead letters: exactly ``expected`` of them (none: checked at once)."""
    if expected == 0:
        assert broker.queue_size(broker.queue + ".dead") == 0
        return []
    collected: list = []

    def enough() -> bool:
        collected.extend(broker.drain(broker.queue + ".dead"))
        return len(collected) >= expected
    wait_until(enough, 20, f"{expected} dead letter(s)")
    assert len(collected) == expected
    return collected


# ---------------------------------------------------------------- prefetch window
@pytest.mark.parametrize("acks_late", [True, False], ids=["acks_late", "early_ack"])
@pytest.mark.parametrize("multiplier", [1, 2])
def test_prefetch_window_is_exact_in_both_ack_modes(broker, client, start_worker, tmp_path,
                                                    acks_late, multiplier):
    from tests.apps.basic import record
    queued = 5
    results = [record.delay(30) for _ in range(queued)]
    worker = start_worker(broker, concurrency=1, prefetch_multiplier=multiplier,
                          acks_late=acks_late)
    window = multiplier
    wait_until(lambda: runs(tmp_path), 20, "the first task to start")
    wait_until(lambda: broker.queue_size() == queued - window, 10,
               f"{queued - window} messages left in the queue")
    holds(lambda: broker.queue_size() == queued - window, 1.0,
          "the worker fetched more than its window")
    worker.signal(signal.SIGUSR1)
    worker.wait_for_log(rf"held={window}/{window} buffered={window - 1} scheduled=0 running=1")
    assert len(runs(tmp_path)) == 1
    worker.kill()
    del results


def test_hard_limit_with_a_full_buffer_loses_and_repeats_nothing(broker, client, start_worker,
                                                                 tmp_path):
    """concurrency 1, multiplier 4, four queued, the first runs past its hard limit."""
    from tests.apps.basic import record
    first = record.apply_async((60,), time_limit=1)
    rest = [record.delay() for _ in range(3)]
    start_worker(broker, concurrency=1, prefetch_multiplier=4)
    assert isinstance(failure(first), TimeLimitExceeded)
    for result in rest:
        assert result.get(timeout=30) == result.id
    wait_until(lambda: len(runs(tmp_path)) == 4, 10, "four starts")
    assert [starts(tmp_path, r.id) for r in (first, *rest)] == [1, 1, 1, 1]
    assert broker.queue_size() == 0
    dead_letters(broker, 0)


# ---------------------------------------------------------------- outcomes
def test_raised_is_acked_by_default(broker, client, start_worker):
    from tests.apps.basic import fail
    start_worker(broker)
    assert isinstance(failure(fail.delay("x")), ValueError)
    assert broker.queue_size() == 0
    dead_letters(broker, 0)


def test_raised_with_acks_on_failure_false_is_dead_lettered(broker, client, start_worker):
    from tests.apps.basic import fail
    start_worker(broker, acks_on_failure=False)
    result = fail.delay("x")
    assert isinstance(failure(result), ValueError)
    [(headers, _)] = dead_letters(broker, 1)
    assert headers[DEAD_TASK_HEADER] == result.id
    assert headers[DEAD_REASON_HEADER].startswith("failed")


def test_hard_limit_is_acked_by_default(broker, client, start_worker, tmp_path):
    from tests.apps.basic import record
    start_worker(broker)
    result = record.apply_async((60,), time_limit=0.5)
    assert isinstance(failure(result), TimeLimitExceeded)
    assert starts(tmp_path, result.id) == 1
    assert broker.queue_size() == 0
    dead_letters(broker, 0)


def test_hard_limit_without_acks_on_timeout_requeues_until_max_deliveries(
        broker, client, start_worker, tmp_path):
    from tests.apps.basic import record
    worker = start_worker(broker, acks_on_timeout=False, max_deliveries=2)
    result = record.apply_async((60,), time_limit=0.5)
    [(headers, _)] = dead_letters(broker, 1)
    assert headers[DEAD_TASK_HEADER] == result.id
    assert headers[DEAD_REASON_HEADER].startswith("time_limit")
    assert isinstance(failure(result), TimeLimitExceeded)
    assert starts(tmp_path, result.id) == 2
    assert "requeued (started 1 of at most 2 times)" in worker.log()


def test_child_lost_is_requeued_and_stops_after_max_deliveries(broker, client, start_worker,
                                                               tmp_path):
    from tests.apps.basic import die
    start_worker(broker)     # defaults: reject_on_worker_lost, max_deliveries=3
    result = die.delay()
    [(headers, _)] = dead_letters(broker, 1)
    assert headers[DEAD_REASON_HEADER].startswith("child_lost")
    assert headers[DELIVERIES_HEADER] == 2       # the copy that was started a third time
    assert isinstance(failure(result), WorkerLostError)
    assert starts(tmp_path, result.id) == 3
    assert broker.queue_size() == 0


def test_child_lost_without_reject_on_worker_lost_is_dead_lettered(broker, client, start_worker,
                                                                   tmp_path):
    from tests.apps.basic import die
    start_worker(broker, reject_on_worker_lost=False)
    result = die.apply_async(("exit",))
    [(headers, _)] = dead_letters(broker, 1)
    assert "exited with status 7" in headers[DEAD_REASON_HEADER]
    assert isinstance(failure(result), WorkerLostError)
    assert starts(tmp_path, result.id) == 1


def test_child_lost_with_early_ack_is_a_failure_never_repeated(broker, client, start_worker,
                                                               tmp_path):
    from tests.apps.basic import die
    start_worker(broker, acks_late=False)
    result = die.delay()
    assert isinstance(failure(result), WorkerLostError)
    assert starts(tmp_path, result.id) == 1
    assert broker.queue_size() == 0
    dead_letters(broker, 0)


def test_too_many_deliveries_is_dead_lettered_before_running(broker, client, start_worker,
                                                             tmp_path):
    from tests.apps.basic import record
    result = record.apply_async(headers={DELIVERIES_HEADER: 3})
    start_worker(broker)
    assert isinstance(failure(result), Exception)
    assert type(failure(result)).__name__ == TooManyDeliveries.__name__
    [(headers, _)] = dead_letters(broker, 1)
    assert headers[DEAD_REASON_HEADER].startswith("too_many_deliveries")
    assert starts(tmp_path, result.id) == 0


# ---------------------------------------------------------------- time limits
def test_soft_limit_caught_by_the_task_is_its_result(broker, client, start_worker):
    from tests.apps.basic import soft_catch
    start_worker(broker)
    assert soft_catch.apply_async((30,), soft_time_limit=0.3).get(timeout=30) == "cleaned up"
    assert broker.queue_size() == 0


def test_soft_limit_not_caught_is_a_failure(broker, client, start_worker):
    from tests.apps.basic import soft_ignored
    start_worker(broker)
    result = soft_ignored.apply_async((30,), soft_time_limit=0.3, time_limit=20)
    assert isinstance(failure(result), SoftTimeLimitExceeded)
    assert broker.queue_size() == 0
    dead_letters(broker, 0)


def test_task_decorator_and_config_limits_apply(broker, client, start_worker):
    from tests.apps.basic import soft_catch
    start_worker(broker, soft_time_limit=0.3, time_limit=20)   # config default
    assert soft_catch.delay(30).get(timeout=30) == "cleaned up"


@pytest.mark.parametrize("broker", ["sqlite"], indirect=True)
def test_hard_limit_kills_what_the_task_started(broker, client, start_worker, tmp_path):
    from tests.apps.basic import sleeper
    start_worker(broker)
    result = sleeper.apply_async((1000,), time_limit=1)
    assert isinstance(failure(result), TimeLimitExceeded)
    grandchild = int((tmp_path / "grandchild.pid").read_text())
    wait_until(lambda: process_gone(grandchild), 5,
               "the task's `sleep 1000` to be killed")


@pytest.mark.parametrize("broker", ["sqlite"], indirect=True)
def test_a_blocking_c_call_is_killed_at_the_hard_limit(broker, client, start_worker):
    from tests.apps.basic import c_compute
    start_worker(broker)
    sent = time.monotonic()
    result = c_compute.apply_async(soft_time_limit=0.5, time_limit=1.5)
    assert isinstance(failure(result), TimeLimitExceeded)
    # The soft limit could not interrupt C code; the hard limit did, on time (generous
    # bound for a loaded 2-core machine; the latency itself is measured in benchmarks/).
    assert time.monotonic() - sent < 6


# ---------------------------------------------------------------- children
@pytest.mark.parametrize("broker", ["sqlite"], indirect=True)
def test_children_die_with_the_supervisor(broker, start_worker):
    worker = start_worker(broker)
    children = wait_until(lambda: len(worker.children()) == 2 and worker.children(), 10,
                          "two children")
    os.kill(worker.pid, signal.SIGKILL)

    def gone() -> bool:
        return all(process_gone(pid) for pid in children)
    wait_until(gone, 5, "the children to die with their supervisor")


@pytest.mark.parametrize("broker", ["sqlite"], indirect=True)
def test_repeated_crashes_back_off(broker, client, start_worker):
    from tests.apps.basic import die
    worker = start_worker(broker, concurrency=1, max_deliveries=1)
    for _ in range(4):
        die.delay()
    worker.wait_for_log(r"child slot 1 crashed 3 times in a row; starting the next one in 0\.2 s")


def test_max_tasks_per_child_recycles(broker, client, start_worker):
    from tests.apps.basic import pid
    start_worker(broker, concurrency=1, max_tasks_per_child=2)
    pids = [pid.delay().get(timeout=30) for _ in range(5)]
    assert pids[0] == pids[1] != pids[2] == pids[3] != pids[4]


@pytest.mark.parametrize("broker", ["sqlite"], indirect=True)
def test_max_memory_per_child_measures_the_child_and_recycles_it_after_the_task(
        broker, client, start_worker):
    """The limit is well above the supervisor's RSS (about 40 MB) and a fresh child's: only
    a child that grew past it is recycled, at once after its task, and the log names the
    child's RSS. (It once measured the supervisor, whose pid it had captured before fork.)"""
    from tests.apps.basic import hog, pid
    limit = 64 * 1024 * 1024
    small = [pid.delay() for _ in range(2)]
    big = hog.delay(3 * limit // (1024 * 1024))       # held by the child after it returns
    after = pid.delay()
    # All four are fetched before the first one ends: the next one starts at once.
    worker = start_worker(broker, concurrency=1, prefetch_multiplier=4,
                          max_memory_per_child="64MiB")
    supervisor_rss = psutil.Process(worker.pid).memory_info().rss
    assert supervisor_rss < limit / 1.2, "the limit must be well above the supervisor's RSS"
    first, second = (r.get(timeout=30) for r in small)
    hog_pid = big.get(timeout=30)
    assert first == second == hog_pid            # small tasks leave the child alone
    assert after.get(timeout=30) != hog_pid      # recycled before it could take the next
    log = worker.wait_for_log(rf"recycling child 1 \(pid {hog_pid}\): uses \d+ KiB")
    [kib] = re.findall(rf"recycling child 1 \(pid {hog_pid}\): uses (\d+) KiB", log)
    assert int(kib) * 1024 >= 3 * limit > supervisor_rss
    assert log.count("recycling child") == 1


@pytest.mark.parametrize("broker", ["sqlite"], indirect=True)
def test_buffered_work_survives_a_child_death(broker, client, start_worker, tmp_path):
    from tests.apps.basic import die, record
    doomed = die.delay()
    others = [record.delay() for _ in range(3)]
    start_worker(broker, concurrency=1, prefetch_multiplier=4, max_deliveries=1)
    assert isinstance(failure(doomed), WorkerLostError)
    assert [r.get(timeout=30) for r in others] == [r.id for r in others]
    assert [starts(tmp_path, r.id) for r in others] == [1, 1, 1]


def test_warm_shutdown_requeues_the_buffer_at_once(broker, client, start_worker, tmp_path):
    from tests.apps.basic import record
    running = record.delay(2)
    buffered = [record.delay() for _ in range(3)]
    worker = start_worker(broker, concurrency=1, prefetch_multiplier=4)
    wait_until(lambda: runs(tmp_path), 20, "the first task to start")
    wait_until(lambda: broker.queue_size() == 0, 10, "the buffer to fill")
    worker.signal(signal.SIGTERM)
    wait_until(lambda: broker.queue_size() == 3, 1.5,
               "the three buffered messages back in the queue before the running one ends")
    assert worker.wait_exit(30) == 0
    assert running.get(timeout=5) == running.id
    assert [starts(tmp_path, r.id) for r in buffered] == [0, 0, 0]


# ---------------------------------------------------------------- chaos
def _kill_busy_children(worker, stop_when, max_kills: int) -> int:
    kills = 0
    rng = random.Random(7)
    while not stop_when() and kills < max_kills:
        busy = []
        for pid in worker.children():
            try:
                if "running" in " ".join(psutil.Process(pid).cmdline()):
                    busy.append(pid)
            except psutil.Error:
                pass
        if busy:
            os.kill(rng.choice(busy), signal.SIGKILL)
            kills += 1
        time.sleep(rng.uniform(0.02, 0.1))
    return kills


@pytest.mark.timeout(300)
def test_random_child_kills_lose_nothing_and_repeat_at_most_once_per_kill(
        broker, client, start_worker, tmp_path):
    from tests.apps.basic import record
    from workhorse.states import SUCCESS
    results = [record.delay(0.005) for _ in range(1000)]
    worker = start_worker(broker)
    done = lambda: all(r.state == SUCCESS for r in results[-50:])  # noqa: E731
    kills = _kill_busy_children(worker, done, max_kills=20)
    for r in results:
        assert r.get(timeout=120) == r.id
    counts = {}
    for _, tid, _ in runs(tmp_path):
        counts[tid] = counts.get(tid, 0) + 1
    assert set(counts) == {r.id for r in results}               # zero lost
    extra = sum(counts.values()) - len(results)
    assert extra <= kills, f"{extra} extra runs for {kills} kills"
    assert broker.queue_size() == 0


@pytest.mark.timeout(300)
def test_random_child_kills_with_early_ack_fail_the_killed_and_repeat_none(
        broker, client, start_worker, tmp_path):
    from tests.apps.basic import record
    from workhorse.states import FAILURE, SUCCESS
    results = [record.delay(0.005) for _ in range(1000)]
    worker = start_worker(broker, acks_late=False)
    done = lambda: all(r.ready() for r in results[-50:])  # noqa: E731
    kills = _kill_busy_children(worker, done, max_kills=20)
    for r in results:
        r.get(timeout=120, propagate=False)
    counts = {}
    for _, tid, _ in runs(tmp_path):
        counts[tid] = counts.get(tid, 0) + 1
    assert max(counts.values()) == 1                             # none repeated
    lost = [r for r in results if r.state == FAILURE]
    assert all(isinstance(r.result, WorkerLostError) for r in lost)
    assert len(lost) <= kills
    assert all(r.state in (SUCCESS, FAILURE) for r in results)
