"""The basic app, whose children cannot start: code the task module runs in each new child
(here an ``os.register_at_fork`` hook, as libraries that reconnect after fork use) fails,
and the child exits before it is ready. The supervisor itself starts normally.

Never import this module in the test process: every fork of it would die too."""
from __future__ import annotations

import os
import sys

from tests.apps.basic import app

__all__ = ["app"]


def _connect_in_child() -> None:
    sys.stderr.write("unbootable: cannot connect to the database in this child\n")
    sys.stderr.flush()
    os._exit(1)


os.register_at_fork(after_in_child=_connect_in_child)
