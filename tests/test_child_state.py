"""The supervisor's Child state machine, against a fake process handle (no fork)."""
from __future__ import annotations

import logging
import signal

import pytest

from workhorse.pool.child import Child, ChildState, InvalidTransition, describe_exit
from workhorse.pool.ipc import Claimed, Corrupt, Done, Hello, Job, Stop


class FakeHandle:
    pid = 4242
    read_fd = -1

    def __init__(self) -> None:
        self.sent: list[object] = []
        self.killed = 0
        self.closed = False
        self.written: list[object] = []    # what the pipe holds for receive()

    def send(self, frame: object) -> None:
        self.sent.append(frame)

    def receive(self) -> list[object]:
        frames, self.written = self.written, []
        return frames

    at_eof = False

    def kill_tree(self, sig: int = 9) -> None:
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
    assert child.on_done(JOB.seq, rss=123).delivery == "delivery"
    assert (child.state, child.tasks_done, child.rss) == (ChildState.IDLE, 1, 123)
    child.stop()
    assert child.state is ChildState.STOPPING and isinstance(handle.sent[-1], Stop)
    assert child.on_exit(0) == []
    assert child.state is ChildState.EXITED and handle.closed


ASYNC = [JOB._replace(seq=seq, asynchronous=True) for seq in (11, 12, 13)]


def test_an_async_child_takes_more_async_jobs_and_is_idle_when_all_are_done():
    child, handle = make()
    child.on_hello()
    for frame in ASYNC:
        assert child.takes_async(3)
        child.assign(f"d{frame.seq}", frame, 1.0)
    assert child.state is ChildState.BUSY and child.asynchronous and handle.sent == ASYNC
    assert not child.takes_async(3) and child.takes_async(4)
    with pytest.raises(InvalidTransition):
        child.assign("sync", JOB, 2.0)          # never a sync job beside async ones
    assert child.on_done(12, rss=5).delivery == "d12"
    assert child.busy and set(child.jobs) == {11, 13}
    child.on_done(11, rss=5)
    child.on_done(13, rss=5)
    assert child.state is ChildState.IDLE and not child.asynchronous and child.tasks_done == 3
    child.assign("sync", JOB, 3.0)
    with pytest.raises(InvalidTransition):
        child.assign("d", ASYNC[0], 3.0)        # never an async job beside a sync one


def test_a_draining_or_reserved_async_child_takes_no_more():
    for flag in ("draining", "reserved"):
        child, _ = make()
        child.on_hello()
        child.assign("d", ASYNC[0], 1.0)
        setattr(child, flag, True)
        assert not child.takes_async(100)


def test_a_killed_async_child_returns_every_job_and_names_its_culprit():
    child, _ = make()
    child.on_hello()
    for frame in ASYNC:
        child.assign(f"d{frame.seq}", frame, 1.0)
    child.kill("time_limit", "hard limit", culprit=12)
    child.kill("other", "later", culprit=13)        # the first reason and culprit stand
    assert child.culprit == 12 and child.kill_reason == "time_limit"
    assert [r.delivery for r in child.on_exit(-9)] == ["d11", "d12", "d13"]


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
    assert [r.delivery for r in child.on_exit(-9)] == ["d"]
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


def test_stopping_a_child_that_has_exited_unreaped_is_not_an_error():
    child, handle = make()

    def gone(frame: object) -> None:
        raise BrokenPipeError(32, "Broken pipe")
    handle.send = gone    # type: ignore[method-assign]
    child.stop()
    assert child.state is ChildState.STOPPING
    assert child.on_exit(1) == []


# ---------------------------------------------------------------- frames that do not belong
FORKED = FakeHandle.pid + 1       # a process the task forked: same pipe, another pid


def busy() -> tuple[Child, FakeHandle]:
    child, handle = make()
    child.on_hello()
    child.assign("delivery", JOB, 1.0)
    return child, handle


def test_frames_of_the_current_job_from_the_child_are_passed_on():
    child, handle = busy()
    frames = [Claimed(FakeHandle.pid, JOB.seq, "key", "owner"),
              Done(FakeHandle.pid, JOB.seq, "succeeded")]
    handle.written = list(frames)
    assert child.receive() == frames


def test_a_second_done_from_a_forked_copy_is_ignored_and_logged(caplog):
    child, handle = busy()
    own = Done(FakeHandle.pid, JOB.seq, "succeeded")
    handle.written = [Done(FORKED, JOB.seq, "succeeded"), own]
    with caplog.at_level(logging.WARNING):
        assert child.receive() == [own]
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "child 1" in record.message and f"pid {FakeHandle.pid}" in record.message
    assert f"pid {FORKED}" in record.message and "Done" in record.message


def test_a_done_for_another_job_is_ignored_and_logged(caplog):
    child, handle = busy()
    handle.written = [Done(FakeHandle.pid, JOB.seq + 1, "succeeded"),
                      Claimed(FakeHandle.pid, JOB.seq - 1, "key", "owner")]
    with caplog.at_level(logging.WARNING):
        assert child.receive() == []
    assert [("Done" in r.message, "Claimed" in r.message) for r in caplog.records] == [
        (True, False), (False, True)]
    assert child.state is ChildState.BUSY


def test_a_done_reaching_an_idle_child_is_ignored_not_an_invalid_transition(caplog):
    child, handle = busy()
    done = Done(FakeHandle.pid, JOB.seq, "succeeded")
    handle.written = [done]
    [frame] = child.receive()
    child.on_done(JOB.seq, rss=1)
    handle.written = [done]                 # the same job's Done, a second time
    with caplog.at_level(logging.WARNING):
        assert child.receive() == []
    assert child.state is ChildState.IDLE and "Done" in caplog.text


def test_a_hello_from_another_process_is_ignored(caplog):
    child, handle = make()
    handle.written = [Hello(FORKED)]
    with caplog.at_level(logging.WARNING):
        assert child.receive() == []
    assert "Hello" in caplog.text and child.state is ChildState.SPAWNING


def test_something_that_is_no_frame_at_all_is_ignored(caplog):
    child, handle = busy()
    handle.written = ["not a frame"]
    with caplog.at_level(logging.WARNING):
        assert child.receive() == []
    assert "str" in caplog.text


def test_a_broken_stream_is_passed_on_last_for_the_supervisor_to_kill_the_child():
    child, handle = busy()
    done = Done(FakeHandle.pid, JOB.seq, "succeeded")
    mark = Corrupt("a frame does not unpickle")
    handle.written = [done, mark]
    assert child.receive() == [done, mark]
