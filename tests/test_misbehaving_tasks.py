"""Tasks that do what a worker cannot plan for — fork and return twice, return what cannot
be encoded, scribble on their child's pipe — and a worker that stays up through each,
settling the task once. The real daemon, on every broker unless marked."""
from __future__ import annotations

import psutil
import pytest

from workhorse.exceptions import ResultEncodeError, WorkerLostError

from .conftest import BROKERS, broker_fixture, runs, wait_until
from .test_delivery import dead_letters, failure

#: (quorum: the same on a RabbitMQ quorum queue)
broker = broker_fixture(*BROKERS, "quorum")

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


# ---------------------------------------------------------------- a task that forks
def test_task_that_forks_and_returns_twice_keeps_the_worker_up(broker, client, start_worker,
                                                                tmp_path):
    from tests.apps.basic import add, fork_and_return
    worker = start_worker(broker, concurrency=1, result_backend=COUNTING)
    result = fork_and_return.delay()
    child_pid = result.get(timeout=30)
    assert starts(tmp_path, "fork_and_return", result.id) == [child_pid]
    [copy_pid] = starts(tmp_path, "forked_copy", result.id)
    assert copy_pid != child_pid
    assert [add.delay(i, i).get(timeout=30) for i in range(3)] == [0, 2, 4]
    assert result.state == "SUCCESS"
    assert stores(tmp_path, result.id) == ["SUCCESS"]      # by the child, not by its copy
    assert_worker_unharmed(worker)
    assert "ignored a" not in worker.log()                 # the copy wrote no frame at all
    assert f"forked by task {fork_and_return.name}" in worker.log()


@pytest.mark.parametrize("broker", ["sqlite"], indirect=True)
def test_a_forked_copy_still_running_after_its_task_returned_writes_nothing(
        broker, client, start_worker, tmp_path):
    """The copy returns from the task a second after its child did, while the child runs
    the next tasks: it exits there, so it neither stores a result, nor reports a Done for a
    job that is over, nor reads the jobs meant for the child (the frame checks in the
    supervisor would drop what it wrote, but it writes nothing)."""
    from tests.apps.basic import fork_and_return, pid
    worker = start_worker(broker, concurrency=1, result_backend=COUNTING)
    result = fork_and_return.delay(linger=1.0)
    child_pid = result.get(timeout=30)
    [copy_pid] = wait_until(lambda: starts(tmp_path, "forked_copy", result.id), 10,
                            "the forked copy to start")

    def copy_gone() -> bool:
        try:
            return psutil.Process(copy_pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
    ran_in: list[int] = []
    while not copy_gone() and len(ran_in) < 500:
        ran_in.append(pid.delay().get(timeout=30))
    assert copy_gone(), "the forked copy did not exit when its task returned"
    ran_in += [pid.delay().get(timeout=30) for _ in range(3)]
    assert set(ran_in) == {child_pid}          # the child was never lost nor replaced
    assert stores(tmp_path, result.id) == ["SUCCESS"]
    assert result.get(timeout=5) == child_pid
    assert_worker_unharmed(worker)
    assert "ignored a" not in worker.log()


@pytest.mark.parametrize("broker", ["sqlite"], indirect=True)
def test_a_child_whose_frames_cannot_be_read_is_killed_and_its_task_settled_as_lost(
        broker, client, start_worker, tmp_path):
    from tests.apps.basic import add, garble_frames
    worker = start_worker(broker, concurrency=1, reject_on_worker_lost=False)
    result = garble_frames.delay()
    assert isinstance(failure(result), WorkerLostError)
    dead_letters(broker, 1)
    assert len(starts(tmp_path, "garble_frames", result.id)) == 1
    assert add.delay(2, 2).get(timeout=30) == 4
    assert_worker_unharmed(worker)
    assert "cannot be read" in worker.log()


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
