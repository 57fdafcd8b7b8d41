"""Why a child died, as the log and the stored FAILURE say it: the supervisor's own kills
(hard time limit, cold shutdown) in words, and only a kill from outside guessed at
("out of memory? ... or killed by an operator"). Real daemon, real signals, SQLite."""
from __future__ import annotations

import os
import signal

import pytest

from workhorse.exceptions import TimeLimitExceeded, WorkerLostError

from .conftest import runs, wait_until

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.parametrize("broker", ["sqlite"], indirect=True)]

OOM_GUESS = "out of memory?"


def failure(result, timeout: float = 30) -> BaseException:
    with pytest.raises(BaseException) as raised:
        result.get(timeout=timeout)
    return raised.value


def running_pid(tmp_path, task_id: str) -> int:
    """The pid of the child that started ``task_id`` (the test tasks record it)."""
    def started() -> int:
        return next((pid for _, tid, pid in runs(tmp_path) if tid == task_id), 0)
    return int(wait_until(started, 20, f"{task_id} to start"))  # type: ignore[arg-type]


def test_a_hard_time_limit_kill_is_stored_and_logged_as_the_limit(broker, client, start_worker):
    from tests.apps.basic import record
    worker = start_worker(broker, concurrency=1)
    result = record.apply_async((60,), time_limit=1)
    exc = failure(result)
    assert isinstance(exc, TimeLimitExceeded)
    assert "hard time limit (1 s) exceeded" in str(exc)
    log = worker.wait_for_log(r"killed by the supervisor: hard time limit \(1 s\) exceeded "
                              r"while running")
    assert OOM_GUESS not in log


def test_a_cold_shutdown_kill_is_logged_as_such_and_the_task_requeued(
        broker, client, start_worker, tmp_path):
    from tests.apps.basic import record
    worker = start_worker(broker, concurrency=1)
    result = record.delay(60)
    running_pid(tmp_path, result.id)
    worker.signal(signal.SIGQUIT)
    assert worker.wait_exit(30) == 0
    log = worker.log()
    assert "killed by the supervisor: cold shutdown (SIGQUIT) while running" in log
    assert OOM_GUESS not in log
    wait_until(lambda: broker.queue_size() == 1, 20, "the killed task back in its queue")


def test_a_cold_shutdown_kill_without_reject_on_worker_lost_stores_worker_lost_saying_so(
        broker, client, start_worker, tmp_path):
    from tests.apps.basic import record
    worker = start_worker(broker, concurrency=1, reject_on_worker_lost=False)
    result = record.delay(60)
    running_pid(tmp_path, result.id)
    worker.signal(signal.SIGQUIT)
    assert worker.wait_exit(30) == 0
    exc = failure(result)
    assert isinstance(exc, WorkerLostError)
    assert "cold shutdown (SIGQUIT)" in str(exc)
    log = worker.log()
    assert "killed by the supervisor: cold shutdown (SIGQUIT) while running" in log
    assert OOM_GUESS not in log


def test_a_child_sigkilled_from_outside_is_reported_as_oom_or_an_operator(
        broker, client, start_worker, tmp_path):
    from tests.apps.basic import record
    worker = start_worker(broker, concurrency=1, reject_on_worker_lost=False)
    result = record.delay(60)
    os.kill(running_pid(tmp_path, result.id), signal.SIGKILL)
    exc = failure(result)
    assert isinstance(exc, WorkerLostError)
    assert OOM_GUESS in str(exc) and "or killed by an operator" in str(exc)
    log = worker.wait_for_log(r"killed by SIGKILL \(out of memory\?.*or killed by an "
                              r"operator\) while running")
    assert "killed by the supervisor" not in log
