"""The supervisor: one thread, one loop, and the parts it wires together.

    Holding     every held message by stage; the window's arithmetic     (holding.py)
    Intake      where an arriving message goes; ETA timers                (intake.py)
    Slots       the children: spawn, reap, replace, recycle, time limits  (slots.py)
    Dispatch    buffered messages to idle children; ack at start          (dispatch.py)
    Settlement  store what only the supervisor can, then ack/requeue/DLQ (settlement.py)
    Leases      renew what is held, and idempotency claims                (leases.py)
    BrokerLink  the broker thread, from this side: settle, renew, fetch (broker/link.py)
    Journal     which held messages were started, for whoever finds us dead (broker/)
    Reload      SIGHUP: config and code again; TTIN/TTOU: pool size       (reload.py)
    System      every OS call, the seam for tests without fork            (system.py)

This module keeps the loop, the phases, the ``handle_<signal>`` methods and the order of
shutdown. Signals only wake the loop.
"""
from __future__ import annotations

import contextlib
import enum
import logging
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from kombu.message import Message

from ..app import BROKER_TIMEOUT, result_retry_policy
from ..backends import RetryPolicy
from ..config import Settings
from ..control.events import Clock
from ..control.inspect import TaskInfo, WorkerView
from ..outcome import Outcome, outcome_of
from ..pool.ipc import Done
from ..pool.runtime import ChildRuntime
from ..protocol import HELD_LOSSES_HEADER
from ..sqlitedb import said
from ..schedules.entries import Entry as ScheduleEntry
from ..schedules.entries import entries_for
from ..urls import redact
from . import systemd
from .delivery import Delivery, Stage
from .control import ControlThread
from .current import Current
from .dispatch import Dispatch
from .exitcodes import ExitCode
from .holding import Holding, windows
from .intake import Intake
from ..broker.journal import Entry, Journal, directory_for, message_key
from .leases import Leases
from ..broker.link import BrokerLink
from ..broker.port import BrokerPort
from .loop import Loop
from .reload import Load, Reload
from .events import EventThread, TaskEvents
from .hostfiles import HEALTH_INTERVAL, health_path, write_health
from ..logs import reopen_logfile
from .metrics import Metrics, MetricsServer
from .autoscale import Autoscaler, STEP as AUTOSCALE_STEP, clamp, load
from .backlog import BacklogThread
from .schedules import ScheduleThread, Sent
from .service import ServiceThread
from .steering import Steering
from .settlement import Settlement
from .signals import SignalPipe
from .slots import BLOCK_CHECK, Recycling, Slots
from .system import System

if TYPE_CHECKING:
    from ..app import App

log = logging.getLogger("workhorse.supervisor")

#: Every signal an operator sends whose default action would kill or stop the daemon, and
#: SIGCHLD. Not ABRT (systemd's watchdog uses it to kill a hung service), SEGV or BUS.
HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGCHLD,
                   signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGTTIN,
                   signal.SIGTTOU, signal.SIGTSTP)

#: How often the worker deletes expired results from stores that do not expire them.
RESULT_PURGE_INTERVAL = 300.0
#: While stopping: how often STATUS= and EXTEND_TIMEOUT_USEC= go to systemd.
STOP_STATUS_INTERVAL = 5.0
#: How often STATUS= is brought up to date with the SQLite files' troubles.
TROUBLES_CHECK = 1.0
#: How often the loop's lag is measured (metrics).
LAG_INTERVAL = 1.0
#: How often idle children's memory is compared with max_memory_per_child.
IDLE_MEMORY_CHECK = 2.0
#: How long a starting worker waits for remote control to read the revokes kept in the
#: result store before it consumes anyway (a revoked task it takes meanwhile would run).
REVOKES_READ_WAIT = 10.0
#: After a freeze (RabbitMQ): a connection check not answered in this long is asked again
#: (starts wait for it all the while).
CHECK_ANSWER_WAIT = 10.0


