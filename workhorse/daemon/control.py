"""Celery's broadcast mailbox, answered on a thread and a broker connection of its own.

Who owns what: the control thread owns its kombu connection, the ``celery.pidbox`` fanout
queue ``<hostname>.celery.pidbox`` it consumes (kombu's ``pidbox.Node`` speaks the
protocol) and the replies it publishes. What a reply is made of is read on the loop
thread: the control thread posts a closure through a wakeup pipe the loop watches, and
waits at most ``ASK_TIMEOUT`` for the snapshot (``WorkerView``); the loop never waits on the
control thread, a client or the broker. A malformed command is logged and dropped.

Forks: the loop thread forks children only while this thread is ``parked`` (as the broker
thread's): its gate is held while it connects, publishes a reply or reads a polled broker
(SQLite), and released only while it waits in select() or sleeps between polls (its consumer
takes no acks, so a child forked meanwhile inherits no message to give back).
"""
from __future__ import annotations

import contextlib
import logging
import queue
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from kombu import pidbox
from kombu.exceptions import InconsistencyError

from ..control.commands import ACTIONS, Steerable
from ..control.events import Clock
from ..control.inspect import COMMANDS, WorkerView
from .service import ServiceThread, describe

if TYPE_CHECKING:
    from ..app import App
    from ..backends import Backend

T = TypeVar("T")

log = logging.getLogger("workhorse.control")

#: How long a command waits for the loop thread's snapshot before it answers an error.
ASK_TIMEOUT = 5.0
#: A (re)connecting control thread sends itself this note until one comes back (every
#: ``NOTE_INTERVAL``, at most ``LISTEN_TIMEOUT``): then a command sent to it is not missed.
LISTENING_NOTE = "workhorse_listening"
NOTE_INTERVAL = 0.1
LISTEN_TIMEOUT = 5.0


