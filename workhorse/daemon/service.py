"""A supervisor thread with a broker connection of its own (remote control, events).

Who owns what: the thread owns its connection and reconnects it (every
``RECONNECT_INTERVAL`` s after a failure); the loop thread owns everything else. The
thread reaches the loop only through ``posted`` (closures the loop runs when it turns; its
log records go the same way). Forks: the loop forks children only while the thread is
``parked``: it holds its ``gate`` whenever it runs broker code and releases it only while
it waits, holding nothing a forked child could inherit mid-call.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

from ..sqlitedb import said
from ..broker.thread import Wakeup, divert_logging, parked
from .loop import Loop

#: Seconds between attempts to (re)connect.
RECONNECT_INTERVAL = 2.0


class ServiceThread:
    """Runs ``serve`` (one connection's life) on a ``threading.Thread`` until stopped.

    It runs a thread rather than being one (see ``BrokerThread``)."""

    #: For the thread's name and its log lines.
    name = "service"

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self.posted = Wakeup()
        self.gate = threading.Lock()
        self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._stopping = threading.Event()

    # ------------------------------------------------------------------ loop thread's API
    def start(self, loop: Loop) -> None:
        loop.add_reader(self.posted.read_fd, self.run_posted)
        self.thread.start()

    def run_posted(self) -> None:
        for closure in self.posted.take():
            closure()

    @contextlib.contextmanager
    def parked(self) -> Iterator[bool]:
        """Around fork(): True while this thread waits holding nothing."""
        with parked(self.thread, self.gate) as free:
            yield free

    def stop(self, timeout: float) -> None:
        self._stopping.set()
        self.thread.join(timeout)
        self.run_posted()                   # its last log records

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    # ------------------------------------------------------------------ the thread
    def serve(self) -> None:
        """One connection's life (with ``gate`` held; release it only to wait)."""
        raise NotImplementedError

    def finish(self) -> None:
        """The thread ends (with ``gate`` held): release what it holds."""

    def _run(self) -> None:
        divert_logging(self.thread, self.posted.put)
        self.gate.acquire()
        try:
            while not self._stopping.is_set():
                try:
                    self.serve()
                except Exception as exc:  # noqa: BLE001 - logged; tried again
                    (self.log.debug if said(exc) else self.log.warning)(
                        "%s: %s; connecting again in %.0f s", self.name, describe(exc),
                        RECONNECT_INTERVAL)
                self.gate.release()
                self._stopping.wait(RECONNECT_INTERVAL)
                self.gate.acquire()
        finally:
            try:
                self.finish()
            finally:
                self.gate.release()


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
