"""Processes a task starts do not outlive its child or the supervisor, orphans are reaped,
and the kernel's OOM killer prefers a child to the supervisor. Real daemon, real signals;
the broker does not matter here (SQLite)."""
from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from .conftest import wait_until

pytestmark = [pytest.mark.timeout(90),
              pytest.mark.parametrize("broker", ["sqlite"], indirect=True)]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def reaped(pid: int) -> bool:
    return not psutil.pid_exists(pid)


@pytest.fixture
def sleeps(tmp_path: Path) -> Iterator[list[int]]:
    """Pids of `sleep` processes the test's tasks started: killed at the end, whatever
    happened (with their process group, which is their child's while it lasts), and so is
    the last one written, by a task run again."""
    pids: list[int] = []
    yield pids
    with contextlib.suppress(OSError, ValueError):
        pids.append(int((tmp_path / "grandchild.pid").read_text()))
    for pid in pids:
        with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
            if psutil.Process(pid).name() == "sleep":
                os.killpg(os.getpgid(pid), signal.SIGKILL)
                os.kill(pid, signal.SIGKILL)


def started_sleep(tmp_path: Path, sleeps: list[int]) -> int:
    """The pid of the `sleep` a task started, once it has written it."""
    path = tmp_path / "grandchild.pid"

    def written() -> int:
        try:
            return int(path.read_text())
        except (OSError, ValueError):
            return 0
    pid = int(wait_until(written, 30, "the task to start its `sleep`"))   # type: ignore[arg-type]
    sleeps.append(pid)
    return pid


def test_what_a_task_started_dies_with_its_child_killed_from_outside(
        broker, client, start_worker, tmp_path, sleeps):
    from tests.apps.basic import sleeper
    worker = start_worker(broker, concurrency=1)
    sleeper.delay(1000)
    grandchild = started_sleep(tmp_path, sleeps)
    child = psutil.Process(grandchild).ppid()
    assert child in worker.children()
    os.kill(child, signal.SIGKILL)          # as the OOM killer does
    wait_until(lambda: gone(grandchild), 5, "the task's `sleep` to die with its child")
    worker.wait_for_log(r"child 1 \(pid \d+\) killed by SIGKILL")


def test_what_a_task_started_dies_with_a_supervisor_killed_outright(
        broker, client, start_worker, tmp_path, sleeps):
    from tests.apps.basic import sleeper
    worker = start_worker(broker, concurrency=1)
    sleeper.delay(1000)
    grandchild = started_sleep(tmp_path, sleeps)
    child = psutil.Process(grandchild).ppid()
    os.kill(worker.pid, signal.SIGKILL)
    wait_until(lambda: gone(child) and gone(grandchild), 5,
               "the child and the task's `sleep` to die with their supervisor")


def test_an_orphan_a_task_left_behind_is_adopted_and_reaped(
        broker, client, start_worker, tmp_path, sleeps):
    from tests.apps.basic import orphan
    worker = start_worker(broker, concurrency=1, max_tasks_per_child=1)
    assert orphan.delay(5).get(timeout=30) == "left behind"
    left = started_sleep(tmp_path, sleeps)
    # Out of its child's group (its own session), so recycling the child spares it; the
    # supervisor, a child subreaper, adopts it and reaps it when it ends: no zombie stays.
    wait_until(lambda: psutil.Process(left).ppid() == worker.pid, 5,
               "the supervisor to adopt the orphan")
    wait_until(lambda: reaped(left), 15, "the orphan, ended, to be reaped")
    assert worker.proc.poll() is None


def test_the_oom_killer_prefers_a_child_to_the_supervisor(broker, start_worker):
    worker = start_worker(broker)
    children = wait_until(lambda: len(worker.children()) == 2 and worker.children(), 10,
                          "two children")

    def score(pid: int) -> int:
        return int(Path(f"/proc/{pid}/oom_score_adj").read_text())
    supervisor = score(worker.pid)
    assert all(supervisor < score(pid) for pid in children)   # type: ignore[union-attr]
