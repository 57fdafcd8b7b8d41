"""Linux knobs for the processes of the pool: the child subreaper bit and the OOM score.

Both are best effort: where the kernel refuses (no privilege, not Linux), the worker runs
as before and says so at debug level.
"""
from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger("workhorse.supervisor")

PR_SET_CHILD_SUBREAPER = 36

#: The supervisor holds the prefetch buffer and every lease: the kernel's OOM killer should
#: take a child (whose task workhorse requeues) long before it. Lowering needs
#: CAP_SYS_RESOURCE (or systemd's OOMScoreAdjust=); raising is always allowed.
SUPERVISOR_OOM_SCORE_ADJ = -500
CHILD_OOM_SCORE_ADJ = 300

_OOM_SCORE_ADJ = "/proc/self/oom_score_adj"


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


def oom_score_adj() -> int | None:
    try:
        with open(_OOM_SCORE_ADJ) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def lower_oom_score_adj(value: int) -> None:
    """Lower this process's OOM score adjustment to ``value``, unless it is lower already
    (e.g. set by systemd's OOMScoreAdjust=)."""
    current = oom_score_adj()
    if current is not None and value < current:
        _write_oom_score_adj(value, current)


def raise_oom_score_adj(value: int) -> None:
    """Raise this process's OOM score adjustment to ``value``, unless it is higher already."""
    current = oom_score_adj()
    if current is not None and value > current:
        _write_oom_score_adj(value, current)


def _write_oom_score_adj(value: int, current: int) -> None:
    try:
        with open(_OOM_SCORE_ADJ, "w") as f:
            f.write(str(value))
    except OSError as exc:
        log.debug("cannot set oom_score_adj to %d (it stays %d): %s", value, current, exc)
