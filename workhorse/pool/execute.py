"""Running one task in a child: decode, call, store the outcome, apply callbacks.

Returns an Outcome for the supervisor to settle. The result is stored before the outcome
is reported, so with acks_late a message is never acked before its result is safe.
"""
from __future__ import annotations

import logging
import os
import time
import traceback
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager
from datetime import datetime
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any, NamedTuple

from ..canvas import signature
from ..chords import call_errbacks, chord_part_return, fail_chain
from ..exceptions import (
    Ignore,
    MalformedMessage,
    NotRegistered,
    Reject,
    ResultEncodeError,
    Retry,
)
from ..outcome import Outcome
from ..backends import Claim, reply_of
from ..backends.encoding import describe_exception, safe_repr
from ..protocol import (
    NOMINAL_HEADER,
    SCHEDULE_HEADER,
    Request,
    malformed_request,
    read_message,
)
from ..states import FAILURE, SUCCESS
from ..retrying import retry_countdown, should_autoretry
from ..task import Context, Task
from .ipc import Claimed, Job

if TYPE_CHECKING:
    from ..app import App

log = logging.getLogger("workhorse.child")


class Interrupted(BaseException):
    """Thrown into an async task's flow when its own code was cancelled from outside: at
    its hard time limit, or revoked with terminate. A BaseException: nothing the flow runs
    for a task's failure (errbacks, a stored FAILURE) is run for it."""

    def __init__(self, outcome: Outcome, detail: str) -> None:
        super().__init__(outcome, detail)
        self.outcome = outcome
        self.detail = detail


class Finished(NamedTuple):
    """How a job ended, for its Done frame (a named tuple: one is made for every task)."""

    outcome: Outcome
    detail: str | None = None
    runtime: float | None = None
    result: str | None = None       # for task events: the return value's repr
    traceback: str | None = None    # for task events: a failure's traceback


