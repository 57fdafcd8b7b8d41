"""Async tasks in a child: one event loop, many tasks, each under its own limits.

A child that is given an ``async def`` task runs an event loop (``AsyncSession``) until it
has no async task left; the supervisor gives it more meanwhile, up to its
``async_concurrency``, and never a sync task. Each job is an asyncio task of its own, so
its ``self.request`` (a context variable) is its own.

Every step of a job's code (the coroutine, and the asyncio tasks it creates) runs through
``_Stepped``, which

- names the job in the child's ``Heart`` while its code runs, so the supervisor can tell
  which job blocks the loop or was running when the child died;
- turns the cancellation that carries a soft time limit into ``SoftTimeLimitExceeded``,
  raised at the await where the code waits, which it may catch;
- ends a process the task forked that comes back to the loop: it would run the other
  jobs' code a second time.

Limits are enforced here, from the loop: the soft limit raises, the hard limit cancels the
job. A job that does not end within a grace after its hard limit (the loop is blocked, or
the code swallows the cancellation) is the supervisor's to end: it kills the child.
"""
from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import os
from collections import deque
from collections.abc import Coroutine, Generator
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from ..exceptions import SoftTimeLimitExceeded
from ..outcome import Outcome
from .execute import Finished, Interrupted, TaskExecution
from .heart import BEAT_INTERVAL, Heart
from .ipc import Cancel, Job, Stop

if TYPE_CHECKING:
    from .runtime import ChildRuntime

log = logging.getLogger("workhorse.child")

#: The job whose code runs now (asyncio tasks it creates inherit it, and are its steps too).
_current: contextvars.ContextVar[AsyncJob | None] = contextvars.ContextVar(
    "workhorse.async_job", default=None)


class _Stepped:
    """Awaitable that runs a coroutine step by step, as ``await`` would, with the job's
    bookkeeping around each step (see the module's docstring)."""

    __slots__ = ("coro", "job")

    def __init__(self, coro: Coroutine[Any, Any, Any], job: AsyncJob) -> None:
        self.coro = coro
        self.job = job

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, job = self.coro, self.job
        heart, seq, pid = job.session.heart, job.job.seq, job.session.pid
        send, throw = coro.send, coro.throw
        value: Any = None
        error: BaseException | None = None
        while True:
            heart.running(seq)
            try:
                yielded = send(value) if error is None else throw(error)
            except StopIteration as stop:
                return stop.value
            finally:
                heart.running(0)
                if os.getpid() != pid:
                    job.session.runtime.exit_forked_copy(None)
            value, error = None, None
            try:
                value = yield yielded
            except BaseException as exc:  # noqa: BLE001 - passed on to the code, as await does
                error = job.translate(exc)


async def _stepped(coro: Coroutine[Any, Any, Any], job: AsyncJob) -> Any:
    return await _Stepped(coro, job)


class AsyncJob:
    """One async task in the child: its flow (``TaskExecution``), its asyncio task and its
    limits."""

    def __init__(self, session: AsyncSession, job: Job) -> None:
        self.session = session
        self.job = job
        self.task: asyncio.Task[None] | None = None
        #: Why it was cancelled from outside, if it was: (outcome, detail).
        self.interrupted: tuple[Outcome, str] | None = None
        self._soft_pending = False
        self._timers: list[asyncio.TimerHandle] = []
        #: Its code runs (is awaited): only then is a cancellation delivered to it.
        self.inside = False

    def start(self) -> None:
        loop = self.session.loop
        context = contextvars.copy_context()
        context.run(_current.set, self)
        self.task = loop.create_task(self._main(), context=context)

    async def _main(self) -> None:
        session, job = self.session, self.job
        execution = TaskExecution(session.runtime.app, job, session.runtime.hostname,
                                  nullcontext, session.send)
        try:
            finished = await self._flow(execution)
        except BaseException as exc:  # never leave the session waiting for it
            log.exception("%s[%s]: the worker failed around it", job.task,
                          job.headers.get("id"))
            finished = Finished(Outcome.STORE_FAILED, repr(exc))
        session.finished(self, finished)

    async def _flow(self, execution: TaskExecution) -> Finished:
        flow = execution.flow()
        try:
            body = next(flow)
            while True:
                try:
                    if self.interrupted is not None:    # before its code ever ran
                        raise asyncio.CancelledError()
                    self._arm()
                    value = body()
                    if inspect.isawaitable(value):
                        self.inside = True
                        try:
                            value = await _Stepped(_as_coroutine(value), self)
                        finally:
                            self.inside = False
                    if self.interrupted is not None:   # it caught its cancellation
                        raise asyncio.CancelledError()
                except BaseException as exc:  # noqa: BLE001 - the flow decides what it was
                    if self.interrupted is not None and isinstance(
                            exc, asyncio.CancelledError):
                        exc = Interrupted(*self.interrupted)
                    self._disarm()
                    body = flow.throw(exc)
                else:
                    self._disarm()
                    body = flow.send(value)
        except StopIteration as stop:
            return stop.value

    # -- limits
    def _arm(self) -> None:
        loop, job = self.session.loop, self.job
        if job.soft_limit:
            self._timers.append(loop.call_later(job.soft_limit, self._soft))
        if job.hard_limit:
            self._timers.append(loop.call_later(
                job.hard_limit, self.interrupt, Outcome.TIME_LIMIT,
                f"hard time limit ({job.hard_limit:g} s) exceeded: cancelled"))

    def _disarm(self) -> None:
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()

    def _soft(self) -> None:
        if self.task is None or not self.inside or self.interrupted is not None:
            return
        log.warning("%s[%s]: soft time limit (%g s) exceeded; SoftTimeLimitExceeded raised "
                    "in the task", self.job.task, self.job.headers.get("id"),
                    self.job.soft_limit or 0)
        self._soft_pending = True
        self.task.cancel()

    def interrupt(self, outcome: Outcome, detail: str) -> None:
        """Cancel the job for good (hard limit, terminate): it ends as ``outcome``."""
        if self.interrupted is not None:
            return
        self.interrupted = (outcome, detail)
        self._soft_pending = False
        if self.task is not None and self.inside:
            self.task.cancel()

    def translate(self, exc: BaseException) -> BaseException:
        """What the job's code sees of ``exc``, thrown into its step: the cancellation
        that carries the soft limit is SoftTimeLimitExceeded (and no longer a cancel
        request of its asyncio task)."""
        if self._soft_pending and isinstance(exc, asyncio.CancelledError):
            self._soft_pending = False
            if self.task is not None:
                self.task.uncancel()
            return SoftTimeLimitExceeded()
        return exc


