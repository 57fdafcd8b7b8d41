"""Frames between supervisor and child, and the loop's timers and wakeups."""
from __future__ import annotations

import os
import signal
import time

from workhorse.daemon.loop import Loop
from workhorse.daemon.signals import SignalPipe
from workhorse.pool.ipc import Done, FrameReader, encode, read_frame, write_frame


def test_frames_survive_being_split_anywhere():
    frames = [Done(i, "succeeded", "x" * i) for i in range(50)]
    data = b"".join(encode(f) for f in frames)
    r, w = os.pipe()
    os.set_blocking(r, False)
    reader = FrameReader(r)
    got = []
    try:
        for start in range(0, len(data), 7):   # dribble the bytes in 7 at a time
            os.write(w, data[start:start + 7])
            got.extend(reader.read())
    finally:
        os.close(r)
        os.close(w)
    assert got == frames


def test_reader_sees_eof_when_the_writer_is_gone():
    r, w = os.pipe()
    os.set_blocking(r, False)
    write_frame(w, "last")
    os.close(w)
    reader = FrameReader(r)
    assert reader.read() == ["last"]
    # The fd stays readable at EOF, so the loop calls again and then learns it.
    assert reader.read() == []
    assert reader.eof
    os.close(r)


def test_blocking_read_frame_round_trip_and_eof():
    r, w = os.pipe()
    big = b"x" * 200_000   # larger than a pipe buffer: the writer must loop
    pid = os.fork()
    if pid == 0:
        os.close(r)
        write_frame(w, big)
        os._exit(0)
    os.close(w)
    assert read_frame(r) == big
    assert read_frame(r) is None
    os.waitpid(pid, 0)
    os.close(r)


def test_timers_fire_in_order_and_cancelled_ones_do_not():
    loop = Loop()
    fired = []
    now = time.monotonic()
    loop.call_at(now + 0.02, lambda: fired.append("b"))
    loop.call_at(now + 0.01, lambda: fired.append("a"))
    loop.call_at(now + 0.015, lambda: fired.append("x")).cancel()
    deadline = time.monotonic() + 2
    while len(fired) < 2 and time.monotonic() < deadline:
        loop.run_once(max_timeout=0.5)
    assert fired == ["a", "b"]
    loop.close()


def test_a_signal_wakes_a_loop_blocked_without_timeout():
    loop = Loop()
    pipe = SignalPipe([signal.SIGUSR2])
    pipe.install()
    got: list[signal.Signals] = []
    loop.add_reader(pipe.read_fd, lambda: got.extend(pipe.drain()))
    # A timer far away: only the signal can end this wait early.
    loop.call_later(30, lambda: None)
    try:
        start = time.monotonic()
        os.kill(os.getpid(), signal.SIGUSR2)
        loop.run_once()
        assert got == [signal.SIGUSR2]
        assert time.monotonic() - start < 1.0
    finally:
        pipe.restore()
        pipe.close()
        loop.close()


def test_a_reader_removed_earlier_in_the_same_batch_is_not_called():
    loop = Loop()
    pipes = [os.pipe() for _ in range(2)]
    called: list[int] = []

    def first() -> None:
        called.append(0)
        loop.remove_reader(pipes[1][0])
        loop.remove_reader(pipes[0][0])

    def second() -> None:
        called.append(1)
        loop.remove_reader(pipes[0][0])
        loop.remove_reader(pipes[1][0])

    loop.add_reader(pipes[0][0], first)
    loop.add_reader(pipes[1][0], second)
    for _, w in pipes:
        os.write(w, b"x")
    try:
        loop.run_once(max_timeout=1)
        assert len(called) == 1   # whichever ran first removed the other
    finally:
        for r, w in pipes:
            os.close(r)
            os.close(w)
        loop.close()
