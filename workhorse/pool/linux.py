"""Linux knobs for the processes of the pool: the child subreaper bit.

Best effort: where the kernel refuses (no privilege, not Linux), the worker runs
as before and says so at debug level.
"""
from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger("workhorse.supervisor")

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Orphans of our descendants are reparented to us rather than to init, so they stay
    visible (and are reaped) while the supervisor lives. Not inherited by children."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        log.debug("cannot become a child subreaper: no prctl()")
        return False
    if prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        log.debug("cannot become a child subreaper: %s", os.strerror(ctypes.get_errno()))
        return False
    return True
