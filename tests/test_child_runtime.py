"""The child's runtime, in this process: what becomes of a process the task forks, and
a soft-limit signal that lands while the child writes a frame."""
from __future__ import annotations

import fcntl
import os
import signal
import sys
import termios
import threading
import time

import pytest

from workhorse import SoftTimeLimitExceeded
from workhorse.pool.ipc import Done, FrameReader
from workhorse.pool.limits import SOFT_LIMIT_SIGNAL
from workhorse.pool.runtime import ChildRuntime

pytestmark = pytest.mark.timeout(30)


def task_body(ending: str) -> None:
    if ending == "raise":
        raise ValueError("raised in both processes")
    if ending == "sys.exit(3)":
        sys.exit(3)


@pytest.mark.parametrize("ending, status", [("return", 0), ("raise", 1), ("sys.exit(3)", 3)])
def test_a_process_forked_by_a_task_exits_as_the_task_ends_in_it(ending, status):
    runtime = ChildRuntime(None, 1, -1, -1, os.getppid(), "host")  # type: ignore[arg-type]
    runtime.pid = os.getpid()           # what setup() records in a real child
    r, w = os.pipe()
    copy = -1
    try:
        with runtime.running_task():
            copy = os.fork()
            task_body(ending)
    except (ValueError, SystemExit):
        pass
    if copy == 0:
        # The copy got past the task, where it would store and report: it must not.
        os.write(w, b"escaped")
        os._exit(99)
    os.close(w)
    _, wait_status = os.waitpid(copy, 0)
    escaped = os.read(r, 100)
    os.close(r)
    assert escaped == b""
    assert os.waitstatus_to_exitcode(wait_status) == status


def test_the_child_itself_goes_on_after_its_task():
    runtime = ChildRuntime(None, 1, -1, -1, os.getppid(), "host")  # type: ignore[arg-type]
    runtime.pid = os.getpid()
    with runtime.running_task():
        pass
    with pytest.raises(ValueError), runtime.running_task():
        task_body("raise")


@pytest.fixture
def writing_runtime():
    """A runtime whose frames go down a real pipe, its soft-limit handler installed here."""
    r, w = os.pipe()
    runtime = ChildRuntime(None, 1, r, w, os.getppid(), "host")  # type: ignore[arg-type]
    previous = signal.getsignal(SOFT_LIMIT_SIGNAL)
    runtime.soft_limit.install()
    try:
        yield runtime
    finally:
        signal.signal(SOFT_LIMIT_SIGNAL, previous)
        os.close(r)
        os.close(w)


def send_while_signalled(runtime: ChildRuntime, frame: Done,
                         ) -> tuple[list[object], int, BaseException | None]:
    """``runtime.send(frame)`` on this (the main) thread: a frame six times what the pipe
    holds. Another thread reads it: each time the pipe is full (the writer waits in
    write(2)) it first sends this thread the soft-limit signal, five times at most.
    Returns the frames read whole, how many signals were sent mid-write, and what
    ``send`` raised."""
    fd = runtime.read_fd
    size = fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)
    frames: list[object] = []
    signalled = 0
    sent = threading.Event()
    main = threading.main_thread().ident
    assert main == threading.get_ident() and main is not None

    def reader() -> None:
        nonlocal signalled
        os.set_blocking(fd, False)
        stream = FrameReader(fd)
        deadline = time.monotonic() + 20
        while not frames and time.monotonic() < deadline:
            while _queued(fd) < size and not sent.is_set() and time.monotonic() < deadline:
                time.sleep(0.0005)      # until the writer waits on the full pipe
            if signalled < 5 and _queued(fd) >= size:
                signal.pthread_kill(main, SOFT_LIMIT_SIGNAL)
                signalled += 1
            frames.extend(stream.read())
            if sent.is_set() and not _queued(fd):
                return          # all that was written is read

    thread = threading.Thread(target=reader)
    thread.start()
    error = None
    try:
        runtime.send(frame)
    except SoftTimeLimitExceeded as exc:
        error = exc
    finally:
        sent.set()
        thread.join(25)
    return frames, signalled, error


def _queued(fd: int) -> int:
    """The bytes waiting in a pipe, from its read end."""
    buf = bytearray(4)
    fcntl.ioctl(fd, termios.FIONREAD, buf)
    return int.from_bytes(buf, sys.byteorder)


def big_done() -> Done:
    return Done(1, 7, "success", "x" * 400_000, 0, 0.0, None, None)


def test_a_soft_limit_signal_while_the_result_is_written_does_not_cut_it(writing_runtime):
    """The result of a task is written unarmed: the signal is not blocked, its handler
    does nothing, and the write goes on where it stopped."""
    frame = big_done()
    frames, signalled, error = send_while_signalled(writing_runtime, frame)
    assert signalled > 0
    assert error is None
    assert frames == [frame]


def test_while_the_limit_is_armed_the_signal_waits_for_the_frame_to_be_whole(writing_runtime):
    """A frame sent from inside the task: the signal is held until the frame is written
    whole, and raises in the task only then."""
    frame = big_done()
    writing_runtime.soft_limit.armed = True
    frames, signalled, error = send_while_signalled(writing_runtime, frame)
    assert signalled > 0
    assert isinstance(error, SoftTimeLimitExceeded)
    assert frames == [frame]


@pytest.mark.parametrize("measure", [True, False])
def test_a_child_reads_its_memory_only_where_it_is_compared_with_a_limit(measure):
    """Its RSS after each task (one ``pread``) is for max_memory_per_child alone: with no
    limit the child neither opens /proc/self/statm nor reads it, and reports 0."""
    r, w = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            runtime = ChildRuntime(None, 1, -1, w, parent, "host",  # type: ignore[arg-type]
                                   measure_memory=measure)
            runtime.setup([])
            os.write(w, f"{runtime._statm is not None} {runtime.rss()}".encode())
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    opened, rss = os.read(r, 100).decode().split()
    os.close(r)
    assert opened == str(measure)
    assert (int(rss) > 1024 * 1024) if measure else (int(rss) == 0)
