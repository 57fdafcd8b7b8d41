"""Reaping: the pool's SIGCHLD handling against fakes (tier 1), then the real waits, the
billiard hand-over and the sentinel with real processes but no daemon."""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
from collections.abc import Iterator

import psutil
import pytest

from tests.fakes import Events, FakeClock, FakeOS, delivery, make_slots
from workhorse.daemon.sentinel import Sentinel
from workhorse.daemon.slots import Slots
from workhorse.daemon.system import System
from workhorse.outcome import Outcome
from workhorse.pool.ipc import Job
from workhorse.pool.linux import CHILD_OOM_SCORE_ADJ

from .conftest import wait_until

pytestmark = pytest.mark.timeout(30)

JOB = Job(1, "t.add", b"[]", "application/json", "utf-8", {}, {}, False)


def pool(size: int = 1) -> tuple[Slots, FakeOS, Events]:
    slots, os_, _, events, _ = make_slots(FakeClock(), size)
    return slots, os_, events


# ---------------------------------------------------------------------- tier 1
def test_a_child_killed_from_outside_has_its_group_killed_before_it_is_reaped():
    slots, os_, events = pool()
    (child,) = slots.idle()
    d = delivery()
    slots.start(child, d, JOB, None, None)
    os_.handles[0].code = -signal.SIGKILL       # the OOM killer: the child could do nothing
    slots.reap()
    assert os_.trace == [("killpg", child.pid), ("reap", child.pid)]
    assert [(task_id, outcome) for task_id, outcome, _ in events.lost] == [
        (d.request.id, Outcome.CHILD_LOST)]
    assert len(os_.handles) == 2                # replaced


def test_a_child_that_exits_normally_has_its_group_killed_too():
    slots, os_, _ = pool()
    (child,) = slots.idle()
    child.stop()
    os_.handles[0].code = 0
    slots.reap()
    assert os_.trace == [("killpg", child.pid), ("reap", child.pid)]


def test_every_exit_behind_one_sigchld_is_reaped_and_an_orphan_only_reaped(caplog):
    slots, os_, _ = pool(size=2)
    a, b = (slot.child for slot in slots.slots.values())
    assert a is not None and b is not None
    os_.handles[0].code = 1
    os_.handles[1].code = -signal.SIGSEGV
    os_.strays[4242] = 0                        # a task's orphan the supervisor adopted
    with caplog.at_level(logging.DEBUG, "workhorse.supervisor"):
        slots.reap()
    assert sorted(os_.trace) == sorted([("killpg", a.pid), ("reap", a.pid),
                                        ("killpg", b.pid), ("reap", b.pid), ("reap", 4242)])
    assert os_.exited() is None
    (orphan,) = [r for r in caplog.records if "4242" in r.getMessage()]
    assert orphan.levelno == logging.DEBUG
    assert len(os_.handles) == 4                # only the pool's two were replaced


def test_a_pid_that_will_not_be_reaped_does_not_hang_the_loop(caplog):
    slots, os_, _ = pool()
    os_.reap = lambda pid: None                 # type: ignore[method-assign]
    os_.strays[4242] = 0
    slots.reap()
    assert "4242 exited but could not be reaped" in caplog.text


# ---------------------------------------------------------------------- real processes
class ExitWith:
    """A ChildRuntime stand-in: the forked child exits at once, as told."""

    def __init__(self, code: int) -> None:
        self.code = code

    def setup(self, close_fds: list[int]) -> None:
        if self.code < 0:
            os.kill(os.getpid(), -self.code)

    def run(self) -> int:
        return self.code


def zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def system() -> Iterator[System]:
    system = System()
    pids: list[int] = []
    real_spawn = system.spawn

    def spawn(number, make_runtime):
        handle = real_spawn(number, make_runtime)
        pids.append(handle.pid)
        return handle
    system.spawn = spawn                        # type: ignore[method-assign]
    yield system
    for pid in pids:
        with contextlib.suppress(ChildProcessError, ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def test_starting_a_child_never_reaps_one_that_exited(system):
    first = system.spawn(1, lambda *a: ExitWith(-signal.SIGKILL))
    wait_until(lambda: zombie(first.pid), 10, "the first child to exit")
    # billiard's Process.start() waits (WNOHANG) for every Process started before it.
    second = system.spawn(2, lambda *a: ExitWith(3))
    wait_until(lambda: zombie(second.pid), 10, "the second child to exit")
    assert zombie(first.pid)                    # still ours to kill the group of, and reap
    seen = {}
    while (exited := system.exited()) is not None:
        pid, code = exited
        seen[pid] = code
        system.reap(pid)
    assert seen == {first.pid: -signal.SIGKILL, second.pid: 3}
    assert not psutil.pid_exists(first.pid) and not psutil.pid_exists(second.pid)


def test_a_child_raises_its_own_oom_score(system):
    with open("/proc/self/oom_score_adj") as f:
        ours = int(f.read())
    child = system.spawn(1, lambda *a: ExitWith(0))
    wait_until(lambda: zombie(child.pid), 10, "the child to exit")
    with open(f"/proc/{child.pid}/oom_score_adj") as f:     # a zombie keeps its score
        assert int(f.read()) == max(ours, CHILD_OOM_SCORE_ADJ)


def group(seconds: int = 60) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", str(seconds)], process_group=0)


def test_the_sentinel_kills_the_groups_it_holds_when_the_supervisor_end_closes():
    sentinel = Sentinel()
    sentinel.start()
    kept, gone = group(), group()
    try:
        sentinel.watch(kept.pid)
        sentinel.watch(gone.pid)
        sentinel.forget(gone.pid)
        sentinel.close()                        # as the kernel does when the supervisor dies
        assert kept.wait(10) == -signal.SIGKILL
        assert gone.poll() is None              # told it was gone: never touched
    finally:
        for proc in (kept, gone):
            proc.kill()
            proc.wait(10)


def test_the_sentinel_is_deaf_to_signals_meant_for_the_supervisor():
    sentinel = Sentinel()
    sentinel.start()
    assert sentinel.pid is not None
    try:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            os.kill(sentinel.pid, sig)
        with pytest.raises(psutil.TimeoutExpired):
            psutil.Process(sentinel.pid).wait(0.5)
        assert os.getpgid(sentinel.pid) == sentinel.pid     # not in our process group
    finally:
        sentinel.close()
    assert not psutil.pid_exists(sentinel.pid)


def test_an_fd_opened_after_the_baseline_is_private_even_on_the_number_the_listing_used():
    from workhorse.daemon.system import _open_fds, _private_fds
    baseline = _open_fds()
    read_end, write_end = os.pipe()      # takes the lowest free numbers
    try:
        assert {read_end, write_end} <= set(_private_fds(baseline))
    finally:
        os.close(read_end)
        os.close(write_end)