class TaskExecution:
    """One job in one child. ``around_task`` wraps the task body alone: the child arms its
    soft time limit there, and stops any process the task forked as it returns."""

    def __init__(self, app: App, job: Job, hostname: str,
                 around_task: Callable[[], AbstractContextManager[None]],
                 report: Callable[[object], None]) -> None:
        self.app = app
        self.job = job
        self.hostname = hostname
        self.around_task = around_task
        self.report = report                  # sends a frame to the supervisor
        self.claim_key: str | None = None     # the idempotency key this run holds

    def run(self) -> Finished:
        """Run a sync task: its body is called here, with ``around_task`` around it."""
        flow = self.flow()
        try:
            body = next(flow)
            while True:
                try:
                    with self.around_task():
                        value = body()
                except BaseException as exc:  # noqa: BLE001 - the flow decides what it was
                    body = flow.throw(exc)
                else:
                    body = flow.send(value)
        except StopIteration as stop:
            return stop.value

    def flow(self) -> Generator[Callable[[], Any], Any, Finished]:
        """Everything about one job but the call of the task's body: that is yielded (a
        function of no arguments), and what it returned is sent back, or what it raised
        thrown in. Its driver (``run``; ``pool.aio`` for an async task) calls it as its
        kind of task needs; the flow returns the outcome."""
        job = self.job
        try:
            request, (args, kwargs, embed) = read_message(
                job.headers, job.body, job.content_type, job.content_encoding)
        except MalformedMessage as exc:
            # Reported, not stored: the supervisor stores FAILURE(MalformedMessage) under
            # the message's id as it dead-letters it, wherever it was found malformed.
            seen = malformed_request(job.headers, job.body, job.content_type,
                                     job.content_encoding)
            log.error("%s[%s]: malformed message, not run: %s", job.task,
                      seen.id if seen else "?", exc)
            return Finished(Outcome.MALFORMED, str(exc))
        self.task_id = request.id
        self.label = f"{job.task}[{request.id}]"
        task = self.app.tasks.get(job.task)
        if task is None:   # the supervisor checks the registry first; never trust it blindly
            return Finished(Outcome.UNKNOWN_TASK, str(NotRegistered(job.task)))
        self.task = task
        self.context = Context(
            id=request.id, task=job.task, args=args, kwargs=kwargs, retries=request.retries,
            root_id=request.root_id, parent_id=request.parent_id, group=request.group,
            group_index=request.group_index, origin=request.origin, eta=request.eta,
            expires=request.expires, hostname=self.hostname, delivery_info=job.delivery_info,
            headers=dict(request.headers), properties=job.properties,
            timelimit=(request.time_limit, request.soft_time_limit),
            called_directly=False, priority=job.priority, queue=job.queue,
            callbacks=embed.get("callbacks"), errbacks=embed.get("errbacks"),
            chain=embed.get("chain"), chord=embed.get("chord"),
            schedule=request.headers.get(SCHEDULE_HEADER),
            nominal_time=_nominal_time(request.headers.get(NOMINAL_HEADER)))
        self.request, self.arguments = request, (args, kwargs)
        self.store = not task.ignores_result(request.ignore_result)
        task.push_request(self.context)
        try:
            try:
                skip = self._already_done(request) or self._claim(task, request.id, args,
                                                                  kwargs)
            except Exception as exc:  # noqa: BLE001 - the store is down; nothing has run
                log.error("Task %s: the result store could not tell whether it may run (%r); "
                          "not started, tried again later", self.label, exc)
                return Finished(Outcome.NOT_RUN, repr(exc))
            if skip is not None:
                return skip
            finished = yield from self._run(task, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - the result store failed
            log.error("Task %s: result store error, the message goes back to the broker: %r",
                      self.label, exc)
            finished = Finished(Outcome.STORE_FAILED, repr(exc))
        finally:
            task.pop_request()
        self._end_claim(finished)
        return finished

    @cached_property
    def info(self) -> dict[str, Any]:
        """The request as the result store records it beside a state (made only where one
        is stored)."""
        job, request, (args, kwargs) = self.job, self.request, self.arguments
        return {"task": job.task, "args": args, "kwargs": kwargs,
                "hostname": self.hostname, "retries": request.retries, "group": request.group,
                "parent_id": request.parent_id, "delivery_info": job.delivery_info,
                **reply_of(job.properties)}

    # ------------------------------------------------------------------ duplicates
    def _already_done(self, request: Request) -> Finished | None:
        """A redelivered message whose SUCCESS is stored already is acked, not run again;
        but its continuations are completed first. They are published before the message
        is acked, so its earlier delivery may have stopped between the two: a callback or
        chain step published twice is the price of never publishing one zero times."""
        job = self.job
        # (A schedule's due time is looked up too: sent twice, it has one task id.)
        redelivered = (request.deliveries > 0 or job.delivery_info.get("redelivered")
                       or job.headers.get("redelivered") or NOMINAL_HEADER in job.headers)
        if not (redelivered and self.store):
            return None
        meta = self.app.backend.get_task_meta(request.id)
        if meta["status"] != SUCCESS:
            return None
        log.warning("Task %s: %s, but its SUCCESS is stored already; acked without "
                    "running it again, once its continuations are sent", self.label,
                    "sent twice for one due time" if NOMINAL_HEADER in job.headers
                    else "redelivered")
        return self._continue(meta["result"]) or Finished(
            Outcome.ALREADY_DONE, "its SUCCESS was stored already")

    def _claim(self, task: Task, task_id: str, args: list[Any],
               kwargs: dict[str, Any]) -> Finished | None:
        """Idempotent tasks claim their key first: none runs twice at once or after success."""
        try:
            key = task.idempotency_key(task_id, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - the key function is the task's own code
            return self._failed(exc, traceback.format_exc(), 0.0)
        if key is None:
            return None
        job = self.job
        claim = self.app.backend.claim(key, job.claim_owner, job.claim_ttl)
        if claim is Claim.DONE:
            log.warning("Task %s: idempotency key %r finished already; acked without running",
                        self.label, key)
            backend = self.app.backend
            if self.store and backend.get_task_meta(task_id)["status"] != SUCCESS:
                # Another task id with the same key succeeded: do not leave this one PENDING.
                backend.mark_as_revoked(task_id, f"idempotency key {key!r} is done: another "
                                        "run of it succeeded", request=self.info)
            return Finished(Outcome.ALREADY_DONE, f"idempotency key {key!r} is done")
        if claim is Claim.HELD:
            log.info("Task %s: idempotency key %r is held by a run in progress elsewhere",
                     self.label, key)
            return Finished(Outcome.CLAIMED_ELSEWHERE, key)
        self.claim_key = key
        self.report(Claimed(os.getpid(), job.seq, key, job.claim_owner))
        return None

    def _end_claim(self, finished: Finished) -> None:
        """A success makes the key done for good; anything else lets it run again."""
        key, owner = self.claim_key, self.job.claim_owner
        if key is None:
            return
        backend = self.app.backend
        try:
            if finished.outcome is Outcome.SUCCEEDED:
                backend.finish_claim(key, owner)
            else:
                backend.release_claim(key, owner)
        except Exception as exc:  # noqa: BLE001 - the claim lapses on its own
            log.error("Task %s: could not end its claim on idempotency key %r (%r); it lapses "
                      "after %.0f s", self.label, key, exc, self.job.claim_ttl)

    # ------------------------------------------------------------------ outcomes
    def _run(self, task: Task, args: list[Any], kwargs: dict[str, Any]
             ) -> Generator[Callable[[], Any], Any, Finished]:
        if self.job.track_started and self.store:
            self.app.backend.mark_as_started(self.task_id, request=self.info)
        started = time.monotonic()
        try:
            retval = yield (partial(task.run, task, *args, **kwargs) if task.bind
                            else partial(task.run, *args, **kwargs))
        except Interrupted as stop:
            # An async task cancelled at its hard limit, or revoked with terminate: the
            # supervisor stores what it stores for a sync task it killed.
            log.error("Task %s: %s", self.label, stop.detail)
            return Finished(stop.outcome, stop.detail, runtime=time.monotonic() - started)
        except Retry as signal:
            return self._retried(signal)
        except Ignore:
            log.info("Task %s ignored", self.label)
            return Finished(Outcome.IGNORED)
        except Reject as reject:
            return self._rejected(reject)
        except BaseException as exc:  # noqa: BLE001 - a task's SystemExit is its failure too
            # A soft limit landing just as the task returned is counted against it.
            tb = traceback.format_exc()
            if isinstance(exc, Exception) and self._autoretries(exc):
                try:
                    self._autoretry(exc)
                except Retry as signal:
                    return self._retried(signal)
                except BaseException as final:  # noqa: BLE001 - past max_retries
                    exc, tb = final, (tb if final is exc else traceback.format_exc())
            return self._failed(exc, tb, time.monotonic() - started)
        return self._succeeded(retval, time.monotonic() - started)

    def _succeeded(self, retval: Any, runtime: float) -> Finished:
        if self.store:
            self.info["children"] = [child.as_tuple() for child in self.context.children]
            try:
                self.app.backend.mark_as_done(self.task_id, retval, request=self.info)
            except ResultEncodeError as exc:
                log.error("Task %s returned a value that cannot be stored: %s", self.label, exc)
                return self._failed(exc, None, runtime)
        shown = None
        # (a return value's repr, which may be long in the making, only where it is read)
        if self.job.events or log.isEnabledFor(logging.INFO):
            shown = safe_repr(retval)
            log.info("Task %s succeeded in %.3fs: %.200s", self.label, runtime, shown)
        return self._continue(retval) or Finished(
            Outcome.SUCCEEDED, runtime=runtime, result=shown if self.job.events else None)

    def _continue(self, retval: Any) -> Finished | None:
        """Send a success's continuations (link callbacks, the chain's next step, its chord
        part and the chord's body): part of its settlement, so done before the outcome is
        reported and the message acked. If one cannot be sent, the message goes back to
        its queue (counted), and its redelivery, finding the SUCCESS stored, sends them."""
        try:
            self._apply_callbacks(retval)
            self._chord_part(SUCCESS, retval)
        except Exception as exc:  # noqa: BLE001 - the broker's or the store's trouble
            log.error("Task %s: its result is stored, but its continuations could not all be "
                      "sent (%r); the message goes back to its queue to send them again",
                      self.label, exc)
            return Finished(Outcome.CONTINUATION_FAILED, repr(exc))
        return None

    def _failed(self, exc: BaseException, tb: str | None, runtime: float) -> Finished:
        described = describe_exception(exc)     # str(exc) may fail: its args are the task's
        log.error("Task %s raised %s in %.3fs: %s\n%s", self.label, type(exc).__name__, runtime,
                  described, tb or "")
        if self.store:
            self._store_failure(exc, tb)
        fail_chain(self.app, self.context.chain, exc, tb, inline_errbacks=True)
        self._call_errbacks(exc, tb)
        self._chord_part(FAILURE, exc)
        return Finished(Outcome.FAILED, described, runtime=runtime,
                        traceback=tb if self.job.events else None)

    def _retried(self, signal: Retry) -> Finished:
        try:
            detail = str(signal)
        except Exception:  # noqa: BLE001 - it shows the task's exception, which may not show
            detail = describe_exception(signal)
        log.info("Task %s retry: %s", self.label, detail)
        return Finished(Outcome.RETRY, detail)

    def _rejected(self, reject: Reject) -> Finished:
        if not self.job.acks_late:
            log.warning("Task %s raised Reject, which has no effect with acks_late = false: "
                        "the message was acked when the task started", self.label)
        if reject.requeue:
            log.info("Task %s rejected its message, requeued: %s", self.label, reject.reason)
            return Finished(Outcome.REJECTED_REQUEUE, f"rejected: {reject.reason}")
        log.error("Task %s rejected its message: %s", self.label, reject.reason)
        if self.store:
            self._store_failure(reject, None)
        return Finished(Outcome.REJECTED, f"rejected: {reject.reason}")

    def _store_failure(self, exc: BaseException, tb: str | None) -> None:
        backend = self.app.backend
        try:
            backend.mark_as_failure(self.task_id, exc, tb, request=self.info)
        except ResultEncodeError as error:
            # Args that do not encode are stored as their reprs; this is for whatever else
            # fails (an exception class that cannot be named): store a description instead.
            log.error("Task %s: %s; storing ResultEncodeError instead", self.label, error)
            backend.mark_as_failure(self.task_id, ResultEncodeError(
                f"the task raised {describe_exception(exc)}, which cannot be stored"), tb,
                request=self.info)

    # ------------------------------------------------------------------ retries
    def _autoretries(self, exc: Exception) -> bool:
        return should_autoretry(exc, self.task.autoretry_for, self.task.dont_autoretry_for)

    def _autoretry(self, exc: Exception) -> None:
        """Retry as the task's autoretry options say; raises Retry, or the final error."""
        task = self.task
        kwargs = dict(task.retry_kwargs or {})
        backoff = task.option("retry_backoff")
        if backoff:
            kwargs["countdown"] = retry_countdown(
                self.context.retries, backoff=backoff,
                backoff_max=task.option("retry_backoff_max"), jitter=task.option("retry_jitter"),
                default_delay=task.option("default_retry_delay"))
        task.retry(exc=exc, **kwargs)

    # ------------------------------------------------------------------ callbacks
    def _apply_callbacks(self, retval: Any) -> None:
        """``link`` callbacks get the result first; the next chain step does too."""
        ctx = self.context
        follow_ups: list[tuple[dict[str, Any], dict[str, Any]]] = [
            (cb, {}) for cb in ctx.callbacks or ()]
        if ctx.chain:
            follow_ups.append((ctx.chain[-1], {"chain": ctx.chain[:-1] or None}))
        for data, extra in follow_ups:
            signature(data, self.app).apply_async(
                (retval,), parent_id=ctx.id, root_id=ctx.root_id, **extra)

    def _call_errbacks(self, exc: BaseException, tb: str | None) -> None:
        call_errbacks(self.app, self.context.errbacks or (), self.context, exc, tb, inline=True)

    def _chord_part(self, state: str, result: Any) -> None:
        """A chord header task's final outcome counts toward its chord."""
        ctx = self.context
        if ctx.chord and ctx.group:
            chord_part_return(self.app, ctx.group, self.task_id, ctx.group_index, state, result,
                              ctx.chord, inline_errbacks=True)


def _nominal_time(value: Any) -> datetime | None:
    """A schedule's due time, from its header; None if absent or unreadable."""
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None