class ControlThread(ServiceThread):
    """Answers ``celery inspect/control`` and ``workhorse inspect/control`` for the
    supervisor."""

    name = "remote control"

    def __init__(self, app: App, hostname: str, view: Callable[[], WorkerView],
                 steerable: Steerable, revokes_read: Callable[[Mapping[str, float]], None],
                 where: str, clock: Clock | None = None) -> None:
        super().__init__(log)
        self.clock = clock or Clock()           # moved past each command's
        self.app = app
        self.where = where              # the broker, for logs (password hidden)
        self.hostname = hostname
        self.view = view
        self.steerable = steerable              # used on the loop thread only
        self._revokes_read = revokes_read       # loop thread's
        self._store: Backend | None = None      # this thread's own result store object
        self.mailbox = pidbox.Mailbox("celery", type="fanout", accept=["json"],
                                      serializer="json")
        #: True while a polled broker is read with the gate held (a reply made then
        #: must not take it again).
        self.reading = False

    # ------------------------------------------------------------------ the thread
    def finish(self) -> None:
        if self._store is not None:
            self._store.close()

    def serve(self) -> None:
        with self.app.connection() as connection:
            connection.ensure_connection(max_retries=connection.retries(2))
            channel = connection.channel()
            mailbox = self.mailbox(connection)
            node = _Node(self, mailbox, channel)
            try:
                # Commands sent while this worker was away (a stored mailbox queue:
                # SQLite) are not for it: a restart must not replay them.
                node.listen(channel).purge()
            except Exception as exc:
                # The revokes kept in the store still count (the loop waits for them).
                self._load_revoked()
                if isinstance(exc, InconsistencyError) or "RESOURCE_LOCKED" in str(exc):
                    raise RuntimeError(
                        f"another worker named {self.hostname} answers its mailbox already; "
                        "give each worker a name of its own (hostname, -n)") from exc
                raise
            # Listening first: a revoke sent from now on reaches this worker, one sent
            # before is in the store; the log line before the revokes reach the loop (the
            # worker says it is ready only then).
            self._confirm_listening(connection, mailbox, node)
            log.info("remote control: answering on %s as %s", self.where, self.hostname)
            self._load_revoked()
            while not self.stopping:
                self._wait(connection, 1.0)

    def _wait(self, connection: Any, timeout: float) -> None:
        """Deliver the commands that come within ``timeout``, parked while nothing runs.

        A broker whose connection waits in select() (Redis, RabbitMQ) is waited on parked.
        A polled one (SQLite: kombu's virtual transport reads the file every
        ``polling_interval`` while it "waits") is read with the gate held and slept on
        parked: a child forked while this thread is inside SQLite inherits SQLite's
        process-wide locks held, and hangs for good in its first ``sqlite3.connect``
        (the result it was about to store, and the worker's slot, with it)."""
        interval = getattr(connection.transport, "polling_interval", None)
        if interval is None:
            self.gate.release()
            try:
                connection.drain_events(timeout=timeout)
            except TimeoutError:
                pass
            finally:
                self.gate.acquire()
            return
        deadline = time.monotonic() + timeout
        while True:
            self.reading = True
            try:
                connection.drain_events(timeout=0)      # one read of the file
                return
            except TimeoutError:
                pass
            finally:
                self.reading = False
            left = deadline - time.monotonic()
            if left <= 0 or self.stopping:
                return
            self.gate.release()
            try:
                self._stopping.wait(min(interval, left))
            finally:
                self.gate.acquire()

    def _confirm_listening(self, connection: Any, mailbox: pidbox.Mailbox, node: _Node
                           ) -> None:
        """Return once a command sent now reaches this worker, or after ``LISTEN_TIMEOUT``.

        On Redis the mailbox is pub/sub, and kombu sends its PSUBSCRIBE only when it first
        waits for events: a broadcast published before Redis has the subscription reaches
        no one, and a worker that had said it was ready would miss it. A note to itself,
        sent until one comes back, proves the whole path (RabbitMQ's and SQLite's mailboxes
        are queues, declared already: the first note comes back)."""
        ticket = uuid.uuid4().hex
        node.awaited = ticket
        deadline = time.monotonic() + LISTEN_TIMEOUT
        self._wait(connection, 0)               # Redis: subscribes
        while node.awaited is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("remote control: a note sent to its own mailbox did not come "
                            "back within %.0f s; a command sent now may be missed",
                            LISTEN_TIMEOUT)
                node.awaited = None
                return
            mailbox._broadcast(LISTENING_NOTE, {"ticket": ticket}, destination=[self.hostname])
            self._wait(connection, min(left, NOTE_INTERVAL))

    def answer(self, method: str, arguments: dict[str, Any]) -> Any:
        """A command's reply (control thread): an inspect command's from the snapshot asked
        of the loop thread; a control command's from what it did."""
        handler = COMMANDS.get(method)
        if handler is not None:
            return handler(self._on_loop(self.view), **arguments)
        action = ACTIONS.get(method)
        if action is None:
            raise KeyError(f"no such command: {method!r} (this worker answers "
                           f"{', '.join(sorted({*COMMANDS, *ACTIONS}))})")
        with self.holding_gate():       # store I/O: no child is forked meanwhile
            return action(self, **arguments)

    @contextlib.contextmanager
    def holding_gate(self) -> Iterator[None]:
        """The gate, for broker or store I/O; held already while a polled broker is read."""
        if self.reading:
            yield
            return
        with self.gate:
            yield

    def _on_loop(self, function: Callable[[], T]) -> T:
        """Run ``function`` on the loop thread and wait (at most ``ASK_TIMEOUT``) for it."""
        box: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()

        def run() -> None:
            try:
                box.put((True, function()))
            except Exception as exc:  # noqa: BLE001 - the asker gets it, the loop goes on
                box.put((False, exc))
        self.posted.put(run)
        try:
            ok, value = box.get(timeout=ASK_TIMEOUT)
        except queue.Empty:
            raise TimeoutError(f"the supervisor did not answer within {ASK_TIMEOUT} s") from None
        if not ok:
            raise value
        return value

    # ------------------------------------------------------------------ for commands
    def steer(self, function: Callable[[Steerable], T]) -> T:
        return self._on_loop(lambda: function(self.steerable))

    @property
    def store(self) -> Backend:
        if self._store is None:
            self._store = self.app.new_backend()
        return self._store

    def share_revoked(self, entries: Mapping[str, float]) -> None:
        try:
            self.store.save_revoked(entries)
        except Exception as exc:  # noqa: BLE001 - the broadcast still reached who was online
            log.warning("remote control: could not keep %d revoked entries in the result "
                        "store (workers started later will not know them): %s",
                        len(entries), describe(exc))

    def state_of(self, task_id: str) -> str:
        return str(self.store.get_task_meta(task_id)["status"])

    def mark_revoked(self, task_id: str, reason: str) -> None:
        self.store.mark_as_revoked(task_id, reason, request={"hostname": self.hostname})

    def _load_revoked(self) -> None:
        """What was revoked while this worker was away (or before it started). The loop is
        told even when the store cannot be read: it waits for this before it consumes."""
        entries: Mapping[str, float] = {}
        try:
            entries = self.store.load_revoked()
        except Exception as exc:  # noqa: BLE001 - broadcasts still reach it from now on
            log.warning("remote control: could not read the revoked tasks kept in the result "
                        "store: %s", describe(exc))
        else:
            if entries:
                log.info("remote control: %d revoked entries read from the result store",
                         len(entries))
        self.posted.put(lambda: self._revokes_read(entries))


