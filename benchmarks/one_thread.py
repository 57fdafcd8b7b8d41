"""An experiment, not a mode of workhorse: the worker with its broker thread's loop run on
the loop thread. Broker calls then block the loop (a hung broker would stall time limits
and signals, which docs/delivery.md forbids: that is why workhorse has a broker thread). It
measures what the hand-off between the two threads, and the interpreter lock they share,
cost a task (``throughput.py --one-thread``).

    python -m benchmarks.one_thread worker -A app ...     (the arguments of workhorse)
"""
from __future__ import annotations

import sys
import time
from typing import Any

from workhorse.broker import link
from workhorse.daemon.cli import main


def _start_on_the_loop_thread(self: link.BrokerLink) -> None:
    thread, loop = self.thread, self.loop
    thread.loop = loop                      # its readers and timers on the loop's selector
    thread.thread.is_alive = lambda: True   # type: ignore[method-assign]
    loop.add_reader(thread.commands.read_fd, thread._run_commands)
    loop.call_later(0, thread._connect)
    wait, dispatch = loop.wait, loop.dispatch

    def wait_then(max_timeout: float | None = None) -> Any:
        thread.progress = time.monotonic()
        thread._prepare()                   # as the broker thread does before its wait
        return wait(max_timeout)

    def dispatch_then(events: Any) -> None:
        dispatch(events)
        thread._hand_over()                 # and after its dispatch

    loop.wait, loop.dispatch = wait_then, dispatch_then     # type: ignore[method-assign]


link.BrokerLink.start = _start_on_the_loop_thread          # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main())
