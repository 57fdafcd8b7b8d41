"""Frames between supervisor and child, and the loop's timers and wakeups."""
from __future__ import annotations

import marshal
import os
import pickle
import signal
import struct
import time
import types
from datetime import UTC, datetime
from typing import Any

import pytest

from workhorse.daemon.loop import Loop
from workhorse.daemon.signals import SignalPipe
from workhorse.pool.ipc import (
    Claimed,
    Corrupt,
    Done,
    FrameReader,
    Hello,
    FrameStream,
    Job,
    Stop,
    encode,
    write_frame,
)


def test_frames_survive_being_split_anywhere():
    frames = [Done(4242, i, "succeeded", "x" * i) for i in range(50)]
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


def test_blocking_frame_stream_round_trip_and_eof():
    """The child's reader: a frame larger than a pipe (the writer loops, the reader reads
    several times), two frames that arrive in one read, then end of file."""
    r, w = os.pipe()
    big = b"x" * 200_000   # larger than a pipe buffer: the writer must loop
    pid = os.fork()
    if pid == 0:
        os.close(r)
        write_frame(w, big)
        os.write(w, encode("one") + encode("two"))
        os._exit(0)
    os.close(w)
    stream = FrameStream(r)
    assert stream.read() == big
    assert (stream.read(), stream.read()) == ("one", "two")
    assert stream.read() is None
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


def test_what_runs_before_the_loop_waits_may_make_the_wait_return_at_once():
    loop = Loop()
    seen = []
    loop.before_wait(lambda: seen.append("before") if len(seen) < 1 else None)
    loop.before_wait(lambda: loop.call_later(0, lambda: seen.append("due"))
                     if len(seen) == 1 else None)
    started = time.monotonic()
    loop.run_once()                 # no reader, no timer: it would wait for ever
    assert seen == ["before", "due"] and time.monotonic() - started < 5
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


class CountingSelector:
    """The loop's selector, its registrations counted (each is a system call)."""

    def __init__(self, selector: Any) -> None:
        self.inner, self.calls = selector, []

    def register(self, fd: int, events: int, data: Any = None) -> Any:
        self.calls.append(("register", fd))
        return self.inner.register(fd, events, data)

    def unregister(self, fd: int) -> Any:
        self.calls.append(("unregister", fd))
        return self.inner.unregister(fd)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_an_idle_reader_is_taken_back_without_registering_it_again():
    loop = Loop()
    counted = loop.selector = CountingSelector(loop.selector)  # type: ignore[assignment]
    r, w = os.pipe()
    called: list[str] = []
    try:
        loop.add_reader(r, lambda: called.append("read") or os.read(r, 10))
        callback = loop._keys[r].data
        loop.idle_reader(r)
        loop.resume_reader(r, callback)
        assert counted.calls == [("register", r)]
        os.write(w, b"x")
        loop.run_once(max_timeout=1)
        assert called == ["read"]
        # Another callback is not the idle one: it replaces it.
        loop.idle_reader(r)
        loop.resume_reader(r, lambda: called.append("other") or os.read(r, 10))
        assert counted.calls == [("register", r), ("unregister", r), ("register", r)]
        os.write(w, b"x")
        loop.run_once(max_timeout=1)
        assert called == ["read", "other"]
    finally:
        os.close(r)
        os.close(w)
        loop.close()


def test_an_idle_readers_number_taken_by_a_new_file_goes_to_its_new_reader():
    """The idle reader's file is closed (a connection another thread dropped) and its
    number given to a new file: adding a reader for it replaces the idle one, and only
    the owner's own reader is removed by ``remove_reader(fd, callback)``."""
    loop = Loop()
    r, w = os.pipe()
    stale = lambda: None  # noqa: E731
    loop.add_reader(r, stale)
    loop.idle_reader(r)
    os.close(r)
    os.close(w)
    r2, w2 = os.pipe()
    called: list[bytes] = []
    try:
        assert r2 == r                  # (the lowest free number, as the kernel gives)
        loop.add_reader(r2, lambda: called.append(os.read(r2, 10)))
        loop.remove_reader(r2, stale)   # the old owner lets go of what is not its own
        os.write(w2, b"x")
        loop.run_once(max_timeout=1)
        assert called == [b"x"]
        with pytest.raises(KeyError):   # a reader that is not idle is never replaced
            loop.add_reader(r2, stale)
    finally:
        os.close(r2)
        os.close(w2)
        loop.close()


