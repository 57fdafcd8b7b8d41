"""The supervisor's Child state machine, against a fake process handle (no fork)."""
from __future__ import annotations

import signal

import pytest

from workhorse.pool.child import Child, ChildState, InvalidTransition, describe_exit
from workhorse.pool.ipc import Job, Stop


class FakeHandle:
    pid = 4242
    read_fd = -1

    def __init__(self) -> None:
        self.sent: list[object] = []
        self.killed = 0
        self.closed = False

    def send(self, frame: object) -> None:
        self.sent.append(frame)

    def receive(self) -> list[object]:
        return []

    at_eof = False

    def kill_tree(self) -> None:
        self.killed += 1

    def kill_group(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


JOB = Job(1, "t", b"[]", "application/json", "utf-8", {}, {}, False)


def make() -> tuple[Child, FakeHandle]:
    handle = FakeHandle()
    return Child(0, handle, 0.0), handle


def test_normal_life():
    child, handle = make()
    assert child.state is ChildState.SPAWNING
    child.on_hello()
    child.assign("delivery", JOB, 1.0)
    assert child.state is ChildState.BUSY and handle.sent == [JOB]
    assert child.on_done(rss=123) == "delivery"
    assert (child.state, child.tasks_done, child.rss) == (ChildState.IDLE, 1, 123)
    child.stop()
    assert child.state is ChildState.STOPPING and isinstance(handle.sent[-1], Stop)
    assert child.on_exit(0) is None
    assert child.state is ChildState.EXITED and handle.closed


def test_cannot_assign_to_a_child_that_has_not_said_hello():
    child, handle = make()
    with pytest.raises(InvalidTransition, match="spawning, expected idle"):
        child.assign("d", JOB, 0.0)
    assert handle.sent == []


def test_a_child_stopped_while_starting_stays_stopping_when_it_says_hello():
    child, handle = make()
    child.stop()
    child.on_hello()
    assert child.state is ChildState.STOPPING and isinstance(handle.sent[-1], Stop)


def test_cannot_assign_twice():
    child, _ = make()
    child.on_hello()
    child.assign("d", JOB, 0.0)
    with pytest.raises(InvalidTransition):
        child.assign("e", JOB, 0.0)


def test_kill_while_busy_keeps_the_job_for_settlement():
    child, handle = make()
    child.on_hello()
    child.assign("d", JOB, 0.0)
    child.kill("time_limit")
    assert handle.killed == 1 and child.state is ChildState.BUSY
    assert child.on_exit(-9) == "d"
    assert child.kill_reason == "time_limit"


def test_first_kill_reason_wins():
    child, _ = make()
    child.on_hello()
    child.assign("d", JOB, 0.0)
    child.kill("time_limit")
    child.kill("shutdown")
    assert child.kill_reason == "time_limit"


def test_an_exited_child_takes_no_transition():
    child, _ = make()
    child.on_exit(1)
    for action in (child.on_hello, child.stop, lambda: child.kill("x"), lambda: child.on_exit(0)):
        with pytest.raises(InvalidTransition):
            action()


@pytest.mark.parametrize("code, text", [
    (-signal.SIGKILL, "killed by SIGKILL (out of memory?"),
    (-signal.SIGSEGV, "killed by SIGSEGV (a crash in C code"),
    (3, "exited with status 3"),
    (-200, "killed by signal 200"),
])
def test_exit_descriptions_name_the_signal_and_a_hint(code, text):
    assert describe_exit(code).startswith(text)