class _Node(pidbox.Node):
    """kombu's mailbox node, dispatching to ``ControlThread.answer`` under its gate."""

    def __init__(self, owner: ControlThread, mailbox: pidbox.Mailbox, channel: Any) -> None:
        super().__init__(owner.hostname, mailbox=mailbox, channel=channel)
        self.owner = owner
        #: The ticket of the note to itself ``_confirm_listening`` waits for.
        self.awaited: str | None = None

    def dispatch(self, method: str, arguments: Any = None, reply_to: Any = None,
                 ticket: Any = None, **kwargs: Any) -> Any:
        """kombu's, with a failed command logged in one line and answered as an error."""
        try:
            reply = self.owner.answer(method, dict(arguments or {}))
        except Exception as exc:  # noqa: BLE001 - the asker gets the error, we go on
            log.warning("remote control: command %r failed: %s", method, describe(exc))
            reply = {"error": describe(exc)}
        if reply_to:
            self.reply({self.hostname: reply}, exchange=reply_to["exchange"],
                       routing_key=reply_to["routing_key"], ticket=ticket)
        return reply

    def reply(self, data: Any, exchange: str, routing_key: str, ticket: str,
              **kwargs: Any) -> None:
        with self.owner.holding_gate():
            super().reply(data, exchange, routing_key, ticket, **kwargs)

    def handle_message(self, body: Any, message: Any = None) -> Any:
        if (not isinstance(body, dict) or not isinstance(body.get("method"), str)
                or not isinstance(body.get("arguments") or {}, dict)):
            log.warning("remote control: dropped a malformed command: %.200r", body)
            return None
        if body["method"] == LISTENING_NOTE:        # a note to itself, not a command
            if (body.get("arguments") or {}).get("ticket") == self.awaited:
                self.awaited = None
            return None
        sent = (getattr(message, "headers", None) or {}).get("clock")
        if isinstance(sent, int) and not isinstance(sent, bool):
            self.owner.clock.adjust(sent)
        else:
            self.owner.clock.forward()
        try:
            return super().handle_message(body, message)
        except Exception as exc:  # noqa: BLE001 - a bad command never ends the thread
            log.warning("remote control: dropped command %r: %s", body.get("method"),
                        describe(exc))
            return None