def test_an_idle_readers_number_taken_by_a_pipe_to_write_goes_to_its_writer():
    """As a child's pipe that filled up is watched for room (``add_writer``)."""
    loop = Loop()
    r, w = os.pipe()
    loop.add_reader(r, lambda: None)
    loop.idle_reader(r)
    other_r, other_w = os.pipe()
    os.close(r)
    os.close(w)
    write_end = os.dup(other_w)         # the lowest free number: the idle reader's
    called: list[str] = []
    try:
        assert write_end == r
        loop.add_writer(write_end, lambda: called.append("room"))
        loop.run_once(max_timeout=1)
        assert called == ["room"]
    finally:
        for fd in (other_r, other_w, write_end):
            os.close(fd)
        loop.close()


# ---------------------------------------------------------------- a stream that breaks
def _reader_fed(data: bytes) -> tuple[FrameReader, int, int]:
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.write(w, data)
    return FrameReader(r), r, w


def test_a_payload_that_does_not_unpickle_ends_the_stream_with_a_corrupt_mark():
    good = Done(4242, 1, "succeeded")
    reader, r, w = _reader_fed(encode(good) + struct.pack("!I", 4) + b"junk")
    try:
        frames = reader.read()
        assert frames[0] == good
        assert isinstance(frames[1], Corrupt) and len(frames) == 2
        assert "unpickl" in frames[1].reason
        # Nothing after the break is trusted, not even a well-formed frame.
        os.write(w, encode(good))
        assert reader.read() == []
    finally:
        os.close(r)
        os.close(w)


def test_a_length_beyond_any_frame_is_corrupt_without_waiting_for_the_payload():
    reader, r, w = _reader_fed(struct.pack("!I", 0xFFFF_FFF0) + b"\x80\x05")
    try:
        [mark] = reader.read()
        assert isinstance(mark, Corrupt) and str(0xFFFF_FFF0) in mark.reason
    finally:
        os.close(r)
        os.close(w)


def test_two_writers_interleaving_their_frames_break_the_stream():
    first = encode(Done(4242, 1, "succeeded", "x" * 100))
    second = encode(Done(4343, 1, "succeeded", "y" * 100))
    reader, r, w = _reader_fed(first[:20] + second + first[20:])
    try:
        frames = reader.read()
        assert frames and isinstance(frames[-1], Corrupt)
        assert all(isinstance(f, Done) for f in frames[:-1])
    finally:
        os.close(r)
        os.close(w)


def test_frames_from_the_child_name_their_sender():
    assert Done(4242, 1, "succeeded").pid == 4242
    assert Claimed(4242, 1, "key", "owner").pid == 4242
    assert Hello(4242).pid == 4242


def test_a_wakeup_writes_once_per_batch_and_never_loses_one(monkeypatch):
    """Tier 1. One byte per batch of puts the reader has not taken; an item is never left
    in the queue with nothing in the pipe. The interleaving that once lost one: another
    thread puts while the reader empties the pipe (the reader cleared its flag first, so
    that put wrote a byte the reader then swallowed, and the next put wrote none)."""
    import select
    import threading

    from workhorse.broker import thread as brokerthread
    wakeup = brokerthread.Wakeup()
    for _ in range(3):
        wakeup.put(lambda: None)
    assert len(os.read(wakeup.read_fd, 100)) == 1
    wakeup.take()

    class PutWhileReading:
        hook = True

        def __getattr__(self, name: str) -> object:
            return getattr(os, name)

        def read(self, fd: int, size: int) -> bytes:
            if self.hook:
                self.hook = False
                wakeup.put(lambda: None)        # as the other thread would, just now
            return os.read(fd, size)
    wakeup.put(lambda: None)
    monkeypatch.setattr(brokerthread, "os", PutWhileReading())
    assert len(wakeup.take()) == 2
    monkeypatch.undo()
    wakeup.put(lambda: None)
    assert select.select([wakeup.read_fd], [], [], 0)[0], "a put after a take wakes again"
    assert len(wakeup.take()) == 1

    total, got = 20_000, 0

    def write() -> None:
        for n in range(total):
            wakeup.put(lambda: None)
            if n % 97 == 0:
                time.sleep(0)
    writer = threading.Thread(target=write)
    writer.start()
    deadline = time.monotonic() + 60
    while got < total:
        assert time.monotonic() < deadline
        ready = select.select([wakeup.read_fd], [], [], 2.0)[0]
        assert ready, f"{total - got} items waiting with no byte in the pipe"
        got += len(wakeup.take())
    writer.join()


