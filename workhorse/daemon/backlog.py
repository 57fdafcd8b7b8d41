"""The backlog thread: what the queues the worker consumes hold, read from the broker on a
connection of its own every ``PROBE_INTERVAL`` seconds (1), for the metrics, ``/scale`` and the
autoscaler. The loop never waits on it: the thread replaces ``view`` whole, and readers
take it as it is.

What each broker tells (``Channel.backlog``): ready messages on every broker; when the
oldest ready one was sent on SQLite (its row's time) and Redis (the stamp of the message
next to be taken, if its producer stamped it); RabbitMQ tells the count and its consumers
but cannot show a message without taking it. Where the oldest message's age is not known,
it is bounded from above (``estimated``): by how long the queue has not been seen empty,
and by the age of the last message this worker took from it (a queue hands out its
messages in order, so the one next in line was sent after that one).

Who owns what: the thread owns its connection; forks wait while it reads (the gate is
held except while it sleeps; a polled SQLite file is read with it held, as by the other
service threads).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..transport.backlog import Backlog, sent_at
from .service import RECONNECT_INTERVAL, ServiceThread

if TYPE_CHECKING:
    from ..app import App

log = logging.getLogger("workhorse.backlog")

#: Seconds between two reads of the queues (the autoscaler acts on each new one).
PROBE_INTERVAL = 1.0
#: A view older than this many intervals is stale (the broker is away): nobody acts on it.
STALE_AFTER = 3


@dataclass(frozen=True)
class QueueView:
    ready: int
    #: Seconds the oldest ready message has waited (0 with none ready); None: unknown.
    oldest_age: float | None
    #: True when ``oldest_age`` is an upper bound (how long the queue was not seen empty).
    estimated: bool = False
    consumers: int | None = None


@dataclass(frozen=True)
class View:
    queues: dict[str, QueueView]
    taken_at: float             # monotonic time of the read; 0.0: never read

    def fresh(self, now: float) -> bool:
        return self.taken_at > 0 and now - self.taken_at <= STALE_AFTER * PROBE_INTERVAL

    @property
    def ready(self) -> int:
        return sum(q.ready for q in self.queues.values())

    @property
    def oldest_age(self) -> float | None:
        """The oldest wait of any queue (unknown if one with messages cannot tell)."""
        ages = [q.oldest_age for q in self.queues.values()]
        if any(age is None for age in ages):
            return None
        return max((age for age in ages if age is not None), default=0.0)


class BacklogThread(ServiceThread):
    name = "backlog"

    def __init__(self, app: App, queues: Callable[[], Sequence[str]],
                 clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic,
                 interval: float = PROBE_INTERVAL) -> None:
        super().__init__(log)
        self.app = app
        self.queues = queues
        self.clock = clock
        self.monotonic = monotonic
        self.interval = interval
        self.view = View({}, 0.0)
        #: queue -> wall time it was last seen empty (for the estimated age).
        self._empty_at: dict[str, float] = {}
        self._wake = threading.Event()
        self._failures = 0
        #: queue -> the send time of the last message taken from it here (loop thread).
        self._last_taken: dict[str, float] = {}

    # ------------------------------------------------------------------ loop thread's API
    def taken(self, queue: str, message: Any) -> None:
        """A message arrived from ``queue``: its send time bounds the age of the next."""
        sent = sent_at(message.properties, message.headers)
        if sent is not None:
            self._last_taken[queue] = sent

    def stop(self, timeout: float) -> None:
        self._stopping.set()
        self._wake.set()
        super().stop(timeout)

    def serve(self) -> None:
        with self.app.connection() as connection:
            connection.ensure_connection(max_retries=connection.retries(2))
            channel = connection.default_channel
            backlog = getattr(channel, "backlog", None)
            if backlog is None:
                log.info("backlog: the broker at %s tells no queue's backlog; none is "
                         "measured", connection.as_uri())
                self._park(None)
                return
            while not self.stopping:
                try:
                    self.view = self.read(backlog, list(self.queues()))
                except Exception as exc:  # noqa: BLE001 - read again on a new connection
                    # (A queue the broker thread has not declared yet is not found: once.)
                    self._failures += 1
                    (log.warning if self._failures >= STALE_AFTER else log.debug)(
                        "backlog: cannot read the queues (%r); reading again in %.0f s",
                        exc, RECONNECT_INTERVAL)
                    return
                self._failures = 0
                self._park(self.interval)

    def read(self, backlog: Callable[[str], Backlog], queues: list[str]) -> View:
        """One read of every queue (the thread's; tests call it directly)."""
        views: dict[str, QueueView] = {}
        for queue in queues:
            found = backlog(queue)
            now = self.clock()
            ready, sent, consumers = found.ready, found.oldest_sent, found.consumers
            if ready == 0:
                self._empty_at[queue] = now
                views[queue] = QueueView(0, 0.0, False, consumers)
            elif sent is not None:
                views[queue] = QueueView(ready, max(0.0, now - sent), False, consumers)
            else:
                bound = now - self._empty_at.setdefault(queue, now)
                taken = self._last_taken.get(queue)
                if taken is not None:
                    bound = min(bound, max(0.0, now - taken))
                views[queue] = QueueView(ready, bound, True, consumers)
        return View(views, self.monotonic())

    def _park(self, seconds: float | None) -> None:
        self.gate.release()
        try:
            self._wake.wait(seconds)
        finally:
            self.gate.acquire()
