"""The supervisor: one thread, one loop, one object per child.

It holds the prefetch buffer, hands one task at a time to each idle child, enforces time
limits from its timer heap, replaces children that die, and settles every message as
SEMANTICS.md says. Signals only wake the loop; ``handle_<signal>`` methods act on them.
"""
from __future__ import annotations

import enum
import itertools
import logging
import os
import signal
import time
from collections import deque
from collections.abc import Callable
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import psutil
from kombu.message import Message

from ..exceptions import (
    MalformedMessage,
    TaskRevokedError,
    NotRegistered,
    TimeLimitExceeded,
    TooManyDeliveries,
    WorkerLostError,
)
from ..outcome import Action, Decision, Outcome, Policy, Store, decide
from ..pool.child import Child, ChildState, describe_exit
from ..pool.ipc import Claimed, Done, Hello, Job
from ..pool.limits import SOFT_LIMIT_SIGNAL, effective_limit
from ..pool.runtime import ChildRuntime
from ..pool.spawn import spawn
from ..app import result_retry_policy
from ..backends import RetryPolicy
from ..chords import chord_part_return
from ..protocol import decode_body, parse_request
from ..states import FAILURE, REVOKED
from . import systemd
from .consumer import POLL_INTERVAL, BrokerConsumer
from .delivery import Delivery, Stage
from .loop import Loop
from .signals import SignalPipe

if TYPE_CHECKING:
    from ..app import App
    from ..config import Settings

log = logging.getLogger("workhorse.supervisor")

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGCHLD,
                   signal.SIGUSR1)
#: Consecutive crashes of a child slot back off from this delay, doubling, up to the cap.
CRASH_BACKOFF_START = 0.1
CRASH_BACKOFF_MAX = 10.0
#: How often the worker deletes expired results from stores that do not expire them.
RESULT_PURGE_INTERVAL = 300.0
#: Reconnecting to a lost broker backs off from this delay, doubling, up to the cap.
RECONNECT_BACKOFF_START = 0.5
RECONNECT_BACKOFF_MAX = 30.0
#: A message whose task id is running here already (RabbitMQ gave it back when the
#: connection was lost, and delivered it again) waits this long before it is looked at.
SAME_ID_RECHECK = 1.0
#: How often idle children's memory is compared with max_memory_per_child.
IDLE_MEMORY_CHECK = 2.0
#: Leases are renewed this many times per visibility_timeout.
RENEWALS_PER_TIMEOUT = 4
#: After handing back an ETA message over max_scheduled, stop fetching for this long, so a
#: queue of far-future messages is not cycled through the worker at full speed.
SCHEDULE_FULL_PAUSE = 1.0


