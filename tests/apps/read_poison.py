"""The basic test app, in a supervisor that dies while it reads one message: a message with
the header ``x-test-kill-on-read`` SIGKILLs the process that decodes its headers (the
supervisor; its children never do), as a message that exhausts the supervisor's memory
or crashes its decoder would. Nothing else differs from ``tests.apps.basic``."""
from __future__ import annotations

import os
import signal
from typing import Any

from workhorse.daemon import intake

from .basic import app

__all__ = ["app"]

POISON_HEADER = "x-test-kill-on-read"
_read_request = intake.read_request


def _dying_read_request(headers: Any, *args: Any) -> Any:
    if headers and headers.get(POISON_HEADER):
        os.kill(os.getpid(), signal.SIGKILL)
    return _read_request(headers, *args)


intake.read_request = _dying_read_request  # type: ignore[assignment]