def test_a_turns_acks_are_sent_even_when_its_fetch_finds_no_room():
    """The window filled between the loop asking for a fetch and the broker thread
    carrying it out: the acks still go (with a take of nothing). The consumer is told to
    take again only when there was room for more than one take and it was full; a take
    that found less than it asked for marks the queues dry (Redis then arms its waits)."""
    from workhorse.broker.drivers.base import TakingDriver
    calls: list[tuple[int, list[str]]] = []
    room = [0]
    queued = [1000]

    def take(limit: int, acks: list[str]) -> int:
        calls.append((limit, list(acks)))
        took = min(limit, queued[0])
        queued[0] -= took
        return took
    driver = TakingDriver(types.SimpleNamespace(), types.SimpleNamespace(  # type: ignore[arg-type]
        MAX_TAKE=64, take=take), lambda: room[0])
    assert driver.ack_and_take(["t1", "t2"]) is False and driver.dry   # (nothing known yet)
    room[0] = 3
    assert driver.ack_and_take(["t3"]) is False and not driver.dry     # the loop asks again
    room[0] = 100
    assert driver.ack_and_take([]) is True and not driver.dry          # 64 of 100: go on
    queued[0] = 5
    room[0] = 8
    assert driver.ack_and_take([]) is False and driver.dry
    assert calls == [(0, ["t1", "t2"]), (3, ["t3"]), (64, []), (8, [])]


def test_redis_waits_are_armed_only_once_a_take_found_the_lists_empty(monkeypatch):
    """Until a take finds the lists empty, the loop's fetches take (several at a time);
    a take or a wait armed on every turn with room took one or two messages a round
    trip. Once a take finds less than it asked for, the waits are armed."""
    from workhorse.broker.drivers import redis as redis_driver
    armed: list[str] = []

    class Waiter:
        def __init__(self, channel: object, key: str) -> None:
            self.key, self.sent_at = key, None

        def arm(self, timeout: int) -> None:      # as ListWaiter: once until answered
            if self.sent_at is None:
                armed.append(self.key)
                self.sent_at = 1.0
    monkeypatch.setattr(redis_driver, "ListWaiter", Waiter)
    queued = [10]
    takes: list[int] = []

    def take(limit: int, acks: object = ()) -> int:
        takes.append(limit)
        took = min(limit, queued[0])
        queued[0] -= took
        return took
    channel = types.SimpleNamespace(MAX_TAKE=64, take=take, active_queues=["q"],
                                    list_keys=lambda queues: list(queues))
    connection = types.SimpleNamespace(transport=types.SimpleNamespace(cycle=None))
    driver = redis_driver.RedisDriver(connection, channel, lambda: 4)  # type: ignore[arg-type]
    driver.dry = False
    driver.tick()
    assert takes == [] and armed == []          # the loop says when to fetch
    driver.ack_and_take([])
    driver.tick()
    assert takes == [4] and armed == []         # a full take: there may be more
    queued[0] = 1
    driver.ack_and_take([])
    driver.tick()
    assert takes == [4, 4] and armed == ["q"]   # the lists ran dry: wait on them
    driver.tick()
    assert armed == ["q"]                       # armed once




def _through_a_pipe(data: bytes) -> list[object]:
    r, w = os.pipe()
    try:
        os.write(w, data + encode(Stop()))
        stream = FrameStream(r)
        return [stream.read(), stream.read()]
    finally:
        os.close(r)
        os.close(w)


def test_a_job_crosses_marshalled_as_a_plain_tuple_and_arrives_as_a_job():
    """Jobs go as plain tuples through marshal (a named tuple's pickle costs a Python call,
    pickle itself more than marshal, for every task); the child's reader makes them Jobs
    again, whole and equal."""
    job = Job(7, "t.add", b"[[1, 2], {}, {}]", "application/json", "utf-8", {"id": "x"},
              {"routing_key": "q"}, True, "q", 3, False, "owner", 30.0, {"priority": 3},
              True, True, 1.5, 2.5)
    data = encode(job)
    assert data[4] != 0x80 and marshal.loads(data[4:]) == tuple(job)
    got, stop = _through_a_pipe(data)
    assert type(got) is Job and got == job and stop == Stop()


