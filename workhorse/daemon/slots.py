"""The prefork pool as the supervisor sees it: one ``Slot`` per place in the pool, holding
its current ``Child``, its crash and boot failure counts and its respawn timer.

``Slots`` spawns, reads, reaps, replaces and recycles children, and enforces each running
job's time limits from loop timers. What becomes of a job is the supervisor's business: it
is told through ``PoolEvents`` (a job done, a job whose child was lost), and so is a slot
whose children keep dying before they are ready (replacing them cannot help).
"""
from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..outcome import Outcome
from ..pool.child import Child, ChildState, ProcessHandle, describe_exit
from ..pool.ipc import Claimed, Corrupt, Done, Hello, Job
from ..pool.limits import SOFT_LIMIT_SIGNAL
from . import systemd
from .delivery import Delivery
from .system import RuntimeFactory

if TYPE_CHECKING:
    from .loop import Loop, Timer

log = logging.getLogger("workhorse.supervisor")

#: A spawn put off because another thread was mid-call is tried again this much later.
FORK_RETRY = 0.01
#: Consecutive crashes of a slot back off from this delay, doubling, up to the cap.
CRASH_BACKOFF_START = 0.1
CRASH_BACKOFF_MAX = 10.0
#: A child revoked with terminate that still runs its task this long after the signal is
#: SIGKILLed.
TERMINATE_GRACE = 5.0


class OS(Protocol):
    """What the pool needs of the operating system (``System``, or a fake in tests)."""

    def monotonic(self) -> float: ...
    def spawn(self, number: int, make_runtime: RuntimeFactory) -> ProcessHandle: ...
    def signal(self, pid: int, sig: int) -> None: ...
    def rss(self, pid: int) -> int | None: ...
    def exited(self) -> tuple[int, int] | None: ...
    def reap(self, pid: int) -> None: ...


class PoolEvents(Protocol):
    def job_done(self, delivery: Delivery, done: Done) -> None: ...
    def job_lost(self, delivery: Delivery, outcome: Outcome, detail: str) -> None: ...
    def children_cannot_boot(self, reason: str) -> None: ...


@dataclass(frozen=True)
class Recycling:
    """When a child is replaced after a task (none: never)."""

    max_tasks: int | None = None
    max_memory: int | None = None     # bytes of resident memory


def _always() -> AbstractContextManager[bool]:
    return nullcontext(True)


def crash_delay(failures: int) -> float:
    """The first crash is replaced at once; then from the start delay, doubling, capped."""
    if failures <= 1:
        return 0.0
    return min(CRASH_BACKOFF_START * 2 ** (failures - 2), CRASH_BACKOFF_MAX)


class Slot:
    def __init__(self, index: int) -> None:
        self.index = index
        self.child: Child | None = None
        self.crashes = 0                        # consecutive, reset by a finished job
        self.boot_failures = 0                  # consecutive children dead before Hello
        self.respawn_timer: Timer | None = None
        #: The pool generation its child was forked in: a reload starts a new one.
        self.generation = 0
        #: The pool is shrinking by this slot: its child is not replaced when it exits.
        self.retiring = False

    def cancel_respawn(self) -> None:
        if self.respawn_timer is not None:
            self.respawn_timer.cancel()
            self.respawn_timer = None


