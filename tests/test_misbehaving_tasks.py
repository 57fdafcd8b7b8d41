"""Tasks that do what a worker cannot plan for — return what cannot be encoded — and a
worker that stays up through each, settling the task once. The real daemon, on every
broker unless marked."""
from __future__ import annotations

import pytest

from workhorse.exceptions import ResultEncodeError

from .conftest import runs
from .test_delivery import dead_letters, failure

pytestmark = pytest.mark.timeout(120)

#: The tests' SQLite result store, recording each result it stores in the run log.
COUNTING = "tests.apps.basic:CountingBackend"


def starts(tmp_path, name: str, task_id: str) -> list[int]:
    """The pids that started ``task_id`` (or, for ``stored:<state>``, stored it)."""
    return [pid for n, tid, pid in runs(tmp_path) if n == name and tid == task_id]


def stores(tmp_path, task_id: str) -> list[str]:
    """The states stored for ``task_id``, in order."""
    return [n.split(":", 1)[1] for n, tid, _ in runs(tmp_path)
            if n.startswith("stored:") and tid == task_id]


def assert_worker_unharmed(worker) -> None:
    assert worker.proc.poll() is None, worker.log()[-4000:]
    log = worker.log()
    assert "InvalidTransition" not in log
    assert "supervisor failed" not in log


# ---------------------------------------------------------------- results that cannot be stored
def test_a_result_that_cannot_be_encoded_fails_once_and_is_acked(broker, client, start_worker,
                                                                 tmp_path):
    from tests.apps.basic import add, deep_result
    worker = start_worker(broker, concurrency=1, result_backend=COUNTING)
    result = deep_result.delay()
    exc = failure(result)
    assert type(exc).__name__ == ResultEncodeError.__name__
    assert "cannot be encoded as JSON" in str(exc) and "recursion" in str(exc)
    assert add.delay(1, 1).get(timeout=30) == 2    # the one child went on: it was settled
    assert len(starts(tmp_path, "deep_result", result.id)) == 1
    assert stores(tmp_path, result.id) == ["FAILURE"]
    assert broker.queue_size() == 0
    dead_letters(broker, 0)
    assert_worker_unharmed(worker)


def test_an_exception_whose_args_cannot_be_encoded_fails_once_and_is_acked(
        broker, client, start_worker, tmp_path):
    from tests.apps.basic import add, deep_error
    worker = start_worker(broker, concurrency=1, result_backend=COUNTING)
    result = deep_error.delay()
    exc = failure(result)
    assert type(exc) is ValueError and str(exc.args[0]).startswith("[[[")
    assert add.delay(1, 1).get(timeout=30) == 2
    assert len(starts(tmp_path, "deep_error", result.id)) == 1
    assert stores(tmp_path, result.id) == ["FAILURE"]
    assert broker.queue_size() == 0
    dead_letters(broker, 0)
    assert_worker_unharmed(worker)