def test_a_job_holding_what_marshal_cannot_carry_is_pickled_and_arrives_whole():
    """kombu's JSON can decode a header into a datetime: marshal refuses it, pickle takes it."""
    when = datetime(2026, 11, 27, 12, 0, tzinfo=UTC)
    job = Job(8, "t.add", b"[[], {}, {}]", "application/json", "utf-8",
              {"id": "y", "eta": when}, {}, False)
    data = encode(job)
    assert data[4] == 0x80 and type(pickle.loads(data[4:])) is tuple
    got, _ = _through_a_pipe(data)
    assert type(got) is Job and got == job and got.headers["eta"] == when


def test_a_done_crosses_marshalled_and_other_frames_pickled():
    done = Done(4242, 9, "failed", "boom", 123, 0.5, None, "Traceback")
    hello = Hello(4242)
    data = encode(done) + encode(hello)
    assert data[4] != 0x80
    reader, r, w = _reader_fed(data)
    try:
        got = reader.read()
    finally:
        os.close(r)
        os.close(w)
    assert got == [done, hello] and type(got[0]) is Done and type(got[1]) is Hello


def test_a_marshalled_frame_that_is_not_a_done_is_corrupt():
    """A task's forked process could write anything on its parent's pipe."""
    payload = marshal.dumps((1, 2, 3))
    reader, r, w = _reader_fed(struct.pack("!I", len(payload)) + payload)
    try:
        [mark] = reader.read()
    finally:
        os.close(r)
        os.close(w)
    assert isinstance(mark, Corrupt) and "not a Done" in mark.reason


def test_the_loop_measures_how_long_it_was_away_past_what_it_meant():
    """A wait that returns STALL seconds or more past its timeout, or a turn that took
    that long (the process was frozen): ``away`` says how long, until taken."""
    from workhorse.daemon.loop import STALL
    now = [100.0]
    loop = Loop(clock=lambda: now[0])

    class Selector:
        def __init__(self, then: float) -> None:
            self.then = then

        def select(self, timeout: float | None) -> list:
            now[0] += self.then
            return []

    loop.selector = Selector(1.0)               # type: ignore[assignment]
    loop.wait(max_timeout=2.0)
    assert loop.away == 0.0                     # back within its timeout
    loop.selector = Selector(2.0 + STALL + 1)   # type: ignore[assignment]
    loop.wait(max_timeout=2.0)
    assert loop.away == pytest.approx(STALL + 1)
    now[0] += STALL + 3                         # a turn that long
    loop.selector = Selector(0.0)               # type: ignore[assignment]
    loop.wait(max_timeout=2.0)
    assert loop.took_away() == pytest.approx(STALL + 3)
    assert loop.took_away() == 0.0
    loop.wait(max_timeout=2.0)
    assert loop.away == 0.0


def test_a_suspend_the_monotonic_clock_does_not_see_counts_as_away():
    """The host suspended: ``monotonic`` (the timers' clock) stood still, the away clock
    (CLOCK_BOOTTIME in a worker) did not. Timers keep their clock."""
    from workhorse.daemon.loop import STALL
    monotonic, boot = [100.0], [500.0]
    loop = Loop(clock=lambda: monotonic[0], away_clock=lambda: boot[0])

    class Selector:
        def select(self, timeout: float | None) -> list:
            boot[0] += 1.0 + STALL + 30         # slept through a suspend
            return []

    fired: list[float] = []
    loop.call_later(1.0, lambda: fired.append(monotonic[0]))
    loop.selector = Selector()                  # type: ignore[assignment]
    loop.run_once(max_timeout=2.0)
    assert loop.away_for() == pytest.approx(STALL + 30)
    assert fired == []                          # not due by the timers' clock
    boot[0] += 0.5
    assert loop.took_away() == pytest.approx(STALL + 30) and loop.away_for() == 0.0


def test_the_worker_measures_being_away_by_clock_boottime():
    import time

    from workhorse.daemon.system import System
    before = time.clock_gettime(time.CLOCK_BOOTTIME)
    read = System().boottime()
    assert before <= read <= time.clock_gettime(time.CLOCK_BOOTTIME)