class Phase(str, enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    WARM = "warm shutdown"     # no new work; running tasks finish
    COLD = "cold shutdown"     # running tasks are killed
    STOPPED = "stopped"


class Supervisor:
    def __init__(self, app: App, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        self.hostname: str = settings.hostname
        self.concurrency: int = settings.concurrency
        self.window: int = settings.concurrency * settings.prefetch_multiplier
        self.loop = Loop()
        self.signals = SignalPipe(HANDLED_SIGNALS)
        self.consumer = BrokerConsumer(app, list(settings.queues), self.on_message,
                                       self.on_broker_lost)
        self.children: list[Child | None] = [None] * self.concurrency
        self.inbox: deque[tuple[str, Message]] = deque()   # received, not yet looked at
        self.buffer: deque[Delivery] = deque()
        self.scheduled: set[Delivery] = set()
        self.storing: set[Delivery] = set()   # over; waiting to store their result
        self.store_retry = result_retry_policy(settings)
        self.phase = Phase.STARTING
        self.exit_code = 0
        self._seq = itertools.count(1)
        self._crashes = [0] * self.concurrency
        self._respawn_timers: list[Any] = [None] * self.concurrency
        self._interrupts = 0
        self._broker_fds: set[int] = set()
        self._baseline_fds: set[int] = set()
        self._want_poll = False
        self._paused_until = 0.0   # monotonic; fetching stops until then (max_scheduled)
        self._reconnects = 0       # attempts since the connection was lost
        self._connected_at = 0.0   # monotonic time of the last (re)connect

    # ------------------------------------------------------------------ running
    @property
    def running(self) -> int:
        return sum(1 for c in self.children if c is not None and c.busy)

    @property
    def held(self) -> int:
        """Received (not yet looked at), buffered and running: what the window bounds."""
        return len(self.inbox) + len(self.buffer) + self.running

    def has_room(self) -> bool:
        """May the worker take one more message? Its own count, not the broker's QoS."""
        return (self.phase is Phase.RUNNING and self.held < self.window
                and time.monotonic() >= self._paused_until)

    def _update_flow(self, starting: int = 0) -> None:
        """Tell the broker how many unacknowledged messages it may have out with us.

        The broker counts what we have not acked: buffered, scheduled, and running tasks
        not acked at start, and finished ones whose result is still being stored. For
        buffered + running <= window, that is the window plus the scheduled and the
        unacked storing, minus the running ones already acked (acks_late = false), and
        minus ``starting``: acked just now, about to be handed to a child.
        """
        acked_running = starting + sum(1 for c in self.children
                                       if c is not None and c.busy and c.job.acked)
        unacked_storing = sum(1 for d in self.storing if not d.acked)
        if time.monotonic() < self._paused_until:
            self.consumer.set_credit(0)
            return
        self.consumer.set_credit(self.window + len(self.scheduled) + unacked_storing
                                 - acked_running)

    def run(self) -> int:
        """Run until shut down; return the process exit status."""
        self._baseline_fds = _open_fds()
        self.signals.install()
        self.loop.add_reader(self.signals.read_fd, self._on_signals)
        # One attempt per call: transient store errors are retried from loop timers
        # (_store_then_settle), never by sleeping in the loop. Children get their own
        # backend after fork, with the configured retries.
        self.app.backend.retry_policy = RetryPolicy(always_retry=False)
        try:
            self.consumer.connect(prefetch_count=self.window, has_room=self.has_room)
            self._connected_at = time.monotonic()
            self._log_banner()
            for index in range(self.concurrency):
                self._spawn(index)
            self._start_broker_housekeeping()
            if self.consumer.polled:
                self._every(POLL_INTERVAL, self._poll_timer)
            if self.settings.max_memory_per_child:
                self._every(IDLE_MEMORY_CHECK, self._check_idle_memory)
            self._every(self.settings.visibility_timeout / RENEWALS_PER_TIMEOUT, self._renew)
            if self.consumer.push:
                self._every(min(60.0, self.settings.rabbitmq_consumer_timeout / 8),
                            self._refresh_scheduled)
            if hasattr(self.app.backend, "purge_expired"):
                self._every(RESULT_PURGE_INTERVAL, self._purge_results)
            watchdog = systemd.watchdog_interval()
            if watchdog:
                self._every(watchdog, lambda: systemd.notify("WATCHDOG=1"))
            self.phase = Phase.RUNNING
            systemd.notify(f"READY=1\nSTATUS=consuming {', '.join(self.settings.queues)}")
            log.info("ready: consuming %s", ", ".join(self.settings.queues))
            while self.phase is not Phase.STOPPED:
                self._before_wait()
                self.loop.run_once()
                self._after_events()
        except BaseException:
            log.critical("supervisor failed; killing children, unsettled messages go back "
                         "to the broker", exc_info=True)
            self._kill_all()
            self.exit_code = 1
        finally:
            self.consumer.close()
            self.signals.restore()
            self.loop.close()
        log.info("workhorse %s stopped", self.hostname)
        return self.exit_code

    def _log_banner(self) -> None:
        s = self.settings
        log.info("workhorse %s: %d children, prefetch window %d, queues %s",
                 self.hostname, self.concurrency, self.window, ", ".join(s.queues))
        log.info("broker: %s", _redact(s.broker_url))
        log.info("results: %s", _redact(s.result_backend))
        log.info("state directory: %s", s.state_dir)
        log.info("tasks: %s", ", ".join(sorted(self.app.tasks)) or "(none registered)")

    def _every(self, interval: float, function: Callable[[], None],
               generation: int | None = None) -> None:
        """Call ``function`` every ``interval`` s (while the broker connection of
        ``generation`` lasts, if given)."""
        def fire() -> None:
            if self.phase is Phase.STOPPED:
                return
            if generation is not None and generation != self.consumer.generation:
                return
            try:
                function()
            except Exception:  # noqa: BLE001 - housekeeping must not stop the loop
                log.exception("periodic %s failed", getattr(function, "__name__", function))
            self.loop.call_later(interval, fire)
        self.loop.call_later(interval, fire)

    def _start_broker_housekeeping(self) -> None:
        generation = self.consumer.generation
        for interval, function in self.consumer.periodic():
            self._every(interval, function, generation)

    # ------------------------------------------------------------------ broker loss
    def on_broker_lost(self, exc: BaseException) -> None:
        """Running tasks go on; what is only buffered or scheduled is the broker's again if
        the broker took it back (RabbitMQ does when a connection closes; SQLite and Redis
        keep our leases, which we go on renewing); we reconnect with back-off."""
        dropped = 0
        if self.consumer.push:
            for delivery in [*self.buffer, *self.scheduled]:
                if delivery.timer is not None:
                    delivery.timer.cancel()
                delivery.stage = Stage.SETTLED
                dropped += 1
            dropped += len(self.inbox)
            self.buffer.clear()
            self.scheduled.clear()
            self.inbox.clear()
        log.error("broker connection lost (%r): %d running tasks go on%s; reconnecting",
                  exc, self.running,
                  f", {dropped} buffered or scheduled messages are back with the broker"
                  if dropped else "")
        systemd.notify(f"STATUS=broker connection lost ({exc!r}); reconnecting")
        # A connection that lasted a while starts over; one lost again at once (an error
        # that only shows after connecting) keeps backing off instead of spinning.
        if time.monotonic() - self._connected_at > RECONNECT_BACKOFF_MAX:
            self._reconnects = 0
        self.loop.call_later(self._reconnect_delay(), self._reconnect)

    def _reconnect_delay(self) -> float:
        """None yet: at once; then from RECONNECT_BACKOFF_START, doubling, to the cap."""
        if not self._reconnects:
            return 0.0
        return min(RECONNECT_BACKOFF_START * 2 ** (self._reconnects - 1), RECONNECT_BACKOFF_MAX)

    def _reconnect(self) -> None:
        if self.phase is not Phase.RUNNING or self.consumer.connected:
            return
        try:
            self.consumer.connect(self.window, self.has_room, retries=0)
        except Exception as exc:  # noqa: BLE001 - unreachable still: try again later
            self._reconnects += 1
            delay = self._reconnect_delay()
            log.warning("broker still unreachable (%r); next attempt in %.1f s", exc, delay)
            self.loop.call_later(delay, self._reconnect)
            return
        log.info("broker connection restored; consuming %s", ", ".join(self.settings.queues))
        systemd.notify(f"STATUS=consuming {', '.join(self.settings.queues)}")
        self._connected_at = time.monotonic()
        self._reconnects += 1       # reset only once the connection has lasted a while
        self._start_broker_housekeeping()
        self._renew()               # before the new connection's sweep can take our leases
        self._update_flow()
        self._want_poll = True

    def _before_wait(self) -> None:
        if self.phase is Phase.RUNNING:
            self.consumer.tick()
            self._sync_broker_fds()

    def _after_events(self) -> None:
        self._accept_received()
        self._dispatch()
        if self._want_poll and self.has_room():
            self._want_poll = False
            self.consumer.poll()
            self._accept_received()
            self._dispatch()
        self._maybe_stopped()

    def _poll_timer(self) -> None:
        self._want_poll = True

    def _sync_broker_fds(self) -> None:
        current = self.consumer.fds()
        if current == self._broker_fds:
            return
        for fd in self._broker_fds - current:
            self.loop.remove_reader(fd)
        for fd in current - self._broker_fds:
            self.loop.add_reader(fd, lambda fd=fd: self._on_broker_readable(fd))
        self._broker_fds = current

    def _on_broker_readable(self, fd: int) -> None:
        self.consumer.on_readable(fd)

    # ------------------------------------------------------------------ messages
    def on_message(self, queue: str, message: Message) -> None:
        """kombu hands us one raw message (not decoded: the child decodes the body). It is
        looked at once the drain returns: settling talks to the broker (a publish waits for
        its confirm), which must not happen inside the broker's own read of more messages."""
        self.inbox.append((queue, message))

    def _accept_received(self) -> None:
        while self.inbox:
            self._accept(*self.inbox.popleft())

    def _accept(self, queue: str, message: Message) -> None:
        if self.phase is not Phase.RUNNING:
            self._give_back(queue, message)   # arrived after we stopped fetching: not ours
            return
        try:
            request = parse_request(message.headers)
        except MalformedMessage as exc:
            self._dead_letter_malformed(queue, message, str(exc))
            return
        task = self.app.tasks.get(request.task)
        policy = self._policy(task)
        delivery = Delivery(next(self._seq), queue, message, request, task, policy,
                            received=time.monotonic())
        if task is None:
            self._settle(delivery, Outcome.UNKNOWN_TASK,
                         f"{NotRegistered(request.task)} (does the worker's app define it?)")
            return
        if self._expired(delivery):
            return
        deliveries = self.consumer.count_delivery(queue, message)
        if deliveries is None:       # replaced by a copy carrying its count (RabbitMQ)
            return
        delivery.deliveries = deliveries
        now = datetime.now(timezone.utc)
        if deliveries > policy.max_deliveries:
            detail = (f"delivery {deliveries} of at most {policy.max_deliveries} "
                      f"(max_deliveries): the {deliveries - 1} before it started, or were "
                      f"held by a worker that died")
            log.error("%s: %s; dead-lettered", delivery.label, detail)
            self._settle(delivery, Outcome.TOO_MANY_DELIVERIES, detail)
            return
        if request.eta is not None and request.eta > now:
            self._schedule(delivery, (request.eta - now).total_seconds())
            return
        self.buffer.append(delivery)

    def _policy(self, task: Any) -> Policy:
        s = self.settings

        def pick(name: str) -> Any:
            value = getattr(task, name, None) if task is not None else None
            return s[name] if value is None else value
        return Policy(acks_late=pick("acks_late"),
                      reject_on_worker_lost=pick("reject_on_worker_lost"),
                      acks_on_failure=pick("acks_on_failure"),
                      acks_on_timeout=pick("acks_on_timeout"),
                      max_deliveries=pick("max_deliveries"))

    def _schedule(self, delivery: Delivery, delay: float) -> None:
        """Hold an ETA message in the supervisor; it does not take a prefetch slot. Past
        max_scheduled it goes back to its queue instead, and fetching pauses briefly."""
        if self.phase is not Phase.RUNNING:      # stopping: nothing new is held
            delivery.stage = Stage.SETTLED
            if not delivery.acked:
                self._give_back(delivery.queue, delivery.message)
            return
        if len(self.scheduled) >= self.settings.max_scheduled:
            log.warning("%s: %d scheduled messages held already (max_scheduled); handed back "
                        "to %s, fetching paused for %.0f s", delivery.label, len(self.scheduled),
                        delivery.queue, SCHEDULE_FULL_PAUSE)
            self._hand_back(delivery)
            self._pause_fetching(SCHEDULE_FULL_PAUSE)
            return
        delivery.stage = Stage.SCHEDULED
        self.scheduled.add(delivery)
        self._update_flow()
        delivery.timer = self.loop.call_later(delay, lambda: self._eta_reached(delivery))

    def _pause_fetching(self, seconds: float) -> None:
        paused = time.monotonic() < self._paused_until
        self._paused_until = time.monotonic() + seconds
        if not paused:
            self._update_flow()
            self.loop.call_later(seconds, self._resume_fetching)

    def _resume_fetching(self) -> None:
        remaining = self._paused_until - time.monotonic()
        if remaining > 0:       # extended meanwhile (or the timer fired a hair early)
            self.loop.call_later(remaining, self._resume_fetching)
            return
        self._update_flow()
        self._want_poll = True

    def _hand_back(self, delivery: Delivery) -> None:
        delivery.stage = Stage.SETTLED
        try:
            self.consumer.hand_back(delivery.queue, delivery.message)
        except Exception:  # noqa: BLE001
            log.exception("%s: could not hand it back; the broker returns it when its lease "
                          "ends or the connection closes", delivery.label)

    # ------------------------------------------------------------------ leases
    def _running_here(self, task_id: str) -> bool:
        return any(d.request.id == task_id for d in (*self._running(), *self.storing))

    def _running(self) -> list[Delivery]:
        return [c.job for c in self.children if c is not None and c.job is not None]

    def _held(self) -> list[Delivery]:
        """Everything taken from the broker and not yet settled with it."""
        return [d for d in (*self.buffer, *self.scheduled, *self._running(), *self.storing)
                if not d.acked]

    def _renew(self) -> None:
        """Keep what we hold from being handed to another worker (SQLite and Redis leases),
        and the claims of idempotent tasks running here from lapsing."""
        held = self._held()
        if self.consumer.leased:
            lost = {id(m) for m in self.consumer.renew([d.message for d in held])}
            for delivery in held:
                if id(delivery.message) in lost:
                    self._lease_lost(delivery)
        claims = {d.claim[0]: d.claim[1] for d in self._running() if d.claim is not None}
        if claims:
            for key in self.app.backend.renew_claims(claims, self.settings.visibility_timeout):
                log.warning("idempotency claim on %r lost (not renewed in time): another "
                            "delivery may start it", key)

    def _release_claim(self, delivery: Delivery) -> None:
        """Its child is gone without ending the claim: let another delivery take it now."""
        if delivery.claim is None:
            return
        key, owner = delivery.claim
        delivery.claim = None
        try:
            self.app.backend.release_claim(key, owner)
        except Exception as exc:  # noqa: BLE001 - it lapses on its own
            log.warning("%s: could not release idempotency claim %r (%r); it lapses in %.0f s",
                        delivery.label, key, exc, self.settings.visibility_timeout)

    def _lease_lost(self, delivery: Delivery) -> None:
        """Our lease ran out (renewals failed for a whole visibility_timeout): the broker may
        have handed the message to another worker. Do not start it here; if it runs, let
        it finish (settling it then touches only our own, lost, lease)."""
        if delivery in self.scheduled:
            self.scheduled.discard(delivery)
            if delivery.timer is not None:
                delivery.timer.cancel()
        elif delivery in self.buffer:
            self.buffer.remove(delivery)
        else:
            log.warning("%s: lease lost while running; the broker may deliver it again",
                        delivery.label)
            return
        delivery.stage = Stage.SETTLED
        log.warning("%s: lease lost before it started; left to the broker, not run here",
                    delivery.label)
        try:
            self.consumer.forget(delivery.message)
        except Exception as exc:  # noqa: BLE001 - only our own bookkeeping is at stake
            log.debug("%s: forgetting a lost lease: %r", delivery.label, exc)
        self._update_flow()

    def _refresh_scheduled(self) -> None:
        """RabbitMQ closes a channel holding an unacked message past its consumer_timeout:
        hand back scheduled messages held for half of it (a fresh copy; not counted)."""
        limit = time.monotonic() - self.settings.rabbitmq_consumer_timeout / 2
        for delivery in sorted(self.scheduled, key=lambda d: d.seq):
            if delivery.received > limit:
                continue
            self.scheduled.discard(delivery)
            if delivery.timer is not None:
                delivery.timer.cancel()
            log.info("%s: scheduled for %s, held since %.0f s; handed back to %s before "
                     "RabbitMQ's consumer_timeout", delivery.label,
                     delivery.request.eta.isoformat() if delivery.request.eta else "?",
                     time.monotonic() - delivery.received, delivery.queue)
            self._hand_back(delivery)
        self._update_flow()

    def _eta_reached(self, delivery: Delivery) -> None:
        if delivery not in self.scheduled:
            return
        self.scheduled.discard(delivery)
        delivery.stage = Stage.BUFFERED
        self.buffer.appendleft(delivery)  # its time has come: ahead of later arrivals
        self._update_flow()

    def _dead_letter_malformed(self, queue: str, message: Message, reason: str) -> None:
        log.error("malformed message on %s dead-lettered to %s.dead: %s", queue, queue, reason)
        try:
            self.consumer.dead_letter(queue, message, f"malformed: {reason}", None,
                                      self.hostname, acked=False)
        except Exception:  # noqa: BLE001
            log.exception("could not dead-letter a malformed message; it goes back to %s", queue)
            self._give_back(queue, message)

    def _give_back(self, queue: str, message: Message) -> None:
        """Requeue, uncounted; if even that fails, the broker has it back anyway once our
        lease runs out or the connection closes."""
        try:
            self.consumer.requeue(queue, message)
        except Exception as exc:  # noqa: BLE001
            log.warning("could not give a message back (%r); the broker returns it when its "
                        "lease ends or the connection closes", exc)

    # ------------------------------------------------------------------ children
    def _spawn(self, index: int) -> None:
        self._respawn_timers[index] = None
        private = _private_fds(self._baseline_fds)
        handle = spawn(index + 1, self._make_runtime, private)
        child = Child(index, handle, time.monotonic())
        self.children[index] = child
        self.loop.add_reader(handle.read_fd, lambda: self._on_child_readable(child))

    def _make_runtime(self, index: int, read_fd: int, write_fd: int) -> ChildRuntime:
        return ChildRuntime(self.app, index, read_fd, write_fd, os.getpid(), self.hostname)

    def _on_child_readable(self, child: Child) -> None:
        for frame in child.handle.receive():
            if isinstance(frame, Hello):
                child.on_hello()
            elif isinstance(frame, Claimed):
                if child.job is not None and child.job.seq == frame.seq:
                    child.job.claim = (frame.key, frame.owner)
            elif isinstance(frame, Done):
                self._on_done(child, frame)
        if child.handle.at_eof:
            # The process is exiting; SIGCHLD tells us when it is gone. Stop watching the
            # pipe, or EOF would keep the selector readable.
            self.loop.remove_reader(child.handle.read_fd)

    def _start(self, child: Child, delivery: Delivery) -> None:
        request = delivery.request
        message = delivery.message
        task = delivery.task
        job = Job(delivery.seq, request.task, message.body, message.content_type,
                  message.content_encoding, dict(message.headers or {}),
                  dict(message.delivery_info or {}), self._track_started(task),
                  delivery.queue, (message.properties or {}).get("priority"),
                  delivery.policy.acks_late,
                  claim_owner=f"{self.hostname}:{os.getpid()}:{delivery.seq}",
                  claim_ttl=self.settings.visibility_timeout)
        if not (delivery.policy.acks_late or delivery.acked or self._ack_at_start(delivery)):
            return      # (acked already: a child died before it could take the job)
        now = time.monotonic()
        try:
            child.assign(delivery, job, now)
        except OSError as exc:
            # The child died before it could take the job: the job was never started.
            log.warning("child %d (pid %d) cannot take a job (%s); replacing it",
                        child.index + 1, child.pid, exc)
            self.buffer.appendleft(delivery)
            child.kill(None)
            return
        delivery.stage = Stage.RUNNING
        delivery.started = True
        hard, soft = self._limits(delivery)
        if soft:
            child.timers.append(self.loop.call_at(now + soft, lambda: self._soft_limit(child, delivery)))
        if hard:
            child.timers.append(self.loop.call_at(now + hard, lambda: self._hard_limit(child, delivery)))

    def _ack_at_start(self, delivery: Delivery) -> bool:
        """At-most-once: acked before its child gets it, so an ack that fails never lets it
        run twice. The broker would count the freed slot as room for one more: shrink its
        credit first (same channel, so in that order). False: not acked, not started."""
        delivery.acked = True
        self._update_flow(starting=1)
        try:
            self.consumer.ack(delivery.message)
            return True
        except Exception as exc:  # noqa: BLE001 - the broker still has it
            delivery.acked = False
            self._update_flow()
            if self.consumer.push:       # RabbitMQ took it back with the connection
                delivery.stage = Stage.SETTLED
                log.warning("%s: could not ack it at start (%r); not started, the broker "
                            "delivers it again", delivery.label, exc)
            else:                        # still leased to us: try again shortly
                log.warning("%s: could not ack it at start (%r); trying again in %.0f s",
                            delivery.label, exc, SAME_ID_RECHECK)
                self._schedule(delivery, SAME_ID_RECHECK)
            return False

    def _track_started(self, task: Any) -> bool:
        value = getattr(task, "track_started", None)
        return self.settings.track_started if value is None else bool(value)

    def _limits(self, delivery: Delivery) -> tuple[float | None, float | None]:
        """Header (which carries the call's options) > task decorator > configuration."""
        request, task, s = delivery.request, delivery.task, self.settings
        return (effective_limit(request.time_limit, task.time_limit, s.time_limit),
                effective_limit(request.soft_time_limit, task.soft_time_limit, s.soft_time_limit))

    def _soft_limit(self, child: Child, delivery: Delivery) -> None:
        if child.job is not delivery:
            return
        log.warning("%s: soft time limit reached; SoftTimeLimitExceeded raised in the task",
                    delivery.label)
        try:
            os.kill(child.pid, SOFT_LIMIT_SIGNAL)
        except ProcessLookupError:
            pass

    def _hard_limit(self, child: Child, delivery: Delivery) -> None:
        if child.job is not delivery:
            return
        log.error("%s: hard time limit reached; killing child %d (pid %d) and what it started",
                  delivery.label, child.index + 1, child.pid)
        child.kill(Outcome.TIME_LIMIT)

    def _on_done(self, child: Child, done: Done) -> None:
        delivery = child.on_done(done.rss)
        for timer in child.timers:
            timer.cancel()
        child.timers.clear()
        self._crashes[child.index] = 0
        delivery.claim = None       # the child ended it
        outcome = Outcome(done.outcome)
        if outcome is Outcome.NOT_RUN or (outcome is Outcome.CLAIMED_ELSEWHERE
                                          and not delivery.acked):
            self._recheck_later(delivery)
        else:
            self._settle(delivery, outcome, done.detail)
        if not child.handle.at_eof:     # else it is exiting already
            self._maybe_recycle(child)

    def _recheck_later(self, delivery: Delivery) -> None:
        """Its child did not run it: an idempotent task's key is held by a run in progress
        elsewhere, or the result store could not be asked. Hold it (not a delivery that
        counts) and look again when that run has ended or its claim lapsed."""
        delivery.started = False
        delay = self.settings.visibility_timeout / 2
        log.info("%s: its idempotency key is held by another delivery; looking again in "
                 "%.0f s", delivery.label, delay)
        self._schedule(delivery, delay)

    def _maybe_recycle(self, child: Child) -> None:
        s = self.settings
        reason = None
        if s.max_tasks_per_child and child.tasks_done >= s.max_tasks_per_child:
            reason = f"ran {child.tasks_done} tasks (max_tasks_per_child={s.max_tasks_per_child})"
        elif s.max_memory_per_child and child.rss > s.max_memory_per_child:
            reason = (f"uses {child.rss // 1024} KiB "
                      f"(max_memory_per_child={s.max_memory_per_child // 1024} KiB)")
        if reason:
            log.info("recycling child %d (pid %d): %s", child.index + 1, child.pid, reason)
        if reason or self.phase is not Phase.RUNNING:
            child.stop()

    def _purge_results(self) -> None:
        removed = self.app.backend.purge_expired()  # type: ignore[attr-defined]
        if removed:
            log.info("result store: %d expired results deleted", removed)

    def _check_idle_memory(self) -> None:
        """Recycle idle children over max_memory_per_child (a busy one is checked after its
        task: never mid-task)."""
        for child in self.children:
            if child is not None and child.state is ChildState.IDLE:
                try:
                    child.rss = psutil.Process(child.pid).memory_info().rss
                except psutil.Error:
                    continue
                self._maybe_recycle(child)

    def _dispatch(self) -> None:
        if not self.buffer or self.phase is not Phase.RUNNING:
            return
        for child in self.children:
            while self.buffer and child is not None and child.state is ChildState.IDLE:
                delivery = self.buffer.popleft()
                if self._expired(delivery):   # it waited (ETA, buffer) past its expiry
                    continue
                if self._running_here(delivery.request.id):
                    log.info("%s: a copy of it runs here already; looking again in %.0f s",
                             delivery.label, SAME_ID_RECHECK)
                    self._schedule(delivery, SAME_ID_RECHECK)
                    continue
                self._start(child, delivery)
            if not self.buffer:
                return

    def _expired(self, delivery: Delivery) -> bool:
        expires = delivery.request.expires
        if expires is None or expires > datetime.now(timezone.utc):
            return False
        log.info("%s: expired at %s, not run", delivery.label, expires.isoformat())
        self._settle(delivery, Outcome.EXPIRED, "expired before it started")
        return True

    def _reap(self) -> None:
        for child in list(self.children):
            if child is None or child.state is ChildState.EXITED:
                continue
            code = child.handle.exitcode()
            if code is not None:
                self._on_child_exit(child, code)

    def _on_child_exit(self, child: Child, code: int) -> None:
        if not child.handle.at_eof:
            self._on_child_readable(child)   # what it wrote before dying (Done, Claimed)
        expected = child.state is ChildState.STOPPING and child.kill_reason is None
        delivery = child.on_exit(code)
        for timer in child.timers:
            timer.cancel()
        child.timers.clear()
        self.loop.remove_reader(child.handle.read_fd)
        how = describe_exit(code)
        if delivery is not None:
            outcome = child.kill_reason or Outcome.CHILD_LOST
            log.error("child %d (pid %d) %s while running %s", child.index + 1, child.pid, how,
                      delivery.label)
            self._release_claim(delivery)
            self._settle(delivery, outcome, f"child {how}")
        elif not expected and child.kill_reason is None:
            log.error("child %d (pid %d) %s", child.index + 1, child.pid, how)
        if self.phase in (Phase.RUNNING, Phase.STARTING):
            self._replace(child, crashed=not expected and child.kill_reason is None)

    def _replace(self, child: Child, crashed: bool) -> None:
        index = child.index
        if not crashed:
            self._spawn(index)
            return
        self._crashes[index] += 1
        failures = self._crashes[index]
        if failures == 1:
            self._spawn(index)
            return
        delay = min(CRASH_BACKOFF_START * 2 ** (failures - 2), CRASH_BACKOFF_MAX)
        log.warning("child slot %d crashed %d times in a row; starting the next one in %.1f s",
                    index + 1, failures, delay)
        systemd.notify(f"STATUS=child slot {index + 1} crashing ({failures} in a row)")
        self._respawn_timers[index] = self.loop.call_later(delay, lambda: self._respawn(index))

    def _respawn(self, index: int) -> None:
        if self.phase is Phase.RUNNING:
            self._spawn(index)

    def _kill_all(self) -> None:
        for child in self.children:
            if child is not None and child.state is not ChildState.EXITED:
                child.handle.kill_tree()

    # ------------------------------------------------------------------ settling
    def _settle(self, delivery: Delivery, outcome: Outcome, detail: str | None) -> None:
        """Carry out the Outcomes table for ``delivery``: store what only the supervisor
        can store, then ack, requeue or dead-letter. Never lets an error escape."""
        decision = decide(outcome, delivery.policy, started=delivery.started,
                          deliveries=delivery.deliveries)
        self._store_then_settle(delivery, outcome, decision, detail, 0)

    def _store_then_settle(self, delivery: Delivery, outcome: Outcome, decision: Decision,
                           detail: str | None, attempt: int) -> None:
        """Store, then settle. The supervisor never sleeps: its backend makes one attempt,
        and a transient error is retried from a loop timer with the configured back-off,
        the message held (not acked) meanwhile."""
        self.storing.discard(delivery)
        delivery.timer = None
        try:
            self._store(delivery, decision, detail)
        except Exception as exc:  # noqa: BLE001 - the store's trouble, not ours
            backend, policy = self.app.backend, self.store_retry
            if (policy.always_retry and attempt < policy.max_retries
                    and backend.exception_safe_to_retry(exc)):
                delay = policy.delay(attempt)
                log.warning("%s: result store: storing its %s result failed (%r); retry %d "
                            "of %d in %.2f s, the message held until then", delivery.label,
                            decision.store.value, exc, attempt + 1, policy.max_retries, delay)
                backend.on_connection_error(exc)
                delivery.stage = Stage.STORING
                delivery.settlement = (outcome, decision, detail)
                self.storing.add(delivery)
                delivery.timer = self.loop.call_later(delay, lambda: self._store_then_settle(
                    delivery, outcome, decision, detail, attempt + 1))
                self._update_flow()
                return
            log.error("%s: could not store its %s result (%r)", delivery.label,
                      decision.store.value, exc)
            decision = self._without_result(delivery, decision)
        self._carry_out(delivery, outcome, decision, detail)

    def _without_result(self, delivery: Delivery, decision: Decision) -> Decision:
        """The result could not be stored: never ack it away without one. Dead letters keep
        the message anyway; an ack becomes a requeue (counted if it started)."""
        if decision.action is not Action.ACK or delivery.acked:
            return decision
        if not delivery.started:
            return Decision(Action.REQUEUE)
        return decide(Outcome.STORE_FAILED, delivery.policy, started=True,
                      deliveries=delivery.deliveries)

    def _carry_out(self, delivery: Delivery, outcome: Outcome, decision: Decision,
                   detail: str | None) -> None:
        delivery.stage = Stage.SETTLED
        message, queue = delivery.message, delivery.queue
        try:
            if decision.action is Action.ACK and not delivery.acked:
                self.consumer.ack(message)
            elif decision.action is Action.REQUEUE:
                self.consumer.requeue(queue, message)
            elif decision.action is Action.REQUEUE_COUNTED:
                log.warning("%s: %s; requeued (started %d of at most %d times)", delivery.label,
                            detail, delivery.deliveries, delivery.policy.max_deliveries)
                self.consumer.requeue_counted(queue, message, delivery.deliveries)
            elif decision.action is Action.DEAD_LETTER:
                reason = f"{outcome.value}: {detail}" if detail else outcome.value
                log.error("%s: dead-lettered to %s.dead: %s", delivery.label, queue, reason)
                self.consumer.dead_letter(queue, message, reason, delivery.request.id,
                                          self.hostname, acked=delivery.acked)
        except Exception as exc:  # noqa: BLE001 - the broker decides what happens to it now
            if self.consumer.is_connection_error(exc):
                log.warning("%s: could not %s the message, its broker connection is gone "
                            "(%r); the broker will deliver it again", delivery.label,
                            decision.action.value, exc)
            else:
                log.exception("%s: could not %s the message; the broker will deliver it "
                              "again", delivery.label, decision.action.value)
        self._want_poll = True
        if delivery.acked and delivery.started:
            self._update_flow()

    def _store(self, delivery: Delivery, decision: Decision, detail: str | None) -> None:
        """Write the results only the supervisor can write (the child is gone or never ran)."""
        if decision.store is Store.NOTHING:
            return
        task_id = delivery.request.id
        info = {"task": delivery.request.task, "hostname": self.hostname,
                "retries": delivery.request.retries, "group": delivery.request.group,
                "parent_id": delivery.request.parent_id,
                "delivery_info": dict(delivery.message.delivery_info or {})}
        backend = self.app.backend
        if decision.store is Store.REVOKED:
            backend.mark_as_revoked(task_id, detail or "revoked", request=info)
            self._chord_part(delivery, REVOKED, TaskRevokedError(detail or "revoked"))
            return
        exc: BaseException = {
            Store.TIME_LIMIT: lambda: TimeLimitExceeded(detail),
            Store.WORKER_LOST: lambda: WorkerLostError(detail),
            Store.NOT_REGISTERED: lambda: NotRegistered(delivery.request.task),
            Store.TOO_MANY: lambda: TooManyDeliveries(detail),
        }[decision.store]()
        backend.mark_as_failure(task_id, exc, None, request=info)
        self._chord_part(delivery, FAILURE, exc)

    def _chord_part(self, delivery: Delivery, state: str, result: Any) -> None:
        """A chord header task that ended here (killed, lost, unknown) still counts toward
        its chord, or the chord would wait forever. Errbacks are sent, not run here: the
        supervisor never runs task code."""
        request = delivery.request
        if not request.group:
            return
        message = delivery.message
        try:
            _, _, embed = decode_body(message.body, message.content_type, message.content_encoding)
        except MalformedMessage:
            return
        if embed.get("chord"):
            chord_part_return(self.app, request.group, request.id, request.group_index, state,
                              result, embed["chord"], inline_errbacks=False)

    # ------------------------------------------------------------------ signals
    def _on_signals(self) -> None:
        for sig in self.signals.drain():
            handler = getattr(self, f"handle_{sig.name[3:].lower()}", None)
            if handler is not None:
                handler()

    def handle_chld(self) -> None:
        self._reap()

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
        log.warning("state: phase=%s held=%d/%d buffered=%d scheduled=%d running=%d "
                    "storing=%d", self.phase.value, self.held, self.window, len(self.buffer),
                    len(self.scheduled), self.running, len(self.storing))
        for child in self.children:
            if child is not None:
                job = child.job.label if child.job is not None else "-"
                log.warning("  %r tasks_done=%d job=%s", child, child.tasks_done, job)

    # ------------------------------------------------------------------ shutdown
    def warm_shutdown(self, why: str) -> None:
        if self.phase is not Phase.RUNNING:
            return
        log.info("warm shutdown (%s): requeueing %d buffered and %d scheduled, waiting up to "
                 "%s s for %d running", why, len(self.buffer), len(self.scheduled),
                 self.settings.graceful_timeout, self.running)
        systemd.notify("STOPPING=1")
        self.phase = Phase.WARM
        self.consumer.cancel()
        self._requeue_held()
        for index, timer in enumerate(self._respawn_timers):
            if timer is not None:
                timer.cancel()
                self._respawn_timers[index] = None
        for child in self.children:
            if child is not None and child.state in (ChildState.IDLE, ChildState.SPAWNING):
                child.stop()
        self.loop.call_later(self.settings.graceful_timeout,
                             lambda: self.cold_shutdown("graceful_timeout passed"))
        self._maybe_stopped()

    def cold_shutdown(self, why: str) -> None:
        if self.phase in (Phase.COLD, Phase.STOPPED):
            return
        if self.phase is Phase.RUNNING:
            self.warm_shutdown(why)
        log.warning("cold shutdown (%s): killing %d running tasks", why, self.running)
        self.phase = Phase.COLD
        for child in self.children:
            if child is None or child.state is ChildState.EXITED:
                continue
            child.kill(Outcome.SHUTDOWN_KILLED if child.busy else None)
        self._maybe_stopped()

    def _requeue_held(self) -> None:
        """Give back everything not running, at once and in order."""
        waiting = list(self.buffer) + sorted(self.scheduled, key=lambda d: d.seq)
        self.buffer.clear()
        for delivery in self.scheduled:
            if delivery.timer is not None:
                delivery.timer.cancel()
        self.scheduled.clear()
        for delivery in waiting:
            delivery.stage = Stage.SETTLED
            try:
                self.consumer.requeue(delivery.queue, delivery.message)
            except Exception:  # noqa: BLE001
                log.exception("%s: could not requeue; the broker returns it when the "
                              "connection closes", delivery.label)

    def _maybe_stopped(self) -> None:
        if self.phase not in (Phase.WARM, Phase.COLD):
            return
        self._accept_received()      # arrived while stopping: each goes back to its queue
        if all(c is None or c.state is ChildState.EXITED for c in self.children):
            if self.storing and self.phase is Phase.WARM:
                return      # still retrying their results, until graceful_timeout
            self._give_up_storing()
            self.phase = Phase.STOPPED

    def _give_up_storing(self) -> None:
        """Stopping with results still unstored: settle those messages without them."""
        for delivery in sorted(self.storing, key=lambda d: d.seq):
            if delivery.timer is not None:
                delivery.timer.cancel()
            log.error("%s: stopping before its result could be stored", delivery.label)
            assert delivery.settlement is not None
            outcome, decision, detail = delivery.settlement
            self._carry_out(delivery, outcome, self._without_result(delivery, decision), detail)
        self.storing.clear()


def _open_fds() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/fd")}


def _private_fds(baseline: set[int]) -> list[int]:
    """The sockets, pipes and event fds the supervisor opened since it started: a child
    must not keep them. Regular files (SQLite databases) are left to workhorse.forksafe."""
    private = []
    for fd in sorted(_open_fds() - baseline):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(("socket:", "pipe:", "anon_inode:")):
            private.append(fd)
    return private


def _redact(url: str) -> str:
    """Hide a password in a URL before logging it."""
    if "://" not in url or "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    credentials, _, host = rest.rpartition("@")
    user = credentials.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}" if ":" in credentials else url
