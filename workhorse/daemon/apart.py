"""Calls that may block for long, made on a thread of their own, each outcome handed back
to the supervisor's loop: the stores the supervisor makes itself into a result store whose
calls can hang (a database that stops answering, ``Backend.calls_block``)."""
from __future__ import annotations

import collections
import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .loop import Loop

log = logging.getLogger("workhorse.supervisor")

#: What the loop is handed back: the call's exception, or None.
Then = Callable[[BaseException | None], None]


class Apart:
    """One daemon thread (a hung call never holds up the process's exit), calls made in
    order; ``then`` runs on ``loop`` once its call ends (without a loop, there is none:
    the call says its own troubles)."""

    def __init__(self, loop: Loop | None, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], object], Then | None]] = (
            queue.SimpleQueue())
        self._done: collections.deque[tuple[Then, BaseException | None]] = collections.deque()
        self._read = self._write = -1
        if loop is not None:
            self._read, self._write = os.pipe()
            os.set_blocking(self._read, False)
            os.set_blocking(self._write, False)
            loop.add_reader(self._read, self._hand_back)
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, call: Callable[[], object], then: Then | None = None) -> None:
        self._jobs.put((call, then))

    def _run(self) -> None:
        while True:
            call, then = self._jobs.get()
            error: BaseException | None = None
            try:
                call()
            except Exception as exc:  # noqa: BLE001 - handed to the loop, which decides
                error = exc
            if then is None or self._write < 0:
                continue
            self._done.append((then, error))
            try:
                os.write(self._write, b"\0")
            except BlockingIOError:
                pass        # the loop has wakeups enough waiting already

    def _hand_back(self) -> None:
        try:
            os.read(self._read, 65536)
        except BlockingIOError:
            pass
        while self._done:
            then, error = self._done.popleft()
            try:
                then(error)
            except Exception:  # the loop goes on; the message stays held, and is said
                log.exception("handing back a call made apart failed")
