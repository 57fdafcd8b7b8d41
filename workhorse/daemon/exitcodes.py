"""Exit statuses of the ``workhorse`` command; the systemd unit keys restarts off them."""
from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    OK = 0
    FAILURE = 1        # a runtime failure (broker unreachable, supervisor error)
    CONFIG = 2         # bad configuration or command line; nothing was started
    APP_IMPORT = 3     # the task module does not import, or holds no App: restarting won't help
    # Children die before they are ready, max_boot_failures in a row (code run in each new
    # child fails: a database down, a missing file). Held messages were requeued. Often
    # transient, so the systemd unit restarts the worker, with a growing delay.
    CHILD_BOOT = 4