class AsyncSession:
    """The child's event loop while it has async jobs. ``run`` returns once none is left,
    with the frames that came meanwhile and are not for it (the supervisor's Stop or
    next sync job, sent once it counted the last job done)."""

    def __init__(self, runtime: ChildRuntime, heart: Heart) -> None:
        self.runtime = runtime
        self.heart = heart
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self.loop.set_task_factory(_task_factory)
        self.jobs: dict[int, AsyncJob] = {}
        self._empty: asyncio.Future[None] | None = None
        self._beat: asyncio.TimerHandle | None = None
        #: Frames for after the session, in order.
        self.leftover: deque[object] = deque()

    def run(self, first: Job) -> deque[object]:
        self.leftover = deque()
        self.loop.run_until_complete(self._main(first))
        return self.leftover

    async def _main(self, first: Job) -> None:
        runtime = self.runtime
        self._empty = self.loop.create_future()
        self._tick()
        fd = runtime.read_fd
        os.set_blocking(fd, False)
        self.loop.add_reader(fd, self._readable)
        try:
            self.start(first)
            self._frames(runtime.pending_frames())
            await self._empty
        finally:
            self.loop.remove_reader(fd)
            os.set_blocking(fd, True)
            if self._beat is not None:
                self._beat.cancel()

    def _tick(self) -> None:
        self.heart.beat()
        self._beat = self.loop.call_later(BEAT_INTERVAL, self._tick)

    def _readable(self) -> None:
        frames = self.runtime.read_available()
        if frames is None:          # the supervisor is gone: end what runs, then exit
            self.leftover.append(Stop())
            for job in list(self.jobs.values()):
                job.interrupt(Outcome.CHILD_LOST, "the supervisor is gone")
            return
        self._frames(frames)

    def _frames(self, frames: list[object]) -> None:
        for frame in frames:
            if self.leftover:
                self.leftover.append(frame)
            elif isinstance(frame, Job) and frame.asynchronous:
                self.start(frame)
            elif isinstance(frame, Cancel):
                job = self.jobs.get(frame.seq)
                if job is not None:
                    job.interrupt(Outcome(frame.outcome), frame.detail)
            else:
                if self.jobs:
                    log.error("child %d: a %s frame came while it runs %d async tasks; "
                              "handled once they are over", self.runtime.index,
                              type(frame).__name__, len(self.jobs))
                self.leftover.append(frame)
                self._maybe_over()

    def start(self, job: Job) -> None:
        running = AsyncJob(self, job)
        self.jobs[job.seq] = running
        running.start()
        self.runtime.set_title(f"running {len(self.jobs)} async tasks")

    def finished(self, job: AsyncJob, finished: Finished) -> None:
        del self.jobs[job.job.seq]
        try:
            self.send(self.runtime.done(job.job, finished))
        except OSError:         # the supervisor is gone (its death kills us too)
            pass
        self._maybe_over()

    def _maybe_over(self) -> None:
        if not self.jobs and self._empty is not None and not self._empty.done():
            self._empty.set_result(None)

    def send(self, frame: object) -> None:
        self.runtime.send(frame)


def _task_factory(loop: asyncio.AbstractEventLoop, coro: Any,
                  **kwargs: Any) -> asyncio.Task[Any]:
    """Asyncio tasks a job's code creates are steps of that job (for the heart and a
    forked copy): their coroutine runs through ``_Stepped`` too."""
    job = _current.get()
    if job is not None and inspect.iscoroutine(coro):
        coro = _stepped(coro, job)
    return asyncio.Task(coro, loop=loop, **kwargs)


def _as_coroutine(awaitable: Any) -> Coroutine[Any, Any, Any]:
    if inspect.iscoroutine(awaitable):
        return awaitable

    async def awaiting() -> Any:
        return await awaitable
    return awaiting()


