"""Exceptions raised by workhorse and seen by task code and clients.

The time-limit and worker-lost classes are billiard's, the same objects Celery uses, so a
result stored by either worker names the same class (``billiard.exceptions``) and
Celery's and workhorse's clients rebuild it alike.
"""
from __future__ import annotations

import builtins

from billiard.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded, WorkerLostError

__all__ = [
    "WorkhorseError", "SoftTimeLimitExceeded", "TimeLimitExceeded", "WorkerLostError",
    "NotRegistered", "MalformedMessage", "TimeoutError", "TaskRevokedError",
    "AppImportError", "ResultEncodeError", "TooManyDeliveries", "TaskPredicate", "Retry",
    "Ignore", "Reject", "MaxRetriesExceededError", "ChordError",
]


class WorkhorseError(Exception):
    """Base class of workhorse's own errors."""


class NotRegistered(KeyError, WorkhorseError):
    """A message names a task that the worker's app does not define."""

    def __str__(self) -> str:
        return f"task {self.args[0]!r} is not registered" if self.args else "task not registered"


class MalformedMessage(WorkhorseError):
    """A message that cannot be read as a Celery task message (protocol v2, or v1)."""


class TimeoutError(builtins.TimeoutError, WorkhorseError):  # shadows the builtin: Celery's name
    """``AsyncResult.get()`` waited its whole timeout without a ready result."""


class TaskRevokedError(WorkhorseError):
    """The task was revoked or expired before it ran."""


class TooManyDeliveries(WorkhorseError):
    """The message was started more than ``max_deliveries`` times."""


class ResultEncodeError(WorkhorseError):
    """A task's return value or exception cannot be encoded for the result store."""


class AppImportError(WorkhorseError):
    """The task module named by ``app`` could not be imported or holds no App."""


class TaskPredicate(WorkhorseError):
    """Raised by task code to tell the worker what to do with the message."""


class Retry(TaskPredicate):
    """The task is to be retried: ``self.retry()`` raises it after the retry is sent."""

    def __init__(self, message: str | None = None, exc: BaseException | None = None,
                 when: object = None, sig: object = None) -> None:
        self.message = message
        self.exc = exc
        self.when = when
        self.sig = sig
        super().__init__(message, exc, when)

    def humanize(self) -> str:
        if isinstance(self.when, (int, float)):
            return f"in {self.when:.3g}s"
        return f"at {self.when}"

    def __str__(self) -> str:
        if self.message:
            return self.message
        return f"Retry {self.humanize()}" + (f": {self.exc!r}" if self.exc else "")

    def __reduce__(self) -> tuple:
        return self.__class__, (self.message, None, self.when)


class Ignore(TaskPredicate):
    """The task asks that its message be acked and no result stored."""


class Reject(TaskPredicate):
    """The task rejects its message: dead-letter it, or (``requeue=True``) requeue it."""

    def __init__(self, reason: object = None, requeue: bool = False) -> None:
        self.reason = reason
        self.requeue = requeue
        super().__init__(reason, requeue)


class MaxRetriesExceededError(WorkhorseError):
    """``self.retry()`` was called past ``max_retries`` without an exception to re-raise."""

    def __init__(self, *args: object, task_args: object = None, task_kwargs: object = None) -> None:
        self.task_args = task_args
        self.task_kwargs = task_kwargs
        super().__init__(*args)


class ChordError(WorkhorseError):
    """A chord's header had a task that failed: its body does not run."""


#: Where Celery defines the classes workhorse has its own of: results name these, so a
#: Celery client's ``except celery.exceptions.Reject`` matches what a workhorse worker
#: stored, and workhorse's client reads Celery's names back as its own classes.
CELERY_MODULE = "celery.exceptions"
CELERY_NAMED: tuple[type[BaseException], ...] = (
    NotRegistered, TimeoutError, TaskRevokedError, Retry, Ignore, Reject,
    MaxRetriesExceededError, ChordError)