class Slots:
    def __init__(self, size: int, os: OS, loop: Loop, make_runtime: RuntimeFactory,
                 events: PoolEvents, recycling: Recycling,
                 accepting: Callable[[], bool], *, max_boot_failures: int,
                 may_fork: Callable[[], AbstractContextManager[bool]] = _always) -> None:
        self.os = os
        self.loop = loop
        self.make_runtime = make_runtime
        self.events = events
        self.recycling = recycling
        #: Is the worker taking work? If not, children are not replaced and idle ones stop.
        self.accepting = accepting
        #: True while a fork now is safe (no other thread mid-call): see BrokerThread.parked.
        self.may_fork = may_fork
        self.max_boot_failures = max_boot_failures
        self.slots: dict[int, Slot] = {index: Slot(index) for index in range(size)}
        #: Bumped by a reload: children forked before it are replaced by fresh ones.
        self.generation = 0
        #: Slots still to retire when the next busy children finish (pool shrinking).
        self.to_retire = 0
        #: Told why each child that is replaced ended (metrics), if set.
        self.on_child_exit: Callable[[str], None] | None = None

    # ------------------------------------------------------------------ views
    @property
    def size(self) -> int:
        """The pool's size once the slots being retired are gone."""
        return sum(1 for slot in self.slots.values() if not slot.retiring) - self.to_retire

    def children(self) -> Iterator[Child]:
        """The live children (not yet reaped)."""
        for slot in list(self.slots.values()):
            child = slot.child
            if child is not None and child.state is not ChildState.EXITED:
                yield child

    def idle(self) -> Iterator[Child]:
        for child in self.children():
            if child.state is ChildState.IDLE:
                yield child

    @property
    def running(self) -> int:
        return sum(1 for child in self.children() if child.busy)

    def all_exited(self) -> bool:
        return next(self.children(), None) is None

    # ------------------------------------------------------------------ life cycle
    def spawn_all(self) -> None:
        for slot in list(self.slots.values()):
            self.spawn(slot)

    def spawn(self, slot: Slot) -> None:
        slot.respawn_timer = None
        with self.may_fork() as ok:
            if ok:
                self._fork(slot)
                return
        # Another thread is mid-call (the broker thread): fork a moment later instead.
        slot.respawn_timer = self.loop.call_later(FORK_RETRY, lambda: self._respawn(slot))

    def _fork(self, slot: Slot) -> None:
        slot.generation = self.generation
        handle = self.os.spawn(slot.index + 1, self.make_runtime)
        child = Child(slot.index, handle, self.os.monotonic())
        slot.child = child
        self.loop.add_reader(handle.read_fd, lambda: self.on_readable(child))

    def on_readable(self, child: Child) -> None:
        for frame in child.receive():
            if isinstance(frame, Corrupt):
                why = f"it wrote frames that cannot be read ({frame.reason})"
                log.error("%s: %s; killing it", child.name, why)
                child.kill(Outcome.CHILD_LOST, why)
                break
            if isinstance(frame, Hello):
                child.on_hello()
            elif isinstance(frame, Claimed):
                if child.job is not None and child.job.seq == frame.seq:
                    child.job.claim = (frame.key, frame.owner)
            elif isinstance(frame, Done):
                self._on_done(child, frame)
        if child.handle.at_eof:
            # The process is exiting; SIGCHLD tells us when it is gone. Stop watching the
            # pipe, or EOF would keep the selector readable.
            self.loop.remove_reader(child.handle.read_fd)

    def _on_done(self, child: Child, done: Done) -> None:
        delivery: Delivery = child.on_done(done.rss)
        self._cancel_limits(child)
        self.slots[child.index].crashes = 0
        self.events.job_done(delivery, done)
        if child.kill_reason is Outcome.TERMINATED:
            # Its task finished although it was told to terminate (it handled the signal,
            # or ended first): its own result stands, and the child goes as it was told.
            log.warning("%s: finished although revoked with terminate; its result stands",
                        delivery.label)
            child.kill(None, "revoked with terminate")
        elif not child.handle.at_eof:     # else it is exiting already
            self.maybe_recycle(child)

    def reap(self) -> None:
        """SIGCHLD: reap every process that has exited. For a child, first kill what is left
        of its process group (a child killed from outside could not), while its zombie
        keeps the number from being reused; then settle its job and replace it. Anything
        else is an orphan of something a task started, adopted by the supervisor."""
        seen: set[int] = set()
        while (exited := self.os.exited()) is not None:
            pid, code = exited
            if pid in seen:         # not reaped after all: never spin in the loop
                log.warning("pid %d exited but could not be reaped", pid)
                return
            seen.add(pid)
            child = self._child(pid)
            if child is not None:
                child.handle.kill_group()
            self.os.reap(pid)
            if child is not None:
                self._on_exit(child, code)
            else:
                log.debug("reaped pid %d, not a child of the pool (an orphan of a task's "
                          "process?): %s", pid, describe_exit(code))

    def _child(self, pid: int) -> Child | None:
        return next((child for child in self.children() if child.pid == pid), None)

    def _on_exit(self, child: Child, code: int) -> None:
        if not child.handle.at_eof:
            self.on_readable(child)     # what it wrote before dying (Done, Claimed)
        killed = child.kill_detail is not None or child.kill_reason is not None
        expected = child.state is ChildState.STOPPING and not killed
        delivery = child.on_exit(code)
        self._cancel_limits(child)
        self.loop.remove_reader(child.handle.read_fd)
        how = describe_exit(code)
        if killed:
            why = child.kill_detail or "killed by the supervisor"
            how = f"killed by the supervisor: {why}"
        if delivery is not None:
            outcome = child.kill_reason or Outcome.CHILD_LOST
            log.error("%s %s while running %s", child.name, how, delivery.label)
            self.events.job_lost(delivery, outcome, child.kill_detail or f"child {how}")
        elif not expected:
            (log.info if killed else log.error)("%s %s", child.name, how)
        if self.accepting():
            if self.on_child_exit is not None:
                self.on_child_exit(getattr(child.kill_reason, "value", None) or (
                    "killed" if killed else "recycled" if expected else "crashed"))
            self._replace(child, crashed=not expected and not killed)

    def _replace(self, child: Child, crashed: bool) -> None:
        slot = self.slots.get(child.index)
        if slot is None or slot.child is not child:
            return
        if slot.retiring:
            del self.slots[slot.index]
            log.info("pool shrunk to %d children", self.size)
            return
        if child.booted:
            slot.boot_failures = 0
        elif crashed:
            slot.boot_failures += 1
            if slot.boot_failures >= self.max_boot_failures:
                self._give_up_booting(slot, child)
                return
        if not crashed:
            self.spawn(slot)
            return
        slot.crashes += 1
        delay = crash_delay(slot.crashes)
        if not delay:
            self.spawn(slot)
            return
        log.warning("child slot %d crashed %d times in a row; starting the next one in %.1f s",
                    slot.index + 1, slot.crashes, delay)
        systemd.notify(f"STATUS=child slot {slot.index + 1} crashing ({slot.crashes} in a row)")
        slot.respawn_timer = self.loop.call_later(delay, lambda: self._respawn(slot))

    def _give_up_booting(self, slot: Slot, child: Child) -> None:
        """The slot's children die in their setup, one after another: a new one would too.
        The slot stays empty and the supervisor is told."""
        last = describe_exit(child.exitcode) if child.exitcode is not None else "gone"
        self.events.children_cannot_boot(
            f"children die before they are ready ({slot.boot_failures} in a row; last: "
            f"{last}); see the log above for their error")

    def _respawn(self, slot: Slot) -> None:
        slot.respawn_timer = None
        if self.accepting():
            self.spawn(slot)

    # ------------------------------------------------------------------ reload, resize
    def renew(self) -> None:
        """After a reload: replace every child by one forked now, with the code and
        settings loaded now. Idle ones go at once, busy ones when their task is done."""
        self.generation += 1
        for child in list(self.idle()):
            self.maybe_recycle(child)
        for child in list(self.children()):
            if child.state is ChildState.SPAWNING:
                child.stop()

    def resize(self, size: int) -> None:
        """Grow or shrink the pool to ``size`` children. Shrinking retires idle children
        now, else the next ones to finish their task; running tasks are never cut short."""
        while self.size < size:
            if self.to_retire:
                self.to_retire -= 1
                continue
            index = next(i for i in range(len(self.slots) + 1) if i not in self.slots)
            self.slots[index] = Slot(index)
            self.spawn(self.slots[index])
        excess = self.size - size
        for slot in sorted(self.slots.values(), key=lambda s: _retire_order(s), reverse=True):
            if excess <= 0:
                break
            if slot.retiring or (slot.child is not None and slot.child.busy):
                continue
            self._retire(slot)
            excess -= 1
        self.to_retire += max(0, excess)

    def _retire(self, slot: Slot) -> None:
        slot.retiring = True
        slot.cancel_respawn()
        child = slot.child
        if child is None or child.state is ChildState.EXITED:
            del self.slots[slot.index]
            log.info("pool shrunk to %d children", self.size)
        elif child.state in (ChildState.IDLE, ChildState.SPAWNING):
            child.stop()

    def maybe_recycle(self, child: Child) -> None:
        """After a task, or while idle: replace a child past its limits or forked before a
        reload, retire it if the pool is shrinking, stop it if the worker is stopping."""
        slot = self.slots[child.index]
        if self.to_retire and not slot.retiring:
            self.to_retire -= 1
            self._retire(slot)
            return
        r = self.recycling
        reason = None
        if slot.generation != self.generation:
            reason = "reloaded"
        elif r.max_tasks and child.tasks_done >= r.max_tasks:
            reason = f"ran {child.tasks_done} tasks (max_tasks_per_child={r.max_tasks})"
        elif r.max_memory and child.rss > r.max_memory:
            reason = (f"uses {child.rss // 1024} KiB "
                      f"(max_memory_per_child={r.max_memory // 1024} KiB)")
        if reason:
            log.info("recycling %s: %s", child.name, reason)
        if reason or not self.accepting():
            child.stop()

    def check_idle_memory(self) -> None:
        """Recycle idle children over max_memory_per_child (a busy one is checked after its
        task: never mid-task)."""
        for child in list(self.idle()):
            rss = self.os.rss(child.pid)
            if rss is not None:
                child.rss = rss
                self.maybe_recycle(child)

    # ------------------------------------------------------------------ jobs
    def start(self, child: Child, delivery: Delivery, job: Job, hard: float | None,
              soft: float | None) -> bool:
        """Hand ``job`` to an idle child and arm its limits. False: the child is gone
        (it is killed and replaced; the job never started)."""
        now = self.os.monotonic()
        try:
            child.assign(delivery, job, now)
        except OSError as exc:
            log.warning("%s cannot take a job (%s); replacing it", child.name, exc)
            child.kill(None, f"its pipe failed ({exc})")
            return False
        if soft:
            child.timers.append(self.loop.call_at(
                now + soft, lambda: self._soft_limit(child, delivery, soft)))
        if hard:
            child.timers.append(self.loop.call_at(
                now + hard, lambda: self._hard_limit(child, delivery, hard)))
        return True

    def _soft_limit(self, child: Child, delivery: Delivery, seconds: float) -> None:
        if child.job is not delivery:
            return
        log.warning("%s: soft time limit (%g s) exceeded; SoftTimeLimitExceeded raised in the "
                    "task", delivery.label, seconds)
        self.os.signal(child.pid, SOFT_LIMIT_SIGNAL)

    def _hard_limit(self, child: Child, delivery: Delivery, seconds: float) -> None:
        if child.job is not delivery:
            return
        why = f"hard time limit ({seconds:g} s) exceeded"
        log.error("%s: %s; killing %s and what it started", delivery.label, why, child.name)
        child.kill(Outcome.TIME_LIMIT, why)

    def terminate(self, delivery: Delivery, sig: int) -> bool:
        """Revoked with terminate: send ``sig`` to the child running ``delivery`` and
        everything it started; if it still runs that job ``TERMINATE_GRACE`` s later,
        SIGKILL. Its job is settled as TERMINATED (REVOKED, never run again). False: no
        child runs it (it finished meanwhile)."""
        child = next((c for c in self.children() if c.busy and c.job is delivery), None)
        if child is None:
            return False
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        detail = f"revoked with terminate ({name})"
        log.warning("%s: %s; signalling %s and what it started", delivery.label, detail,
                    child.name)
        child.terminate(Outcome.TERMINATED, detail, sig)
        if sig != signal.SIGKILL:
            def still_running() -> None:
                if child.job is delivery:
                    log.error("%s: still running %.0f s after %s; killing %s",
                              delivery.label, TERMINATE_GRACE, name, child.name)
                    child.kill(Outcome.TERMINATED, detail)
            child.timers.append(self.loop.call_later(TERMINATE_GRACE, still_running))
        return True

    @staticmethod
    def _cancel_limits(child: Child) -> None:
        for timer in child.timers:
            timer.cancel()
        child.timers.clear()

    # ------------------------------------------------------------------ stopping
    def stop_idle(self) -> None:
        """Warm shutdown: no replacements; idle (and starting) children exit now."""
        for slot in self.slots.values():
            slot.cancel_respawn()
        for child in list(self.children()):
            if child.state in (ChildState.IDLE, ChildState.SPAWNING):
                child.stop()

    def kill_all(self, why: str) -> None:
        """Cold shutdown: kill every child; running jobs are settled as killed by it."""
        for child in list(self.children()):
            child.kill(Outcome.SHUTDOWN_KILLED if child.busy else None, why)

    def kill_now(self) -> None:
        """The supervisor is failing: kill every child and what it started, at once."""
        for child in self.children():
            child.handle.kill_tree()

    def describe(self) -> Iterator[str]:
        """One line per child, for the USR1 state dump."""
        now = self.os.monotonic()
        for child in self.children():
            job: Any = child.job
            running = (f"{job.label} for {now - child.job_started_at:.1f} s" if job
                       else "-")
            yield (f"{child!r} up {now - child.spawned_at:.0f} s, tasks_done="
                   f"{child.tasks_done}, job={running}")


def _retire_order(slot: Slot) -> tuple[bool, int]:
    """Retire slots with no live child first, then the highest numbered."""
    alive = slot.child is not None and slot.child.state is not ChildState.EXITED
    return (not alive, slot.index)
