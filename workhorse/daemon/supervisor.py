"""The supervisor: one thread, one loop, and the parts it wires together.

    Holding     every held message by stage; the window's arithmetic     (holding.py)
    Intake      where an arriving message goes; ETA timers                (intake.py)
    Slots       the children: spawn, reap, replace, recycle, time limits  (slots.py)
    Dispatch    buffered messages to idle children; ack at start          (dispatch.py)
    Settlement  store what only the supervisor can, then ack/requeue/DLQ (settlement.py)
    Leases      renew what is held, and idempotency claims                (leases.py)
    BrokerLink  sockets to watch, per-connection housekeeping, loss, restore  (link.py)
    Reconnect   back-off after a lost broker connection                   (reconnect.py)
    Reload      SIGHUP: config and code again; TTIN/TTOU: pool size       (reload.py)
    System      every OS call, the seam for tests without fork            (system.py)

This module keeps the loop, the phases, the ``handle_<signal>`` methods and the order of
shutdown. Signals only wake the loop.
"""
from __future__ import annotations

import enum
import logging
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING

from kombu.message import Message

from ..app import BROKER_TIMEOUT, result_retry_policy
from ..backends import RetryPolicy
from ..config import Settings
from ..outcome import Outcome
from ..pool.ipc import Done
from ..pool.runtime import ChildRuntime
from . import systemd
from .delivery import Delivery
from .current import Current
from .dispatch import Dispatch
from .exitcodes import ExitCode
from .holding import Holding
from .intake import Intake
from .leases import Leases
from .link import BrokerLink
from .loop import Loop
from .reload import Load, Reload
from .settlement import Settlement
from .signals import SignalPipe
from .slots import Recycling, Slots
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
#: How often idle children's memory is compared with max_memory_per_child.
IDLE_MEMORY_CHECK = 2.0