class Phase(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    WARM = "warm shutdown"     # no new work; running tasks finish
    COLD = "cold shutdown"     # running tasks are killed
    STOPPED = "stopped"


# Read for every task (see workhorse/outcome.py on Enum attributes).
_RUNNING, _WARM, _COLD, _STOPPED = Phase.RUNNING, Phase.WARM, Phase.COLD, Phase.STOPPED
_NOT_RUN, _CLAIMED_ELSEWHERE = Outcome.NOT_RUN, Outcome.CLAIMED_ELSEWHERE


class Supervisor:
    def __init__(self, app: App, settings: Settings, system: System | None = None,
                 reload: Load | None = None, link: BrokerPort | None = None) -> None:
        #: The app and settings in force; a reload replaces both.
        self.current = Current(app, settings)
        self.hostname: str = settings.hostname
        self.system = system or System()
        # What is open now belongs to the process that started us; what the supervisor
        # opens from here on (its signal pipe, selector, broker sockets) children close.
        self.system.mark_fds()
        self.phase = Phase.STARTING
        self.exit_code: int = ExitCode.OK
        self._interrupts = 0
        self._purging = False       # a purge of expired results runs on its own thread
        self.loop = Loop(self.system.monotonic, self.system.boottime)
        self.signals = SignalPipe(HANDLED_SIGNALS)
        size = clamp(settings.concurrency, settings.autoscale)
        self.holding = Holding(*windows(size, settings.prefetch_multiplier,
                                        settings.async_concurrency, app.tasks.values()))
        self.link: BrokerPort = link or BrokerLink(
            app, list(settings.queues), self.loop, self.receive, self._connected,
            self._broker_lost, self._gave_up,
            lambda: max(self.holding.window, self.holding.async_window),
            settings.broker_connection_max_retries,
            settings.broker_connection_retry_on_startup, self._acked_running)
        self.settlement = Settlement(self.current, self.link, self.loop, self.holding,
                                     self.hostname, result_retry_policy(settings),
                                     self._no_less_room)
        self.intake = Intake(self.current, self.loop, self.holding, self.settlement,
                             self.system.monotonic, self.system.now, self._changed,
                             self._accepting)
        self.slots = Slots(size, self.system, self.loop, self._make_runtime,
                           self, Recycling(settings.max_tasks_per_child,
                                           settings.max_memory_per_child), self._accepting,
                           max_boot_failures=settings.max_boot_failures,
                           may_fork=self._may_fork)
        self.slots.loop_block_limit = settings.loop_block_limit
        self.leases = Leases(self.current, self.link, self.holding,
                             settings.visibility_timeout, self._changed, self.system.monotonic)
        owner = f"{self.hostname}:{self.system.getpid()}"     # (getpid is a system call)
        self.dispatch = Dispatch(self.current, self.holding, self.intake, self.slots,
                                 self.link, self._accepting, self._no_less_room,
                                 lambda seq: f"{owner}:{seq}",
                                 self.loop, self.system.monotonic)
        self.dispatch.renew_now = self.leases.renew_now
        self.dispatch.check_connection = self._check_connection
        self._asked_check = 0.0     # when the last connection check was asked (loop clock)
        self.reloading = Reload(self.current, reload, self.slots, self.holding,
                                self.settlement, self.system.monotonic, self._changed)
        #: The worker's Lamport clock (events tick it; remote-control commands move it).
        self.clock = Clock()
        #: Celery's event stream; task events are off until send_events or enable_events.
        self.events = (EventThread(app, self.hostname, self._load, settings.send_events,
                                   settings.heartbeat_events, self.clock)
                       if settings.send_events or settings.heartbeat_events
                       or settings.remote_control else None)
        self.intake.events = self.dispatch.events = self.settlement.events = TaskEvents(
            self.events)
        steering = Steering(self.current, self.intake, self.holding, self.slots,
                            self.reloading, self.warm_shutdown, self.events, self.link)
        self.control = (ControlThread(app, self.hostname, self._worker_view, steering,
                                      self._revokes_read, redact(settings.broker_url),
                                      self.clock)
                        if settings.remote_control else None)
        #: Nothing is consumed until the revokes kept in the result store are known, so a
        #: worker started after a revoke never runs the revoked task (as Celery's mingle).
        self._revokes_known = self.control is None
        #: "ready" is said once per broker connection, when it is consuming (connected,
        #: and the revokes known: remote control answers by then).
        self._ready_said = False
        #: Was the last lost connection a file's trouble said already (sqlitedb.troubles)?
        #: Then being ready again is said quietly too: a full disk is one line, not a pair
        #: of them per reconnect.
        self._lost_quietly = False
        #: Prometheus metrics, when served.
        self.metrics: Metrics | None = None
        self.metrics_server: MetricsServer | None = None
        #: What the consumed queues hold, read from the broker (metrics, /scale, autoscale).
        self.backlog = (BacklogThread(app, lambda: tuple(self.link.queues))
                        if settings.metrics_port or settings.autoscale else None)
        self.autoscaler = (Autoscaler(settings.autoscale[0], settings.autoscale[1],
                                      settings.autoscale_target_age, settings.autoscale_idle)
                           if settings.autoscale else None)
        if settings.metrics_port:
            self.metrics = Metrics(self._held_by_stage, lambda: self.leases.renewed,
                                   self.scale_view)
            self.settlement.metrics = self.dispatch.metrics = self.metrics
            self.slots.on_child_exit = self.metrics.child_exited
            self.metrics_server = MetricsServer(self.metrics, settings.metrics_port,
                                                settings.metrics_bind)
        #: The threads with broker connections of their own, besides the broker thread's.
        self.services: list[ServiceThread] = [s for s in (self.control, self.events,
                                                          self.backlog) if s]
        #: Sends the periodic tasks (while there are entries and schedules = true).
        self.schedules: ScheduleThread | None = None
        self._schedules_reloaded(settings, app)
        self.reloading.on_reloaded = self._schedules_reloaded
        self.started_at = self.system.monotonic()
        #: Tasks finished by this worker, by name (``inspect stats``).
        self.totals: Counter[str] = Counter()
        self.processed = 0
        self.health_file = health_path(settings.state_dir, self.hostname)
        self._health_failed = False
        #: Which held messages were started, for whoever finds this worker dead (opened
        #: in ``run``, before the broker thread takes anything).
        self.journal: Journal | None = None

    @property
    def app(self) -> App:
        return self.current.app

    @property
    def settings(self) -> Settings:
        return self.current.settings

    # ------------------------------------------------------------------ schedules
    def _schedules_reloaded(self, settings: Settings, app: App) -> None:
        """At start and after each reload: the entries to send, if this worker sends."""
        entries = (entries_for(settings.schedule, app.celery_schedule)
                   if settings.schedules else [])
        if self.schedules is not None:
            self.schedules.update(entries, app)
        elif entries:
            self.schedules = ScheduleThread(app, self.hostname, entries, self._schedule_sent,
                                            self._schedule_skipped)
            self.services.append(self.schedules)
            if self.phase is Phase.RUNNING:     # (else run() starts it with the others)
                self.schedules.start(self.loop)

    def _schedule_sent(self, sent: Sent) -> None:
        if self.metrics is not None:
            self.metrics.schedule_sent(sent.entry.name, sent.late)
        entry = sent.entry
        if self.events is None:
            return
        self.events.task("task-sent", uuid=sent.task_id, name=entry.task,
                         args=repr(tuple(entry.args)), kwargs=repr(dict(entry.kwargs)),
                         retries=0, eta=None, expires=None, queue=sent.queue, exchange="",
                         routing_key=sent.queue, root_id=sent.task_id, parent_id=None)

    def _schedule_skipped(self, entry: ScheduleEntry, count: int) -> None:
        if self.metrics is not None:
            self.metrics.schedule_skipped(entry.name, count)

    # ------------------------------------------------------------------ running
    def _accepting(self) -> bool:
        return self.phase is _RUNNING

    def _no_less_room(self) -> None:
        """Something held changed, and the room cannot be less for it: a settlement freed a
        place in the window or kept one held while its result is stored; an ack at start
        went out, or came back (its message stays held, waiting for a child, or leaves).
        Where the broker side acts on the room only before the loop waits, the next turn's
        ``_changed`` says it, and asks for the acks it finds waiting (one room update a
        turn, not two or three a task); a decrease (a pause, a smaller window, a stop) is
        always said at once. RabbitMQ's credit, which an ack at start shrinks before the
        ack goes, is said at once (it is not read before the wait)."""
        if not self.link.room_read_before_wait:
            self._changed()

    def _changed(self) -> None:
        """Something held changed: the broker's credit and the broker thread's room follow."""
        now = self.system.monotonic()
        if self.link.push:          # only a broker that pushes (RabbitMQ) has a credit
            self.link.set_credit(self.holding.credit(now))
        holding = self.holding
        free = holding.room()
        # Starved: nothing is buffered, or what is must wait (a rate limit) and the last
        # dispatch left a child idle.
        self.link.set_room(free if self._accepting() and self._revokes_known
                           and now >= holding.paused_until else 0,
                           starved=not holding.buffer or self.dispatch.left_idle)

    def run(self) -> int:
        """Run until shut down; return the process exit status."""
        self.system.guard_descendants()
        self.signals.install()
        self.loop.add_reader(self.signals.read_fd, self._on_signals)
        # One attempt per call: transient store errors are retried from loop timers
        # (Settlement), never by sleeping in the loop. Children get their own backend after
        # fork, with the configured retries.
        self.app.backend.retry_policy = RetryPolicy(always_retry=False)
        try:
            _log_banner(self.current, self.holding)
            self._open_journal()
            self.slots.spawn_all()
            self._start_timers()
            self.phase = Phase.RUNNING
            self.link.start()           # connects on its own thread, with back-off
            for service in self.services:
                service.start(self.loop)
            self._serve_metrics()
            systemd.notify(f"READY=1\nSTATUS=connecting to the broker at {self.link.where}")
            while self.phase is not _STOPPED:
                self._changed()
                self.loop.run_once()
                self._after_events()
        except BaseException:
            log.critical("supervisor failed; killing children, unsettled messages go back "
                         "to the broker", exc_info=True)
            self.slots.kill_now()
            self.exit_code = ExitCode.FAILURE
        finally:
            for service in self.services:
                service.stop(timeout=BROKER_TIMEOUT)
            if self.metrics_server is not None:
                self.metrics_server.stop()
            with contextlib.suppress(OSError):
                self.health_file.unlink()
            self.link.close(timeout=BROKER_TIMEOUT)
            if self.journal is not None:
                # Everything held was settled or handed back: nothing to recover from it.
                self.journal.close(remove=not self.holding.inbox
                                   and not self.holding.unsettled())
            self.signals.restore()
            self.loop.close()
            self.system.close()
        log.info("workhorse %s stopped", self.hostname)
        return self.exit_code

    def _open_journal(self) -> None:
        """The journal, in ``<state_dir>/journal/<broker>/``; without one (the directory
        cannot be written), a death of this worker counts every message it held as a
        delivery, as its take counted it."""
        s = self.settings
        directory = directory_for(s.state_dir, redact(s.broker_url))
        try:
            journal = Journal.create(directory, self.hostname, self._journal_entries)
        except OSError as exc:
            log.warning("journal: cannot write in %s (%s); a death of this worker will count "
                        "every message it holds as a delivery, started or not", directory, exc)
            return
        self.journal = self.dispatch.journal = journal
        self.link.use_journal(journal)
        self.loop.before_wait(journal.flush)

    def _journal_entries(self) -> Iterator[Entry]:
        """What the journal says when it is written afresh: each held message (named on
        arrival where its lease carries no owner), and which were started and are over."""
        arrivals = self.link.push
        for delivery in self.holding.all():
            if delivery.key is not None and not delivery.acked:
                yield delivery.key, arrivals, delivery.started, delivery.done is not None
        if arrivals:
            for _, message, _ in self.holding.inbox:
                key = message_key(message, leased=False)
                if key is not None:
                    yield key, True, False, False

    def _acked_running(self) -> int:
        """How many of the window's running messages may be acked already: every child's,
        where some task acks at start (read at each connect: a reload that changes it
        takes effect with the next connection)."""
        settings, tasks = self.settings, self.app.tasks.values()
        early = not settings.acks_late or any(
            getattr(task, "acks_late", None) is False for task in tasks)
        return self.slots.size if early else 0

    @contextlib.contextmanager
    def _may_fork(self) -> Iterator[bool]:
        """Fork only while neither the broker thread nor a service thread is mid-call."""
        with contextlib.ExitStack() as stack:
            free = stack.enter_context(self.link.parked())
            for service in self.services:
                free = stack.enter_context(service.parked()) and free
            yield free

    def _revokes_read(self, entries: Mapping[str, float]) -> None:
        """Remote control read the revokes kept in the result store (or could not)."""
        self.intake.revoked.merge(entries)
        if not self._revokes_known:
            self._revokes_known = True
            self._say_ready()
            self._changed()

    def _revokes_overdue(self) -> None:
        if not self._revokes_known:
            log.warning("remote control has not read the revoked tasks kept in the result "
                        "store within %.0f s; consuming anyway (a task revoked while this "
                        "worker was away may run)", REVOKES_READ_WAIT)
            self._revokes_read({})

    def scale_view(self) -> dict[str, Any]:
        """What ``/scale`` shows (read on the metrics server's threads: copies and lengths
        only): the consumed queues' backlog as the backlog thread last read it, the
        messages held until due, this worker's slots, and the load (``autoscale.load``)."""
        settings = self.settings
        scheduled = Counter(d.queue for d in list(self.holding.scheduled))
        view = self.backlog.view if self.backlog is not None else None
        known = view is not None and view.fresh(self.system.monotonic())
        queues: dict[str, dict[str, Any]] = {}
        for name in {*tuple(self.link.queues), *scheduled}:
            found = view.queues.get(name) if view is not None and known else None
            queues[name] = {"ready": found.ready if found else None,
                            "oldest_age": round(found.oldest_age, 3)
                            if found and found.oldest_age is not None else None,
                            "oldest_age_estimated": found.estimated if found else None,
                            "consumers": found.consumers if found else None,
                            "scheduled": scheduled.get(name, 0)}
        busy, total = self.slots.running, self.slots.size
        ready = view.ready if view is not None and known else 0
        oldest = view.oldest_age if view is not None and known else None
        return {"worker": self.hostname, "queues": queues, "backlog_known": known,
                "ready": ready if known else None,
                "oldest_age": round(oldest, 3) if oldest is not None else None,
                "scheduled": sum(scheduled.values()),
                "slots": {"busy": busy, "total": total},
                "autoscale": list(settings.autoscale) if settings.autoscale else None,
                "target_age": settings.autoscale_target_age,
                "load": load(busy, total, ready, oldest, settings.autoscale_target_age)}

    def _autoscale(self) -> None:
        """Every second with ``autoscale``: the pool one child bigger, smaller, or as it is."""
        scaler, backlog = self.autoscaler, self.backlog
        if scaler is None or backlog is None or not self._accepting():
            return
        now = self.system.monotonic()
        view = backlog.view
        if not view.fresh(now):
            return
        size = self.slots.size
        idle = sum(1 for _ in self.slots.idle())
        wanted = scaler.decide(now, size, idle, view.ready, view.oldest_age, view.taken_at)
        if wanted != size:
            age = view.oldest_age
            oldest = "unknown" if age is None else f"{age:.1f} s old"
            self.reloading.resize(wanted, f"autoscale ({view.ready} ready, the oldest "
                                          f"{oldest})")

    def _held_by_stage(self) -> dict[str, int]:
        """Read on the metrics thread: lengths only, a gauge's worth."""
        h = self.holding
        return {"buffered": len(h.buffer) + len(h.inbox), "scheduled": len(h.scheduled),
                "running": len(h.running) + len(h.acking), "storing": len(h.storing)}

    def _lag(self, due: float) -> None:
        """Every LAG_INTERVAL: how late the loop ran this timer."""
        now = self.system.monotonic()
        assert self.metrics is not None
        self.metrics.loop_lag = max(0.0, now - due)
        if self.phase is not Phase.STOPPED:
            self.loop.call_at(now + LAG_INTERVAL, lambda: self._lag(now + LAG_INTERVAL))

    def _load(self) -> tuple[int, int]:
        """(running, finished) for worker heartbeats (read on the events thread: a gauge)."""
        return len(self.holding.running), self.processed

    def _worker_view(self) -> WorkerView:
        """What ``inspect`` replies are made of (loop thread; the control thread asks)."""
        s = self.settings
        now, wall = self.system.monotonic(), time.time()
        running = {id(r.delivery): (child, r) for child in self.slots.children()
                   for r in child.jobs.values()}
        by_stage: dict[Stage, list[TaskInfo]] = {Stage.RUNNING: [], Stage.BUFFERED: [],
                                                 Stage.SCHEDULED: []}
        for delivery in self.holding.all():
            stage = Stage.RUNNING if delivery.stage is Stage.ACKING else delivery.stage
            if stage in by_stage:
                by_stage[stage].append(_task_info(delivery, running.get(id(delivery)),
                                                  now, wall))
        return WorkerView(
            hostname=self.hostname, pid=os.getpid(), uptime=now - self.started_at,
            tasks=sorted(self.app.tasks), queues=list(self.link.queues),
            active=by_stage[Stage.RUNNING], reserved=by_stage[Stage.BUFFERED],
            scheduled=by_stage[Stage.SCHEDULED], totals=dict(self.totals),
            concurrency=self.slots.size, child_pids=[c.pid for c in self.slots.children()],
            max_tasks_per_child=s.max_tasks_per_child,
            time_limits=(s.soft_time_limit, s.time_limit), prefetch_count=self.holding.window,
            broker=redact(s.broker_url), revoked=self.intake.revoked.ids(),
            settings={name: (redact(v) if isinstance(v, str) else v)
                      for name, v in s.as_dict().items()},
            task_objects=dict(self.app.tasks), clock=self.clock.value,
            celery_conf=self.app.celery_conf)

    def _serve_metrics(self) -> None:
        if self.metrics_server is None:
            return
        try:
            self.metrics_server.start()
        except OSError as exc:
            # Tasks matter more than their metrics: run on, saying so loudly.
            log.error("metrics: cannot serve on %s:%d (%s); running without metrics",
                      self.metrics_server.bind, self.metrics_server.port, exc)
            return
        due = self.system.monotonic() + LAG_INTERVAL
        self.loop.call_at(due, lambda: self._lag(due))

    def _write_health(self) -> None:
        """Every HEALTH_INTERVAL, from the loop: ``workhorse health`` reads it."""
        try:
            write_health(self.health_file, phase=self.phase.value,
                         broker_thread=self.link.healthy(), connected=self.link.connected,
                         broker=self.link.describe())
            self._health_failed = False
        except OSError as exc:
            if not self._health_failed:     # once, not every two seconds
                log.warning("cannot write the health file %s (%s); workhorse health will "
                            "report this worker unhealthy", self.health_file, exc)
            self._health_failed = True

    def _start_timers(self) -> None:
        s = self.settings
        if not self._revokes_known:
            self.loop.call_later(REVOKES_READ_WAIT, self._revokes_overdue)
        self._write_health()
        self._every(HEALTH_INTERVAL, self._write_health)
        if s.max_memory_per_child:
            self._every(IDLE_MEMORY_CHECK, self.slots.check_idle_memory)
        self._every(self.leases.interval, self.leases.renew)
        self._every(TROUBLES_CHECK, self.link.say_troubles)
        self._every(min(60.0, s.rabbitmq_consumer_timeout / 8), self._refresh_scheduled)
        if hasattr(self.app.backend, "purge_expired"):
            self._every(RESULT_PURGE_INTERVAL, self._purge_results)
        if self.autoscaler is not None:
            self._every(AUTOSCALE_STEP, self._autoscale)
        if self.holding.async_window:
            self._every(BLOCK_CHECK, self.slots.check_loops)
        watchdog = systemd.watchdog_interval()
        if watchdog:
            self._every(watchdog, self._ping_watchdog)

    def _every(self, interval: float, function: Callable[[], None]) -> None:
        """Call ``function`` every ``interval`` s until the supervisor stops."""
        self.loop.every(interval, function, lambda: self.phase is not Phase.STOPPED)

    def _ping_watchdog(self) -> None:
        """Only while the loop turns (this is its timer) and the broker thread does too:
        connected, or retrying a broker that is down. One that hangs lets systemd
        restart us."""
        if self.link.healthy():
            systemd.notify("WATCHDOG=1")
        else:
            log.critical("%s: watchdog not pinged", self.link.describe())

    def _refresh_scheduled(self) -> None:
        if self.link.push:
            self.intake.refresh_scheduled(self.settings.rabbitmq_consumer_timeout)

    def _purge_results(self) -> None:
        backend = self.app.backend
        if not getattr(backend, "calls_block", False):
            self._purge(backend)
        elif not self._purging:
            # A database over the network may be slow or down: the loop never waits on it.
            self._purging = True
            threading.Thread(target=self._purge_apart, name="result-purge", daemon=True).start()

    def _purge_apart(self) -> None:
        try:
            self._purge(self.app.new_backend())
        except Exception as exc:  # noqa: BLE001 - said; the next purge tries again
            log.warning("result store: expired results not purged: %r", exc)
        finally:
            self._purging = False

    @staticmethod
    def _purge(backend: Any) -> None:
        removed = backend.purge_expired()
        if removed:
            log.info("result store: %d expired results deleted", removed)

    # ------------------------------------------------------------------ broker
    def receive(self, queue: str, message: Message, deliveries: int) -> None:
        """The broker thread hands over a raw message (the child decodes the body) and its
        delivery count; it is looked at after this turn's events. RabbitMQ's deliveries
        carry no owner mark: the journal names them as they arrive."""
        self.holding.inbox.append((queue, message, deliveries))
        if self.backlog is not None:
            self.backlog.taken(queue, message)
        if self.journal is not None and self.link.push:
            key = message_key(message, leased=False)
            if key is not None:
                self.journal.arrived(key)

    def _connected(self) -> None:
        if self.metrics is not None:
            self.metrics.broker_connections += 1
        self._ready_said = False
        # What is buffered from now on came through this connection: a check of the
        # old one (after a freeze) holds nothing back any more.
        self.dispatch.checking = False
        self._say_ready()
        self.leases.renew()         # before the new connection's sweep can take our leases
        self._changed()

    def _say_ready(self) -> None:
        if self.link.connected and self._revokes_known and not self._ready_said:
            self._ready_said = True
            (log.debug if self._lost_quietly else log.info)(
                "ready: consuming %s", ", ".join(self.link.queues))

    def _broker_lost(self, exc: BaseException) -> None:
        """Running tasks go on; what is only buffered or scheduled is the broker's again if
        the broker took it back (RabbitMQ does when a connection closes; SQLite and Redis
        keep our leases, which we go on renewing). The broker thread reconnects."""
        dropped = 0
        if self.link.push:
            waiting = self.holding.take_waiting()
            if self.journal is not None:    # they come back marked redelivered: held, not run
                self.journal.note_returned(key for key in (
                    *(d.key for d in waiting if not d.acked),
                    *(message_key(m, leased=False) for _, m, _ in self.holding.inbox))
                    if key is not None)
            dropped = len(waiting) + len(self.holding.inbox)
            self.holding.inbox.clear()
        # A broker file's trouble is said once by itself (sqlitedb.troubles), not each loss.
        self._lost_quietly = said(exc)
        (log.debug if self._lost_quietly else log.error)(
            "broker connection lost (%r): %d running tasks go on%s; reconnecting",
            exc, self.slots.running,
            f", {dropped} buffered or scheduled messages are back with the broker"
            if dropped else "")

    def _gave_up(self, exc: BaseException) -> None:
        log.critical("giving up on the broker at %s (%s); stopping with exit status 1",
                     self.link.where, exc)
        self.exit_code = ExitCode.FAILURE
        self.warm_shutdown("the broker cannot be reached")

    # ------------------------------------------------------------------ events
    def _after_events(self) -> None:
        self._accept_received()
        if self.loop.away:      # a wait came back late (frozen): check now, not at a start
            self._check_connection(self.loop.away)
        if self._accepting():
            self.dispatch.dispatch()
        self._maybe_stopped()

    def _check_connection(self, away: float) -> bool:
        """The loop was away ``away`` seconds (frozen: SIGSTOP, a paused VM), the broker
        thread with it: found by a wait that came back that late, or by a message about
        to start in a turn that long. On RabbitMQ the broker may have
        closed the connection meanwhile (a consumer silent past its heartbeat timeout)
        and given what we hold to other consumers: nothing starts until the broker thread
        has read what the connection holds and checked its heartbeats, so that a loss it
        finds takes back the buffered messages first. True: starts wait for that. (SQLite
        and Redis need no check: each start checks its lease, ``Dispatch._must_wait``.)"""
        self.loop.took_away()
        if not self.link.push:
            return False
        if self.dispatch.checking:      # (asked already; it answers for this too)
            return True
        log.warning("the supervisor was away for %.0f s (frozen?): checking the broker "
                    "connection before anything starts", away)
        self._ask_check()
        return True

    def _ask_check(self) -> None:
        """Have the broker thread check the connection; starts wait for its answer, asked
        again every CHECK_ANSWER_WAIT seconds until it comes."""
        self.dispatch.checking = True
        asked = self.loop.clock()

        def checked() -> None:
            self.dispatch.checking = False

        def unanswered() -> None:
            if self.dispatch.checking and self._asked_check == asked:
                log.warning("the broker connection's check is not answered after %.0f s; "
                            "asked again (nothing unleased starts meanwhile)",
                            CHECK_ANSWER_WAIT)
                self._ask_check()
        self._asked_check = asked
        self.link.check_alive(checked)
        self.loop.call_later(CHECK_ANSWER_WAIT, unanswered)

    def _accept_received(self) -> None:
        inbox = self.holding.inbox
        if not self._revokes_known and self._accepting():
            return      # RabbitMQ pushes before we ask: they wait, held, for the revokes
        journal, leased = self.journal, self.link.leased
        if journal is not None:
            journal.flush()     # what arrived is named before anything is read of it
        while inbox:
            queue, message, deliveries = inbox.popleft()
            if not self._accepting():
                self.settlement.give_back(queue, message)   # came after we stopped fetching
                continue
            key = message_key(message, leased)
            if journal is None or key is None:
                self.intake.accept(queue, message, deliveries, key)
            elif HELD_LOSSES_HEADER in (message.headers or ()):
                # Held at an earlier death: should this one kill us while we look at it,
                # the journal names it (and not its neighbours) as the one to count.
                journal.reading(key)
                self.intake.accept(queue, message, deliveries, key)
                journal.done_reading()
            else:
                self.intake.accept(queue, message, deliveries, key)

    # ------------------------------------------------------------------ pool events
    def job_done(self, delivery: Delivery, done: Done) -> None:
        delivery.claim = None       # the child ended it
        delivery.done = done
        if self.journal is not None and delivery.key is not None:
            self.journal.ended(delivery.key)
        self.totals[delivery.request.task] += 1
        self.processed += 1
        if self.metrics is not None and done.runtime is not None:
            self.metrics.ran(delivery.request.task, done.runtime)
        outcome = outcome_of(done.outcome)
        if outcome is _NOT_RUN or (outcome is _CLAIMED_ELSEWHERE and not delivery.acked):
            self._recheck_later(delivery)
        else:
            self.settlement.settle(delivery, outcome, done.detail)

    def job_lost(self, delivery: Delivery, outcome: Outcome, detail: str) -> None:
        self.leases.release_claim(delivery)
        self.settlement.settle(delivery, outcome, detail)

    def children_cannot_boot(self, reason: str) -> None:
        """Replacing children that die in their setup would go on for ever: stop as a warm
        shutdown does (what is held goes back), with the exit status reserved for it."""
        log.critical("%s; stopping with exit status %d", reason, ExitCode.CHILD_BOOT)
        systemd.notify(f"STATUS={reason}")
        self.exit_code = ExitCode.CHILD_BOOT
        self.warm_shutdown("children die before they are ready")

    def _recheck_later(self, delivery: Delivery) -> None:
        """Its child did not run it: an idempotent task's key is held by a run in progress
        elsewhere, or the result store could not be asked. Hold it (not a delivery that
        counts) and look again when that run has ended or its claim lapsed."""
        delivery.started = False
        delay = self.settings.visibility_timeout / 2
        log.info("%s: not run now (its idempotency key is held elsewhere, or the result "
                 "store did not answer); looking again in %.0f s", delivery.label, delay)
        self.intake.schedule(delivery, delay)

    def _make_runtime(self, number: int, read_fd: int, write_fd: int) -> ChildRuntime:
        return ChildRuntime(self.app, number, read_fd, write_fd, self.system.getpid(),
                            self.hostname,
                            measure_memory=bool(self.slots.recycling.max_memory))

    # ------------------------------------------------------------------ signals
    def _on_signals(self) -> None:
        for sig in self.signals.drain():
            handler = getattr(self, f"handle_{sig.name[3:].lower()}", None)
            if handler is not None:
                handler()

    def handle_chld(self) -> None:
        self.slots.reap()

    def handle_term(self) -> None:
        self.warm_shutdown("SIGTERM")

    def handle_int(self) -> None:
        self._interrupts += 1
        if self._interrupts == 1:
            self.warm_shutdown("SIGINT (press Ctrl-C again to stop at once)")
        else:
            self.cold_shutdown("second SIGINT")

    def handle_quit(self) -> None:
        self.cold_shutdown("SIGQUIT")

    def handle_usr1(self) -> None:
        h = self.holding
        log.warning("state: phase=%s held=%d/%d buffered=%d scheduled=%d running=%d "
                    "storing=%d", self.phase.value, h.held, h.window, len(h.buffer),
                    len(h.scheduled), len(h.running), len(h.storing))
        log.warning("  %s", self.link.describe())
        for line in self.slots.describe():
            log.warning("  %s", line)

    def handle_usr2(self) -> None:
        if reopen_logfile():
            log.info("SIGUSR2: log file opened again")
        else:
            log.info("SIGUSR2 received: there is no log file to open again; ignored")

    def handle_tstp(self) -> None:
        log.info("SIGTSTP received: a supervisor does not stop with its terminal; ignored "
                 "(SIGTERM stops it)")

    def handle_ttin(self) -> None:
        if self.phase is Phase.RUNNING:
            self.reloading.resize(self.slots.size + 1, "SIGTTIN")

    def handle_ttou(self) -> None:
        if self.phase is Phase.RUNNING:
            self.reloading.resize(self.slots.size - 1, "SIGTTOU")

    def handle_hup(self) -> None:
        if self.phase is Phase.RUNNING:
            self.reloading.reload()

    # ------------------------------------------------------------------ shutdown
    def warm_shutdown(self, why: str) -> None:
        if self.phase is not Phase.RUNNING:
            return
        h = self.holding
        log.info("warm shutdown (%s): requeueing %d buffered and %d scheduled, waiting up to "
                 "%s s for %d running", why, len(h.buffer), len(h.scheduled),
                 self.settings.graceful_timeout, len(h.running))
        systemd.notify("STOPPING=1")
        self.phase = Phase.WARM
        self.link.cancel()
        for delivery in h.take_waiting():       # given back at once, in order
            if not delivery.acked:
                self.settlement.give_back(delivery.queue, delivery.message, delivery.label)
        self.slots.stop_idle()
        deadline = self.system.monotonic() + self.settings.graceful_timeout
        self.loop.call_later(self.settings.graceful_timeout,
                             lambda: self.cold_shutdown("graceful_timeout passed"))
        self._stopping_status(deadline)
        self._maybe_stopped()

    def _stopping_status(self, deadline: float) -> None:
        """While stopping, every STOP_STATUS_INTERVAL: say how it goes (STATUS=), and ask
        systemd for more time (EXTEND_TIMEOUT_USEC), so a graceful_timeout longer than the
        unit's TimeoutStopSec is waited out, not cut short by SIGKILL. systemd's limit
        applies again once the supervisor stops asking: when it is stuck, or stopped."""
        if self.phase not in (Phase.WARM, Phase.COLD):
            return
        left = max(0.0, deadline - self.system.monotonic())
        h = self.holding
        status = (f"{self.phase.value}: {self.slots.running} running"
                  + (f", {len(h.storing)} storing results" if h.storing else "")
                  + (f"; killed in {left:.0f} s if still running" if self.phase is Phase.WARM
                     else ""))
        systemd.notify(f"EXTEND_TIMEOUT_USEC={int(STOP_STATUS_INTERVAL * 3 * 1e6)}\n"
                       f"STATUS={status}")
        self.loop.call_later(STOP_STATUS_INTERVAL, lambda: self._stopping_status(deadline))

    def cold_shutdown(self, why: str) -> None:
        if self.phase in (Phase.COLD, Phase.STOPPED):
            return
        if self.phase is Phase.RUNNING:
            self.warm_shutdown(why)
        log.warning("cold shutdown (%s): killing %d running tasks", why, self.slots.running)
        self.phase = Phase.COLD
        self.slots.kill_all(f"cold shutdown ({why})")
        self._maybe_stopped()

    def _maybe_stopped(self) -> None:
        if self.phase is not _WARM and self.phase is not _COLD:
            return
        self._accept_received()      # arrived while stopping: each goes back to its queue
        if self.slots.all_exited():
            if self.holding.storing and self.phase is Phase.WARM:
                return      # still retrying their results, until graceful_timeout
            self.settlement.give_up_storing()
            self.phase = Phase.STOPPED


def _log_banner(current: Current, holding: Holding) -> None:
    s = current.settings
    windows = (f"prefetch window {holding.window} (async tasks: {holding.async_window}, "
               f"up to {s.async_concurrency} a child)" if holding.async_window
               else f"prefetch window {holding.window}")
    log.info("workhorse %s: %d children, %s, queues %s",
             s.hostname, s.concurrency, windows, ", ".join(s.queues))
    log.info("broker: %s", redact(s.broker_url))
    log.info("results: %s", redact(s.result_backend))
    log.info("state directory: %s", s.state_dir)
    log.info("tasks: %s", ", ".join(sorted(current.app.tasks)) or "(none registered)")


def _task_info(delivery: Delivery, running: tuple[Any, Any] | None, now: float,
               wall: float) -> TaskInfo:
    headers = delivery.request.headers
    info = delivery.message.delivery_info or {}
    child, job = running if running is not None else (None, None)
    started = getattr(job, "started_at", None)
    eta = delivery.request.eta
    return TaskInfo(
        id=delivery.request.id, name=delivery.request.task,
        args=str(headers.get("argsrepr") or ""), kwargs=str(headers.get("kwargsrepr") or ""),
        queue=delivery.queue, redelivered=bool(info.get("redelivered")),
        priority=(delivery.message.properties or {}).get("priority"),
        acknowledged=delivery.acked,
        time_start=wall - (now - started) if started is not None else None,
        worker_pid=getattr(child, "pid", None),
        eta=eta.isoformat() if eta else None, body=delivery.message.body,
        content_type=delivery.message.content_type)
