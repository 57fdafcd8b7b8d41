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
from ..pool.child import (EXITED, IDLE, SPAWNING, STOPPING, Child, ProcessHandle, Running,
                          describe_exit)
from ..pool.ipc import Cancel, Claimed, Corrupt, Done, Hello, Job
from ..pool.limits import SOFT_LIMIT_SIGNAL
from . import systemd
from .delivery import Delivery
from .system import RuntimeFactory

if TYPE_CHECKING:
    from .loop import Loop, Timer

_TERMINATED = Outcome.TERMINATED      # (read for every job: see workhorse/outcome.py)

log = logging.getLogger("workhorse.supervisor")

#: A spawn put off because another thread was mid-call is tried again this much later.
FORK_RETRY = 0.01
#: Consecutive crashes of a slot back off from this delay, doubling, up to the cap.
CRASH_BACKOFF_START = 0.1
CRASH_BACKOFF_MAX = 10.0
#: A child revoked with terminate that still runs its task this long after the signal is
#: SIGKILLed.
TERMINATE_GRACE = 5.0
#: An async job its child has not ended this long after its hard limit (when the child
#: cancelled it) gets its child killed.
ASYNC_GRACE = 0.5
#: How often the event loops of children running async tasks are looked at.
BLOCK_CHECK = 0.25
#: A loop that has not beaten for this long is held by the code running on it.
STALL = 0.3


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
        #: A child's event loop that does not turn for this long gets it killed.
        self.loop_block_limit = 10.0

    # ------------------------------------------------------------------ views
    @property
    def size(self) -> int:
        """The pool's size once the slots being retired are gone."""
        return sum(1 for slot in self.slots.values() if not slot.retiring) - self.to_retire

    def children(self) -> Iterator[Child]:
        """The live children (not yet reaped)."""
        for slot in list(self.slots.values()):
            child = slot.child
            if child is not None and child.state is not EXITED:
                yield child

    def idle(self) -> list[Child]:
        """The live children with nothing to run (every turn's dispatch asks: a list made
        in one pass, not a generator of a generator)."""
        return [slot.child for slot in self.slots.values()
                if slot.child is not None and slot.child.state is IDLE]

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
        forked: Any = handle
        if hasattr(forked, "on_pending"):      # (a real child's: see ForkedProcess.send)
            forked.on_pending = lambda: self.loop.add_writer(forked.write_fd,
                                                             lambda: self._flush(child))

    def spent(self, child: Child) -> bool:
        """Has it been given max_tasks_per_child tasks? (It takes no more, async or not.)"""
        limit = self.recycling.max_tasks
        return limit is not None and child.tasks_started >= limit

    def _flush(self, child: Child) -> None:
        """The child's pipe takes more: write what waits for it."""
        handle: Any = child.handle
        if handle.flush():
            self.loop.remove_writer(handle.write_fd)

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
                claimed = child.jobs.get(frame.seq)
                if claimed is not None:
                    claimed.delivery.claim = (frame.key, frame.owner)
            elif isinstance(frame, Done):
                self._on_done(child, frame)
        if child.handle.at_eof:
            # The process is exiting; SIGCHLD tells us when it is gone. Stop watching the
            # pipe, or EOF would keep the selector readable.
            self.loop.remove_reader(child.handle.read_fd)

    def _on_done(self, child: Child, done: Done) -> None:
        running = child.on_done(done.seq, done.rss)
        running.cancel_timers()
        self.slots[child.index].crashes = 0
        self.events.job_done(running.delivery, done)
        delivery: Delivery = running.delivery
        if child.kill_reason is _TERMINATED:
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
        expected = child.state is STOPPING and not killed
        # Whose code ran as it died, where it ran async jobs (read before the handle,
        # and with it the heart, is closed).
        heart = getattr(child.handle, "heart", None)
        at_death = heart.read()[1] if heart is not None and child.asynchronous else 0
        jobs = child.on_exit(code)
        for running in jobs:
            running.cancel_timers()
        self.loop.remove_reader(child.handle.read_fd)
        write_fd = getattr(child.handle, "write_fd", None)
        if write_fd is not None:
            self.loop.remove_writer(write_fd)
        how = describe_exit(code)
        if killed:
            why = child.kill_detail or "killed by the supervisor"
            how = f"killed by the supervisor: {why}"
        if jobs:
            self._lost(child, jobs, how, killed, at_death)
        elif not expected:
            (log.info if killed else log.error)("%s %s", child.name, how)
        if self.accepting():
            if self.on_child_exit is not None:
                self.on_child_exit(getattr(child.kill_reason, "value", None) or (
                    "killed" if killed else "recycled" if expected else "crashed"))
            self._replace(child, crashed=not expected and not killed)

    def _lost(self, child: Child, jobs: list[Running], how: str, killed: bool,
              at_death: int) -> None:
        """Settle the jobs of a child that died. Where it ran several, the one it was
        killed for, else the one whose code ran as it died, is charged; the others did
        nothing wrong and go back as held losses. Where none can be named, all are
        charged (a cold shutdown's kill charges none)."""
        outcome = child.kill_reason or Outcome.CHILD_LOST
        detail = child.kill_detail or f"child {how}"
        seqs = {running.seq for running in jobs}
        culprit = child.culprit if killed else (at_death if at_death in seqs else None)
        named = next((r.delivery.label for r in jobs if r.seq == culprit), None)
        if len(jobs) > 1:
            log.error("%s %s while running %d tasks%s", child.name, how, len(jobs),
                      f"; {named} is charged, the others go back" if named else "")
        for running in jobs:
            delivery = running.delivery
            if culprit is None or running.seq == culprit or outcome is Outcome.SHUTDOWN_KILLED:
                if len(jobs) == 1:
                    log.error("%s %s while running %s", child.name, how, delivery.label)
                self.events.job_lost(delivery, outcome, detail)
            else:
                self.events.job_lost(delivery, Outcome.SIBLING_LOST,
                                     f"{child.name} was lost ({how}) while it ran this task "
                                     f"beside {named or 'another'}")

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
            if child.state is SPAWNING:
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
        if child is None or child.state is EXITED:
            del self.slots[slot.index]
            log.info("pool shrunk to %d children", self.size)
        elif child.state in (IDLE, SPAWNING):
            child.stop()

    def maybe_recycle(self, child: Child) -> None:
        """After a task, or while idle: replace a child past its limits or forked before a
        reload, retire it if the pool is shrinking, stop it if the worker is stopping. One
        still running async tasks is only given no more (``draining``), and goes when they
        are over."""
        slot = self.slots[child.index]
        if self.to_retire and not slot.retiring:
            self.to_retire -= 1
            self._retire(slot)
            if child.jobs:
                child.draining = True
            return
        if slot.retiring and not child.jobs:
            child.stop()
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
        if child.jobs:
            if (reason or not self.accepting()) and not child.draining:
                log.info("recycling %s once its %d async tasks are over: %s", child.name,
                         len(child.jobs), reason or "stopping")
                child.draining = True
            return
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
        """Hand ``job`` to a child and arm its limits. False: the child is gone (it is
        killed and replaced; the job never started). An async job's limits are the
        child's to enforce; the supervisor kills the child only if it has not ended the
        job ``ASYNC_GRACE`` s after its hard limit."""
        now = self.os.monotonic()
        try:
            running = child.assign(delivery, job, now)
        except OSError as exc:
            log.warning("%s cannot take a job (%s); replacing it", child.name, exc)
            child.kill(None, f"its pipe failed ({exc})")
            return False
        if job.asynchronous:
            if hard:
                running.timers.append(self.loop.call_at(
                    now + hard + ASYNC_GRACE, lambda: self._async_overdue(child, running,
                                                                         hard)))
            return True
        if soft:
            running.timers.append(self.loop.call_at(
                now + soft, lambda: self._soft_limit(child, running, soft)))
        if hard:
            running.timers.append(self.loop.call_at(
                now + hard, lambda: self._hard_limit(child, running, hard)))
        return True

    def _soft_limit(self, child: Child, running: Running, seconds: float) -> None:
        if child.jobs.get(running.seq) is not running:
            return
        log.warning("%s: soft time limit (%g s) exceeded; SoftTimeLimitExceeded raised in the "
                    "task", running.delivery.label, seconds)
        self.os.signal(child.pid, SOFT_LIMIT_SIGNAL)

    def _hard_limit(self, child: Child, running: Running, seconds: float) -> None:
        if child.jobs.get(running.seq) is not running:
            return
        why = f"hard time limit ({seconds:g} s) exceeded"
        log.error("%s: %s; killing %s and what it started", running.delivery.label, why,
                  child.name)
        child.kill(Outcome.TIME_LIMIT, why)

    def _async_overdue(self, child: Child, running: Running, seconds: float) -> None:
        """An async job still running ``ASYNC_GRACE`` s past its hard limit: its child did
        not end it. If another job's code holds the loop, that one is killed for; else
        this one (it swallows its cancellation, or blocks the loop itself)."""
        if child.jobs.get(running.seq) is not running:
            return
        blocker = self._blocker(child)
        if blocker is not None and blocker is not running and self._stalled(child):
            self._kill_blocked(child, blocker, f"its event loop was held by "
                               f"{blocker.delivery.label} while {running.delivery.label} "
                               "passed its hard time limit")
            return
        why = (f"hard time limit ({seconds:g} s) exceeded, and still running "
               f"{ASYNC_GRACE:g} s after it was cancelled")
        log.error("%s: %s; killing %s, its %d other async tasks go back to their queues",
                  running.delivery.label, why, child.name, len(child.jobs) - 1)
        child.kill(Outcome.TIME_LIMIT, why, culprit=running.seq)

    def check_loops(self) -> None:
        """Every BLOCK_CHECK s: kill a child running async tasks whose event loop has not
        turned for ``loop_block_limit`` s; the job whose code holds it is charged."""
        now = self.os.monotonic()
        for child in list(self.children()):
            if not (child.busy and child.asynchronous):
                continue
            heart = getattr(child.handle, "heart", None)
            if heart is None:
                continue
            beats = heart.read()[0]
            if beats != child.beats[0]:
                child.beats = (beats, now)
            elif now - child.beats[1] > self.loop_block_limit:
                blocker = self._blocker(child)
                self._kill_blocked(child, blocker, f"its event loop did not turn for "
                                   f"{now - child.beats[1]:.1f} s (loop_block_limit "
                                   f"{self.loop_block_limit:g} s)")

    def _stalled(self, child: Child) -> bool:
        """Has the child's loop not turned since the last check, or for a few beats?"""
        heart = getattr(child.handle, "heart", None)
        if heart is None:
            return False
        beats = heart.read()[0]
        now = self.os.monotonic()
        if beats != child.beats[0]:
            child.beats = (beats, now)
            return False
        return now - child.beats[1] >= STALL

    @staticmethod
    def _blocker(child: Child) -> Running | None:
        """The job whose code runs on the child's loop now (its heart says), if any."""
        heart = getattr(child.handle, "heart", None)
        seq = heart.read()[1] if heart is not None else 0
        return child.jobs.get(seq) if seq else None

    def _kill_blocked(self, child: Child, blocker: Running | None, why: str) -> None:
        if blocker is None:
            log.error("%s: %s, and no task's code was running on it; killing it, its %d "
                      "tasks are each charged a delivery", child.name, why, len(child.jobs))
            child.kill(Outcome.CHILD_LOST, why)
            return
        detail = f"it blocked the event loop of {child.name}: {why}"
        log.error("%s: %s; killing the child, its %d other async tasks go back to their "
                  "queues", blocker.delivery.label, detail, len(child.jobs) - 1)
        child.kill(Outcome.CHILD_LOST, detail, culprit=blocker.seq)

    def terminate(self, delivery: Delivery, sig: int) -> bool:
        """Revoked with terminate: send ``sig`` to the child running ``delivery`` and
        everything it started; if it still runs that job ``TERMINATE_GRACE`` s later,
        SIGKILL. Its job is settled as TERMINATED (REVOKED, never run again). An async
        job is cancelled by its child instead (its siblings run on); its child is killed
        only if the job has not ended ``TERMINATE_GRACE`` s later. False: no child runs it
        (it finished meanwhile)."""
        found = next(((c, r) for c in self.children() if c.busy
                      and (r := c.running(delivery)) is not None), None)
        if found is None:
            return False
        child, running = found
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        detail = f"revoked with terminate ({name})"
        if child.asynchronous:
            log.warning("%s: %s; cancelled in %s", delivery.label, detail, child.name)
            try:
                child.handle.send(Cancel(running.seq, Outcome.TERMINATED.value, detail))
            except OSError:
                pass        # it is exiting: its exit settles the job

            def not_ended() -> None:
                if child.jobs.get(running.seq) is running:
                    log.error("%s: still running %.0f s after it was cancelled; killing %s",
                              delivery.label, TERMINATE_GRACE, child.name)
                    child.kill(Outcome.TERMINATED, detail, culprit=running.seq)
            running.timers.append(self.loop.call_later(TERMINATE_GRACE, not_ended))
            return True
        log.warning("%s: %s; signalling %s and what it started", delivery.label, detail,
                    child.name)
        child.terminate(Outcome.TERMINATED, detail, sig)
        if sig != signal.SIGKILL:
            def still_running() -> None:
                if child.jobs.get(running.seq) is running:
                    log.error("%s: still running %.0f s after %s; killing %s",
                              delivery.label, TERMINATE_GRACE, name, child.name)
                    child.kill(Outcome.TERMINATED, detail)
            running.timers.append(self.loop.call_later(TERMINATE_GRACE, still_running))
        return True

    # ------------------------------------------------------------------ stopping
    def stop_idle(self) -> None:
        """Warm shutdown: no replacements; idle (and starting) children exit now."""
        for slot in self.slots.values():
            slot.cancel_respawn()
        for child in list(self.children()):
            if child.state in (IDLE, SPAWNING):
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
            jobs = ", ".join(f"{r.delivery.label} for {now - r.started_at:.1f} s"
                             for r in child.jobs.values()) or "-"
            yield (f"{child!r} up {now - child.spawned_at:.0f} s, tasks_done="
                   f"{child.tasks_done}, {'async jobs' if child.asynchronous else 'job'}="
                   f"{jobs}")


def _retire_order(slot: Slot) -> tuple[bool, int]:
    """Retire slots with no live child first, then the highest numbered."""
    alive = slot.child is not None and slot.child.state is not EXITED
    return (not alive, slot.index)
