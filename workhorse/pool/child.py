"""One child process as the supervisor sees it: an explicit state machine.

    SPAWNING --hello--> IDLE --assign--> BUSY --done--> IDLE
    SPAWNING/IDLE --stop--> STOPPING;  any --kill--> STOPPING;  any --exit--> EXITED

The class does no I/O of its own: it talks to the process through a ``ProcessHandle``,
so the transitions are tested with a fake handle and no fork.
"""
from __future__ import annotations

import enum
import logging
import signal
from typing import Any, Protocol

from .ipc import Claimed, Corrupt, Done, Job, Stop

log = logging.getLogger("workhorse.supervisor")


class ChildState(str, enum.Enum):
    SPAWNING = "spawning"
    IDLE = "idle"
    BUSY = "busy"
    STOPPING = "stopping"
    EXITED = "exited"


# The states as module names too, read for every job (see workhorse/outcome.py).
SPAWNING, IDLE, BUSY, STOPPING, EXITED = (ChildState.SPAWNING, ChildState.IDLE,
                                          ChildState.BUSY, ChildState.STOPPING,
                                          ChildState.EXITED)


class InvalidTransition(RuntimeError):
    pass


class ProcessHandle(Protocol):
    pid: int
    read_fd: int

    def send(self, frame: object) -> None: ...
    def receive(self) -> list[object]: ...
    @property
    def at_eof(self) -> bool: ...
    def kill_tree(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (SIGKILL) to the process and everything it started."""
    def kill_group(self) -> None:
        """SIGKILL what is left of its process group once it has exited, not yet reaped."""
    def close(self) -> None: ...


#: Why a child may have died, for the log line an operator reads.
_SIGNAL_HINTS = {
    signal.SIGKILL: ("out of memory? (the kernel's OOM killer sends SIGKILL) or killed by an "
                     "operator"),
    signal.SIGSEGV: "a crash in C code (an extension module?)",
    signal.SIGBUS: "a crash in C code (an extension module, or a truncated mmap?)",
    signal.SIGABRT: "an abort() in C code (a failed assertion in an extension?)",
    signal.SIGTERM: "terminated by another process",
}


def describe_exit(code: int) -> str:
    """``-9`` → "killed by SIGKILL (out of memory? …)"; ``3`` → "exited with status 3"."""
    if code < 0:
        try:
            sig = signal.Signals(-code)
        except ValueError:
            return f"killed by signal {-code}"
        hint = _SIGNAL_HINTS.get(sig)
        return f"killed by {sig.name}" + (f" ({hint})" if hint else "")
    return f"exited with status {code}"


class Running:
    """One job a child runs: its delivery, when it started, its limit timers."""

    __slots__ = ("delivery", "seq", "started_at", "timers")

    def __init__(self, delivery: Any, seq: int, started_at: float) -> None:
        self.delivery = delivery
        self.seq = seq
        self.started_at = started_at
        self.timers: list[Any] = []

    def cancel_timers(self) -> None:
        for timer in self.timers:
            timer.cancel()
        self.timers.clear()


class Child:
    """A child runs one sync job, or up to its async_concurrency async ones (``asynchronous``
    while it does); it is BUSY while it runs any."""

    def __init__(self, index: int, handle: ProcessHandle, spawned_at: float) -> None:
        self.index = index
        self.handle = handle
        self.pid = handle.pid
        self.spawned_at = spawned_at
        self.state = SPAWNING
        self.booted = False                  # said Hello: it got through its setup
        self.jobs: dict[int, Running] = {}   # by seq, while BUSY
        self.asynchronous = False            # its jobs are async ones (while BUSY)
        #: Given no new async job: it is replaced (or retired) once its jobs are over.
        self.draining = False
        #: Given no new async job: a sync task waits for it to be idle (``Dispatch``).
        self.reserved = False
        self.tasks_done = 0
        self.tasks_started = 0
        self.rss = 0
        self.kill_reason: Any = None         # why the supervisor killed it (an Outcome)
        self.kill_detail: str | None = None  # ... in words: "hard time limit (4 s) exceeded"
        #: The job the supervisor killed it for, where it ran several: the others did
        #: nothing wrong.
        self.culprit: int | None = None
        self.exitcode: int | None = None
        #: The heartbeat last read (beats, supervisor's time it moved): see Slots.
        self.beats: tuple[int, float] = (0, spawned_at)

    @property
    def job(self) -> Any:
        """The delivery of its one job (a sync one, or the first async), or None."""
        return next(iter(self.jobs.values())).delivery if self.jobs else None

    def running(self, delivery: Any) -> Running | None:
        """Its record of ``delivery``, if it runs it."""
        for running in self.jobs.values():
            if running.delivery is delivery:
                return running
        return None

    def _expect(self, *states: ChildState) -> None:
        if self.state not in states:
            raise InvalidTransition(
                f"{self.name} is {self.state.value}, "
                f"expected {' or '.join(s.value for s in states)}")

    # -- what the process wrote
    def receive(self) -> list[object]:
        """The frames the child wrote about what it does now, in order; a ``Corrupt`` mark
        comes last. Anything else (from a process the task forked, about a job that is
        over, or no frame at all) is logged and dropped: acting on it would settle a job
        twice or settle the wrong one."""
        frames = []
        for frame in self.handle.receive():
            stray = self._stray(frame)
            if stray is None:
                frames.append(frame)
            else:
                log.warning("%s: ignored a %s frame %s", self.name, type(frame).__name__,
                            stray)
        return frames

    def _stray(self, frame: object) -> str | None:
        """Why ``frame`` is not the child's word on its current state, or None."""
        if isinstance(frame, Corrupt):
            return None
        sender = getattr(frame, "pid", None)
        if sender != self.pid:
            return (f"from pid {sender}, not the child (a process its task forked?)"
                    if isinstance(sender, int) else "that is not a frame")
        if isinstance(frame, (Claimed, Done)) and frame.seq not in self.jobs:
            running = (f"jobs {', '.join(map(str, self.jobs))}" if self.jobs else "no job")
            return f"about job {frame.seq} while it runs {running}"
        return None

    # -- transitions
    def on_hello(self) -> None:
        """The child is set up. One told to stop while starting stays stopping."""
        self._expect(SPAWNING, STOPPING)
        self.booted = True
        if self.state is SPAWNING:
            self.state = IDLE

    def takes_async(self, limit: int) -> bool:
        """May it be given one more async job, with ``limit`` of them at once?"""
        if self.state is IDLE:
            return True
        return (self.state is BUSY and self.asynchronous and not self.draining
                and not self.reserved and len(self.jobs) < limit)

    def assign(self, job: Any, frame: Job, now: float) -> Running:
        """Hand it a job: a sync one when it is idle, an async one when it is idle or runs
        async ones."""
        idle = self.state is IDLE
        if not idle and not (frame.asynchronous and self.asynchronous
                             and self.state is BUSY):
            self._expect(IDLE)
        self.handle.send(frame)
        if idle:
            self.state = BUSY
            self.asynchronous = frame.asynchronous
            if frame.asynchronous:
                self.beats = (self.beats[0], now)    # a loop that starts now: not blocked
        running = self.jobs[frame.seq] = Running(job, frame.seq, now)
        self.tasks_started += 1
        return running

    def on_done(self, seq: int, rss: int) -> Running:
        """Job ``seq`` finished; return its record (its limit timers are the caller's to
        cancel)."""
        self._expect(BUSY)
        running = self.jobs.pop(seq)
        if not self.jobs:
            self.state = IDLE
            self.asynchronous = False
        self.tasks_done += 1
        self.rss = rss
        return running
    def stop(self) -> None:
        """Ask an idle (or still starting) child to exit."""
        self._expect(IDLE, SPAWNING)
        self.state = STOPPING
        try:
            self.handle.send(Stop())
        except BrokenPipeError:
            pass    # it has exited already, not yet reaped: SIGCHLD tells the supervisor

    def kill(self, reason: Any, detail: str | None = None, culprit: int | None = None
             ) -> None:
        """SIGKILL the child and everything it started; its jobs are settled on exit. The
        first reason given is the one reported; ``culprit``: the job it is killed for,
        where it runs several."""
        self._expect(SPAWNING, IDLE, BUSY, STOPPING)
        if self.kill_reason is None and self.kill_detail is None:
            self.kill_reason = reason
            self.kill_detail = detail
            self.culprit = culprit
        self.handle.kill_tree()
        if self.state is not BUSY:
            self.state = STOPPING

    def terminate(self, reason: Any, detail: str, sig: int) -> None:
        """Send ``sig`` to the busy child and everything it started (a revoke with
        terminate); if it dies of it, its job is settled as ``reason``. One that survives
        it is killed once its job is over, or sooner: see ``Slots.terminate``."""
        self._expect(BUSY)
        if self.kill_reason is None and self.kill_detail is None:
            self.kill_reason = reason
            self.kill_detail = detail
        self.handle.kill_tree(sig)

    def on_exit(self, code: int) -> list[Running]:
        """The process is gone; return the jobs it held, in the order they started."""
        self._expect(SPAWNING, IDLE, BUSY, STOPPING)
        jobs, self.jobs = list(self.jobs.values()), {}
        self.state = EXITED
        self.exitcode = code
        self.handle.close()
        return jobs

    @property
    def busy(self) -> bool:
        return self.state is BUSY

    @property
    def name(self) -> str:
        """How logs name it: slots count from 1, as the children's process titles do."""
        return f"child {self.index + 1} (pid {self.pid})"

    def __repr__(self) -> str:
        return f"<{self.name} {self.state.value}>"
