"""The supervisor's schedule thread: sends each periodic task when it is due, with no
leader. Every worker with ``schedules = true`` runs one; each due time is sent by whichever
worker moves its fence first (``workhorse.schedules.fence``), the others are refused.

Who owns what: the thread owns its broker connection (and, on RabbitMQ, a result store
object of its own) and the schedules' state; the loop thread hands it new entries on a
reload (``update``) and gets back what it did (metrics, task-sent events) through
``posted``. Forks: the thread holds its gate whenever it runs broker or store code, and
releases it only while it sleeps (a polled SQLite file is read with the gate held: see
``ControlThread._wait``).
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, UTC
from typing import TYPE_CHECKING, Any

from kombu import Producer

from ..broker.queues import ensure_queue
from ..protocol import NOMINAL_HEADER, SCHEDULE_HEADER, build_message
from ..schedules.entries import Entry, iso
from ..schedules.fence import Fence, fence_for
from ..schedules.plan import plan
from ..transport.fenced import Record, Ticket
from .service import ServiceThread

if TYPE_CHECKING:
    from ..app import App

log = logging.getLogger("workhorse.schedules")

#: The thread looks at the clock at least this often (a clock stepped, a reload).
MAX_SLEEP = 1.0
#: How long a publish waits for the broker (RabbitMQ: its confirm).
PUBLISH_TIMEOUT = 10.0
#: Task ids of sent due times: uuid5 in this namespace of (schedule, nominal time).
NAMESPACE = uuid.UUID("5d0c1f58-8f0a-4b53-9a57-2b8f0f1c7e21")


def task_id_for(name: str, nominal: datetime) -> str:
    """The same for every worker: a due time sent twice anyway has one id, whose stored
    result stops a second run."""
    return str(uuid.uuid5(NAMESPACE, f"{name}\0{iso(nominal)}"))


@dataclass
class Sent:
    """What the thread did for one due time, told to the loop thread."""

    entry: Entry
    nominal: datetime
    task_id: str
    late: float                 # seconds after the nominal time it was sent
    queue: str


@dataclass
class _State:
    entry: Entry
    last: datetime              # the last due time sent (by anyone), or when first seen
    record: Record | None
    next_due: datetime


class ScheduleThread(ServiceThread):
    name = "schedules"

    def __init__(self, app: App, hostname: str, entries: Sequence[Entry],
                 on_sent: Callable[[Sent], None], on_skipped: Callable[[Entry, int], None],
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(log)
        self.app = app
        self.hostname = hostname
        self.on_sent = on_sent            # run on the loop thread (posted)
        self.on_skipped = on_skipped
        self.clock = clock
        self._entries: list[Entry] = list(entries)
        self._changed = threading.Event()
        self._changed.set()
        self._states: dict[str, _State] = {}
        self._queues_ready: set[str] = set()

    # ------------------------------------------------------------------ loop thread's API
    def update(self, entries: Sequence[Entry], app: App) -> None:
        """A reload: these entries from now on (their fences stay: a changed entry goes
        on from the last due time sent under its name), and the reloaded app's queues."""
        self.app = app
        self._entries = list(entries)
        self._changed.set()

    def stop(self, timeout: float) -> None:
        self._stopping.set()
        self._changed.set()             # out of its sleep now
        super().stop(timeout)

    # ------------------------------------------------------------------ the thread
    def serve(self) -> None:
        with self.app.connection() as connection:
            connection.ensure_connection(max_retries=connection.retries(2))
            fence = fence_for(connection, self.app.new_backend())
            if fence is None:       # (the worker refuses to start so: see cli)
                raise RuntimeError("neither the broker nor the result store can hold the "
                                   "fences of schedules; nothing is sent")
            self._changed.set()         # read the records again on a new connection
            while not self.stopping:
                if self._changed.is_set():
                    self._changed.clear()
                    self._load(fence)
                now = self.clock()
                for state in list(self._states.values()):
                    if state.next_due.timestamp() <= now:
                        self._due(fence, connection, state)
                self._sleep()

    def _sleep(self) -> None:
        now = self.clock()
        wake = min((s.next_due.timestamp() for s in self._states.values()), default=now + 60)
        self.gate.release()
        try:
            self._changed.wait(min(max(wake - now, 0.0), MAX_SLEEP))
        finally:
            self.gate.acquire()

    def _load(self, fence: Fence) -> None:
        entries = {entry.name: entry for entry in self._entries}
        records = fence.records(entries)
        now = datetime.fromtimestamp(self.clock(), UTC)
        states: dict[str, _State] = {}
        for name, entry in entries.items():
            old = self._states.get(name)
            record = records.get(name)
            last = now if old is None else old.last
            if record is not None:
                last = datetime.fromtimestamp(record.nominal, UTC)
            # Due now or soon: looked at in this turn (planned from the last one sent).
            states[name] = _State(entry, last, record,
                                  entry.timing.next_after(last - timedelta(microseconds=1))
                                  if record is not None or old is not None
                                  else entry.timing.next_after(now))
        self._states = states

    def _due(self, fence: Fence, connection: Any, state: _State) -> None:
        entry = state.entry
        for orphan in fence.orphans(entry.name):
            nominal = datetime.fromtimestamp(orphan.nominal, UTC)
            if fence.resend(entry.name, orphan, self.hostname,
                            self._publisher(connection, entry, nominal, orphan.task_id)):
                log.warning("schedule %s: the due time %s was moved by %s, which stopped "
                            "before the broker confirmed it: sent now", entry.name,
                            iso(nominal, entry.tz), orphan.by)
        now = datetime.fromtimestamp(self.clock(), UTC)
        found = plan(entry.timing, entry.catchup, entry.misfire_grace, state.last, now)
        if len(found.send) > 1 or found.skipped or found.skipped_beyond_grace:
            # A catch-up: first what the others did meanwhile (one read, not a refused
            # send per due time).
            record = fence.records([entry.name]).get(entry.name)
            if record is not None:
                state.record = record
                state.last = max(state.last, datetime.fromtimestamp(record.nominal,
                                                                    UTC))
            found = plan(entry.timing, entry.catchup, entry.misfire_grace, state.last, now)
        skipped = len(found.skipped) + found.skipped_beyond_grace
        if skipped:
            log.warning("schedule %s: %d due time%s missed (catchup = %s, misfire_grace = "
                        "%g s): not sent%s", entry.name, skipped, "s" if skipped > 1 else "",
                        entry.catchup, entry.misfire_grace,
                        f"; the last of them {iso(found.skipped[-1], entry.tz)}"
                        if found.skipped else "")
            self.posted.put(lambda: self.on_skipped(entry, skipped))
        for nominal in found.send:
            self._send(fence, connection, state, nominal)
        if found.skipped:
            state.last = max(state.last, found.skipped[-1])
        state.next_due = entry.timing.next_after(max(now, state.last))

    def _queue(self, entry: Entry) -> str:
        return entry.queue or self.app.settings.queues[0]

    def _publisher(self, connection: Any, entry: Entry, nominal: datetime,
                   task_id: str) -> Callable[[], None]:
        """Publishes ``entry``'s task for the due time ``nominal``."""
        queue = self._queue(entry)
        headers = {SCHEDULE_HEADER: entry.name, NOMINAL_HEADER: iso(nominal, entry.tz)}
        expires = None if entry.expires is None else nominal + timedelta(seconds=entry.expires)
        message = build_message(entry.task, task_id, list(entry.args), dict(entry.kwargs),
                                expires=expires, extra_headers=headers)
        properties = dict(message.properties)
        properties.pop("expiration", None)

        def publish() -> None:
            if queue not in self._queues_ready:
                ensure_queue(connection, queue, self.app.queue_type(queue))
                self._queues_ready.add(queue)
            Producer(connection).publish(
                message.body, exchange="", routing_key=queue, serializer="json",
                headers=message.headers, priority=entry.priority, delivery_mode=2,
                retry=False, timeout=PUBLISH_TIMEOUT, **properties)
        return publish

    def _send(self, fence: Fence, connection: Any, state: _State, nominal: datetime) -> None:
        entry = state.entry
        task_id = task_id_for(entry.name, nominal)
        record = Record(nominal.timestamp(), task_id, self.hostname, self.clock())
        queue = self._queue(entry)
        publish = self._publisher(connection, entry, nominal, task_id)
        try:
            holder = fence.send(Ticket(entry.name, record), publish, state.record)
        except Exception as exc:
            log.error("schedule %s: could not send the due time %s: %r", entry.name,
                      iso(nominal, entry.tz), exc)
            raise
        if holder is None:
            state.record, state.last = record, max(state.last, nominal)
            late = self.clock() - nominal.timestamp()
            log.info("schedule %s: sent %s[%s] due %s (%.3f s late)", entry.name, entry.task,
                     task_id, iso(nominal, entry.tz), late)
            sent = Sent(entry, nominal, task_id, late, queue)
            self.posted.put(lambda: self.on_sent(sent))
            return
        state.record = holder
        state.last = max(state.last, datetime.fromtimestamp(holder.nominal, UTC))
        log.debug("schedule %s: %s sent by %s already", entry.name, iso(nominal, entry.tz),
                  holder.by)
