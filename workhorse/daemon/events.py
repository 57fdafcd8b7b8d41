"""Celery's event stream, published on a thread and a broker connection of its own.

The loop thread hands events over with ``send`` (a dict built from what it knows, put on
a queue: it never waits on the broker); this thread publishes them to the ``celeryev``
exchange, and every ``HEARTBEAT_INTERVAL`` s a ``worker-heartbeat``. ``worker-online`` is
queued when it starts, ahead of any task's event (it goes out once connected), and
``worker-offline`` when it stops. Worker events go out unless ``send_heartbeats`` is off;
task events only while they are enabled (``send_events``, or remote control's
``enable_events``). Events are for monitors, not a
record: while the broker is away at most ``BUFFER`` of them wait, the oldest dropped first.
"""
from __future__ import annotations

import logging
import queue
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kombu import Exchange

from ..broker.queues import events_exchange
from ..control.events import (
    HEARTBEAT_INTERVAL,
    Clock,
    event,
    received_fields,
    routing_key,
    worker_fields,
)
from ..outcome import Action, Decision, Outcome, Store
from .service import ServiceThread

if TYPE_CHECKING:
    from ..app import App
    from .delivery import Delivery
    from .loop import Loop

log = logging.getLogger("workhorse.events")

#: Events kept while they cannot be published.
BUFFER = 10_000
#: Celery's exchange for events (fanout on Redis, as Celery's ``get_exchange`` makes it;
#: workhorse's SQLite transport keeps fanout bindings in its file).
EXCHANGE = "celeryev"


class EventThread(ServiceThread):
    name = "events"

    def __init__(self, app: App, hostname: str, load: Callable[[], tuple[int, int]],
                 task_events: bool, heartbeats: bool, clock: Clock | None = None) -> None:
        super().__init__(log)
        self.app = app
        self.hostname = hostname
        self.load = load                    # (active, processed), read racily: a gauge
        self.task_events = task_events      # the loop thread's switch (enable_events)
        self.heartbeats = heartbeats
        self.clock = clock or Clock()
        self._queue: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._unsent: deque[dict[str, Any]] = deque(maxlen=BUFFER)
        #: Events dropped because too many were waiting (the broker was away or stuck).
        self.dropped = 0

    # ------------------------------------------------------------------ loop thread's API
    def start(self, loop: Loop) -> None:
        if self.heartbeats:     # first in the queue: a monitor meets the worker first
            self.worker("worker-online")
        super().start(loop)

    def task(self, kind: str, **fields: Any) -> None:
        """A task event, if task events are on."""
        if self.task_events:
            self._put(event(kind, self.hostname, self.clock.forward(), **fields))

    def worker(self, kind: str) -> None:
        active, processed = self.load()
        self._put(event(kind, self.hostname, self.clock.forward(),
                        **worker_fields(active, processed)))

    def _put(self, found: dict[str, Any]) -> None:
        """Queue it, unless ``BUFFER`` wait already (the thread is stuck on the broker)."""
        if self._queue.qsize() < BUFFER:
            self._queue.put(found)
        else:
            self.dropped += 1

    # ------------------------------------------------------------------ the thread
    def serve(self) -> None:
        with self.app.connection() as connection:
            connection.ensure_connection(max_retries=connection.retries(2))
            exchange = events_exchange(connection, EXCHANGE)
            producer = connection.Producer(serializer="json")
            beat = time.monotonic() + HEARTBEAT_INTERVAL
            while True:
                self._publish(producer, exchange)
                if self.stopping:
                    if self.heartbeats:
                        self.worker("worker-offline")
                        self._publish(producer, exchange)
                    return
                now = time.monotonic()
                if now >= beat:
                    if self.heartbeats:
                        self.worker("worker-heartbeat")
                    beat = now + HEARTBEAT_INTERVAL
                    continue
                self.gate.release()
                try:
                    self._unsent.append(self._queue.get(timeout=min(beat - now, 0.5)))
                except queue.Empty:
                    pass
                finally:
                    self.gate.acquire()

    def _publish(self, producer: Any, exchange: Exchange) -> None:
        while True:
            try:
                self._unsent.append(self._queue.get_nowait())
            except queue.Empty:
                break
        while self._unsent:
            found = self._unsent[0]
            producer.publish(found, exchange=exchange, declare=[exchange],
                             routing_key=routing_key(found["type"]),
                             headers={"hostname": self.hostname}, retry=False)
            self._unsent.popleft()


class TaskEvents:
    """Loop thread: task events from what the supervisor sees (a message received, given
    to a child, settled), handed to the ``EventThread``. ``on`` is checked first, so with
    task events off a task costs one attribute test per hook."""

    def __init__(self, thread: EventThread | None = None) -> None:
        self.thread = thread

    @property
    def on(self) -> bool:
        return self.thread is not None and self.thread.task_events

    def received(self, delivery: Delivery) -> None:
        request = delivery.request
        assert self.thread is not None
        self.thread.task("task-received", **received_fields(
            request.headers, request.id, request.task, request.retries, request.root_id,
            request.parent_id, request.eta, request.expires))

    def started(self, delivery: Delivery) -> None:
        assert self.thread is not None
        self.thread.task("task-started", uuid=delivery.request.id)

    def settled(self, delivery: Delivery, outcome: Outcome, decision: Decision,
                detail: str | None) -> None:
        found = settled_event(delivery, outcome, decision, detail)
        if found is not None:
            assert self.thread is not None
            self.thread.task(found[0], uuid=delivery.request.id, **found[1])


def settled_event(delivery: Delivery, outcome: Outcome, decision: Decision,
                  detail: str | None) -> tuple[str, dict[str, Any]] | None:
    """The task event that says how ``delivery`` ended (Celery's kinds and fields), or
    None (not run: a duplicate, a malformed message, an unknown task, ignored)."""
    done = delivery.done
    if outcome is Outcome.SUCCEEDED:
        return "task-succeeded", {"result": getattr(done, "result", None) or "",
                                  "runtime": getattr(done, "runtime", None) or 0.0}
    if outcome is Outcome.RETRY:
        return "task-retried", {"exception": detail or "", "traceback": ""}
    if outcome in (Outcome.EXPIRED, Outcome.REVOKED, Outcome.TERMINATED):
        terminated = outcome is Outcome.TERMINATED
        signum = None
        if terminated and detail and "(" in detail:
            signum = detail.rsplit("(", 1)[1].rstrip(")")
        return "task-revoked", {"terminated": terminated, "signum": signum,
                                "expired": outcome is Outcome.EXPIRED}
    if decision.action in (Action.REQUEUE, Action.REQUEUE_COUNTED):
        if outcome in (Outcome.CLAIMED_ELSEWHERE, Outcome.NOT_RUN):
            return None
        return "task-rejected", {"requeue": True}
    if outcome is Outcome.REJECTED:
        return "task-rejected", {"requeue": False}
    if outcome is Outcome.FAILED or (decision.store in _FAILURES and outcome not in (
            Outcome.MALFORMED, Outcome.UNKNOWN_TASK)):
        return "task-failed", {"exception": detail or outcome.value,
                               "traceback": getattr(done, "traceback", None) or ""}
    return None


_FAILURES = frozenset({Store.TIME_LIMIT, Store.WORKER_LOST, Store.TOO_MANY})
