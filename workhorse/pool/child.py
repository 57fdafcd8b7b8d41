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


class Child:
    def __init__(self, index: int, handle: ProcessHandle, spawned_at: float) -> None:
        self.index = index
        self.handle = handle
        self.pid = handle.pid
        self.spawned_at = spawned_at
        self.state = ChildState.SPAWNING
        self.booted = False                  # said Hello: it got through its setup
        self.job: Any = None                 # the Delivery it runs, while BUSY
        self.job_seq: int | None = None      # and that job's seq
        self.job_started_at = 0.0
        self.timers: list[Any] = []          # the running job's limit timers
        self.tasks_done = 0
        self.rss = 0
        self.kill_reason: Any = None         # why the supervisor killed it (an Outcome)
        self.kill_detail: str | None = None  # ... in words: "hard time limit (4 s) exceeded"
        self.exitcode: int | None = None

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
        if isinstance(frame, (Claimed, Done)) and (
                self.state is not ChildState.BUSY or frame.seq != self.job_seq):
            running = f"job {self.job_seq}" if self.state is ChildState.BUSY else "no job"
            return f"about job {frame.seq} while it runs {running}"
        return None

    # -- transitions
    def on_hello(self) -> None:
        """The child is set up. One told to stop while starting stays stopping."""
        self._expect(ChildState.SPAWNING, ChildState.STOPPING)
        self.booted = True
        if self.state is ChildState.SPAWNING:
            self.state = ChildState.IDLE

    def assign(self, job: Any, frame: Job, now: float) -> None:
        self._expect(ChildState.IDLE)
        self.handle.send(frame)
        self.state = ChildState.BUSY
        self.job = job
        self.job_seq = frame.seq
        self.job_started_at = now

    def on_done(self, rss: int) -> Any:
        """The job finished; return it (its limit timers are the caller's to cancel)."""
        self._expect(ChildState.BUSY)
        job, self.job, self.job_seq = self.job, None, None
        self.state = ChildState.IDLE
        self.tasks_done += 1
        self.rss = rss
        return job

    def stop(self) -> None:
        """Ask an idle (or still starting) child to exit."""
        self._expect(ChildState.IDLE, ChildState.SPAWNING)
        self.state = ChildState.STOPPING
        try:
            self.handle.send(Stop())
        except BrokenPipeError:
            pass    # it has exited already, not yet reaped: SIGCHLD tells the supervisor

    def kill(self, reason: Any, detail: str | None = None) -> None:
        """SIGKILL the child and everything it started; its job is settled on exit. The
        first reason given is the one reported."""
        self._expect(ChildState.SPAWNING, ChildState.IDLE, ChildState.BUSY, ChildState.STOPPING)
        if self.kill_reason is None and self.kill_detail is None:
            self.kill_reason = reason
            self.kill_detail = detail
        self.handle.kill_tree()
        if self.state is not ChildState.BUSY:
            self.state = ChildState.STOPPING

    def terminate(self, reason: Any, detail: str, sig: int) -> None:
        """Send ``sig`` to the busy child and everything it started (a revoke with
        terminate); if it dies of it, its job is settled as ``reason``. One that survives
        it is killed once its job is over, or sooner: see ``Slots.terminate``."""
        self._expect(ChildState.BUSY)
        if self.kill_reason is None and self.kill_detail is None:
            self.kill_reason = reason
            self.kill_detail = detail
        self.handle.kill_tree(sig)

    def on_exit(self, code: int) -> Any:
        """The process is gone; return the job it held, if any."""
        self._expect(ChildState.SPAWNING, ChildState.IDLE, ChildState.BUSY, ChildState.STOPPING)
        job, self.job, self.job_seq = self.job, None, None
        self.state = ChildState.EXITED
        self.exitcode = code
        self.handle.close()
        return job

    @property
    def busy(self) -> bool:
        return self.state is ChildState.BUSY

    @property
    def name(self) -> str:
        """How logs name it: slots count from 1, as the children's process titles do."""
        return f"child {self.index + 1} (pid {self.pid})"

    def __repr__(self) -> str:
        return f"<{self.name} {self.state.value}>"