class Phase(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    WARM = "warm shutdown"     # no new work; running tasks finish
    COLD = "cold shutdown"     # running tasks are killed
    STOPPED = "stopped"


class Supervisor:
    def __init__(self, app: App, settings: Settings, system: System | None = None,
                 reload: Load | None = None, link: BrokerLink | None = None) -> None:
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
        self.loop = Loop(self.system.monotonic)
        self.signals = SignalPipe(HANDLED_SIGNALS)
        self.holding = Holding(settings.concurrency * settings.prefetch_multiplier)
        self.link = link or BrokerLink(
            app, list(settings.queues), self.loop, self.receive, self._connected,
            self._broker_lost, self._gave_up, lambda: self.holding.window,
            settings.broker_connection_max_retries,
            settings.broker_connection_retry_on_startup)
        self.settlement = Settlement(self.current, self.link, self.loop, self.holding,
                                     self.hostname, result_retry_policy(settings), self._changed)
        self.intake = Intake(self.current, self.loop, self.holding, self.settlement,
                             self.system.monotonic, self.system.now, self._changed,
                             self._accepting)
        self.slots = Slots(settings.concurrency, self.system, self.loop, self._make_runtime,
                           self, Recycling(settings.max_tasks_per_child,
                                           settings.max_memory_per_child), self._accepting,
                           max_boot_failures=settings.max_boot_failures,
                           may_fork=self.link.parked)
        self.leases = Leases(self.current, self.link, self.holding,
                             settings.visibility_timeout, self._changed)
        self.dispatch = Dispatch(self.current, self.holding, self.intake, self.slots,
                                 self.link, self._accepting, self._changed,
                                 lambda seq: f"{self.hostname}:{self.system.getpid()}:{seq}",
                                 self.loop, self.system.monotonic)
        self.reloading = Reload(self.current, reload, self.slots, self.holding,
                                self.settlement, self.system.monotonic, self._changed)

    @property
    def app(self) -> App:
        return self.current.app

    @property
    def settings(self) -> Settings:
        return self.current.settings

    # ------------------------------------------------------------------ running
    def _accepting(self) -> bool:
        return self.phase is Phase.RUNNING

    def _changed(self) -> None:
        """Something held changed: the broker's credit and the broker thread's room follow."""
        now = self.system.monotonic()
        self.link.set_credit(self.holding.credit(now))
        free = self.holding.window - self.holding.held
        self.link.set_room(free if self._accepting() and now >= self.holding.paused_until
                           else 0)

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
            _log_banner(self.current, self.holding.window)
            self.slots.spawn_all()
            self._start_timers()
            self.phase = Phase.RUNNING
            self.link.start()           # connects on its own thread, with back-off
            systemd.notify(f"READY=1\nSTATUS=connecting to the broker at {self.link.where}")
            while self.phase is not Phase.STOPPED:
                self._changed()
                self.loop.run_once()
                self._after_events()
        except BaseException:
            log.critical("supervisor failed; killing children, unsettled messages go back "
                         "to the broker", exc_info=True)
            self.slots.kill_now()
            self.exit_code = ExitCode.FAILURE
        finally:
            self.link.close(timeout=BROKER_TIMEOUT)
            self.signals.restore()
            self.loop.close()
            self.system.close()
        log.info("workhorse %s stopped", self.hostname)
        return self.exit_code

    def _start_timers(self) -> None:
        s = self.settings
        if s.max_memory_per_child:
            self._every(IDLE_MEMORY_CHECK, self.slots.check_idle_memory)
        self._every(self.leases.interval, self.leases.renew)
        self._every(min(60.0, s.rabbitmq_consumer_timeout / 8), self._refresh_scheduled)
        if hasattr(self.app.backend, "purge_expired"):
            self._every(RESULT_PURGE_INTERVAL, self._purge_results)
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
        removed = self.app.backend.purge_expired()  # type: ignore[attr-defined]
        if removed:
            log.info("result store: %d expired results deleted", removed)

    # ------------------------------------------------------------------ broker
    def receive(self, queue: str, message: Message, deliveries: int) -> None:
        """The broker thread hands over a raw message (the child decodes the body) and its
        delivery count; it is looked at after this turn's events."""
        self.holding.inbox.append((queue, message, deliveries))

    def _connected(self) -> None:
        log.info("ready: consuming %s", ", ".join(self.settings.queues))
        self.leases.renew()         # before the new connection's sweep can take our leases
        self._changed()

    def _broker_lost(self, exc: BaseException) -> None:
        """Running tasks go on; what is only buffered or scheduled is the broker's again if
        the broker took it back (RabbitMQ does when a connection closes; SQLite and Redis
        keep our leases, which we go on renewing). The broker thread reconnects."""
        dropped = 0
        if self.link.push:
            dropped = len(self.holding.take_waiting()) + len(self.holding.inbox)
            self.holding.inbox.clear()
        log.error("broker connection lost (%r): %d running tasks go on%s; reconnecting",
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
        if self._accepting():
            self.dispatch.dispatch()
        self._maybe_stopped()

    def _accept_received(self) -> None:
        inbox = self.holding.inbox
        while inbox:
            queue, message, deliveries = inbox.popleft()
            if self._accepting():
                self.intake.accept(queue, message, deliveries)
            else:
                self.settlement.give_back(queue, message)   # came after we stopped fetching

    # ------------------------------------------------------------------ pool events
    def job_done(self, delivery: Delivery, done: Done) -> None:
        delivery.claim = None       # the child ended it
        outcome = Outcome(done.outcome)
        if outcome is Outcome.NOT_RUN or (outcome is Outcome.CLAIMED_ELSEWHERE
                                          and not delivery.acked):
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
                            self.hostname)

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
        log.info("SIGUSR2 received: workhorse gives it no meaning; ignored")

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
        self.loop.call_later(self.settings.graceful_timeout,
                             lambda: self.cold_shutdown("graceful_timeout passed"))
        self._maybe_stopped()

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
        if self.phase not in (Phase.WARM, Phase.COLD):
            return
        self._accept_received()      # arrived while stopping: each goes back to its queue
        if self.slots.all_exited():
            if self.holding.storing and self.phase is Phase.WARM:
                return      # still retrying their results, until graceful_timeout
            self.settlement.give_up_storing()
            self.phase = Phase.STOPPED


def _log_banner(current: Current, window: int) -> None:
    s = current.settings
    log.info("workhorse %s: %d children, prefetch window %d, queues %s",
             s.hostname, s.concurrency, window, ", ".join(s.queues))
    log.info("broker: %s", _redact(s.broker_url))
    log.info("results: %s", _redact(s.result_backend))
    log.info("state directory: %s", s.state_dir)
    log.info("tasks: %s", ", ".join(sorted(current.app.tasks)) or "(none registered)")


def _redact(url: str) -> str:
    """Hide a password in a URL before logging it."""
    if "://" not in url or "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    credentials, _, host = rest.rpartition("@")
    user = credentials.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}" if ":" in credentials else url
