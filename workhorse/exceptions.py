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
    "AppImportError", "ResultEncodeError", "TooManyDeliveries",
]


class WorkhorseError(Exception):
    """Base class of workhorse's own errors."""


class NotRegistered(KeyError, WorkhorseError):
    """A message names a task that the worker's app does not define."""

    def __str__(self) -> str:
        return f"task {self.args[0]!r} is not registered" if self.args else "task not registered"


class MalformedMessage(WorkhorseError):
    """A message that cannot be read as a Celery protocol v2 task message."""


class TimeoutError(builtins.TimeoutError, WorkhorseError):  # noqa: A001 - Celery's name
    """``AsyncResult.get()`` waited its whole timeout without a ready result."""


class TaskRevokedError(WorkhorseError):
    """The task was revoked or expired before it ran."""


class TooManyDeliveries(WorkhorseError):
    """The message was started more than ``max_deliveries`` times."""


class ResultEncodeError(WorkhorseError):
    """A task's return value or exception cannot be encoded for the result store."""


class AppImportError(WorkhorseError):
    """The task module named by ``app`` could not be imported or holds no App."""
