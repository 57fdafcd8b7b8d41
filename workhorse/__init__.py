"""workhorse: a prefork worker daemon for Celery-protocol tasks."""
from __future__ import annotations

from .transport import register as _register_transport

_register_transport()

from .app import App, current_app  # noqa: E402
from .canvas import Signature, chain, chord, group, signature  # noqa: E402
from .exceptions import (  # noqa: E402
    ChordError,
    Ignore,
    MaxRetriesExceededError,
    NotRegistered,
    Reject,
    Retry,
    SoftTimeLimitExceeded,
    TimeLimitExceeded,
    TimeoutError,
    WorkerLostError,
)
from .result import AsyncResult, GroupResult, ResultSet  # noqa: E402
from .task import Task  # noqa: E402

__version__ = "0.1.0"
__all__ = ["App", "AsyncResult", "GroupResult", "ResultSet", "Task", "current_app", "Signature",
           "chain", "chord", "group", "signature",
           "ChordError", "Ignore", "MaxRetriesExceededError", "NotRegistered", "Reject", "Retry",
           "SoftTimeLimitExceeded", "TimeLimitExceeded", "TimeoutError", "WorkerLostError"]
