"""The loop thread's side of the broker: every call hands work to the broker thread and
returns at once; what comes back (messages, results, a lost or restored connection) is
run on the loop thread, from its selector, through the ``Wakeup`` it watches. One
exception, where it cannot wait: the acks and takes are carried out here while the broker
thread is parked: on SQLite as long as the file is free at once (``_take_here``), on Redis
sent from here and read when the answer comes (``_send_take``)."""
from __future__ import annotations

import contextlib
import logging
import select
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from functools import partial
from typing import TYPE_CHECKING, Any

from kombu.message import Message

from ..daemon import systemd
from .thread import Ack, BrokerThread, Command, Wakeup, message_label, say_failed
from ..daemon.loop import Timer
from .. import sqlitedb
from ..sqlitedb import said
from ..urls import redact
from .consumer import BrokerConsumer, SentAcks
from .journal import Journal

if TYPE_CHECKING:
    from ..app import App
    from ..daemon.loop import Loop

log = logging.getLogger("workhorse.supervisor")

#: A late ack waits at most this long to be sent with others (see ``BrokerLink.ack``).
ACK_DELAY = 0.005
#: A take sent by the loop thread (Redis) is abandoned if its answer takes this long: the
#: broker thread, parked for it meanwhile, makes its acks again.
SENT_TAKE_TIMEOUT = 1.0
#: At most this many takes sent here are out at once (see ``_send_take``).
MAX_SENT = 2
#: After a take sent here failed, the broker thread takes alone for this long.
SENT_TAKE_PAUSE = 5.0
#: The broker thread is taken to hang inside a call (and the watchdog is no longer pinged,
#: so systemd restarts the worker) once it has not turned for this long. Its calls time
#: out well before that; a broker that is down is retried, which counts as turning.
STALL_LIMIT = 60.0


class BrokerLink:
    def __init__(self, app: App, queues: list[str], loop: Loop,
                 on_message: Callable[[str, Message, int], None],
                 on_connected: Callable[[], None], on_lost: Callable[[BaseException], None],
                 on_gave_up: Callable[[BaseException], None],
                 prefetch: Callable[[], int], max_retries: int | None,
                 retry_on_startup: bool, acked_running: Callable[[], int] = lambda: 0) -> None:
        """``prefetch``: the window; ``acked_running``: how many of its running messages
        may be acked already (at start)."""
        self.queues = queues
        self.inbox = Wakeup()
        loop.add_reader(self.inbox.read_fd, self._run_posted)
        self.on_message = on_message
        self.on_connected_cb = on_connected
        self.on_lost_cb = on_lost
        self.where = redact(app.settings.broker_url)
        #: What the loop knows of the connection (set from the broker thread's reports).
        self.connected = False
        self.push = False       # RabbitMQ: pushes up to a credit, takes back on loss
        self.leased = False     # SQLite, Redis: leases to renew
        #: Queues whose broker holds a message for a while for us (hand_back_later).
        self.delayable: frozenset[str] = frozenset()
        self.takes_here = False     # SQLite, Redis: acks and takes on this thread (_take_here)
        #: Redis: takes are sent here and their answers read when they come (_send_take).
        self.splits = False
        #: RabbitMQ: acks at start are written here where the socket takes them at once
        #: (_ack_here).
        self.acks_here = False
        #: The takes sent here whose answers are awaited, in order, with their acks (the
        #: broker thread is parked for them), on ``_pipe``; and the deadline of the next.
        self._out: deque[SentAcks] = deque()
        self._out_acks: deque[list[Ack]] = deque()
        self._pipe: Any = None
        #: The fd and socket the loop watches for those answers: between takes too, as an
        #: idle reader (see ``_watch``).
        self._watching: tuple[int, Any] | None = None
        #: RabbitMQ: the socket whose deliveries this thread reads (lent by the broker
        #: thread, see ``_read_here``), and its connection's generation; -1: none.
        self._reading = (-1, -1)
        self._closing = False
        #: RabbitMQ quorum queues: each consumer's own prefetch, paced by the broker thread.
        self.paced = False
        self._out_timer: Timer | None = None
        #: When the oldest answer still out on ``_pipe`` is given up (``_out_due``).
        self._out_deadline = 0.0
        self._deferred = False
        self._sends_paused_until = 0.0
        self.received = 0       # messages handed to the loop so far (for Room)
        self._credit = -1
        self._credit_wanted = -1    # (what the supervisor last asked for: see set_credit)
        self.prefetch, self.acked_running = prefetch, acked_running
        self._window = -1           # the window the consumer was last told
        self.loop = loop
        #: Acks not yet handed to the broker thread, and whether one of them is urgent
        #: (an ack at start: its task waits for it). See ``ack``.
        self._acks: list[Ack] = []
        self._urgent = False
        self._ack_timer: Timer | None = None
        self._room_grew = False
        self._room_said: tuple[int, int] | None = None
        self._fetches = 0       # FETCH commands submitted (see set_room)
        self._status = f"connecting to the broker at {self.where}"     # (see _say_status)
        self._troubles_said = 0
        #: SQLite: a take, or acks, to carry out before the loop waits (_before_wait).
        self._want_fetch = self._want_acks = False
        loop.before_wait(self._before_wait)
        self.thread = BrokerThread(
            lambda received, lost: BrokerConsumer(app, queues, received, lost),
            self.inbox.put, self._message, self._connected, self._lost, on_gave_up, prefetch,
            max_retries, retry_on_startup, acked_running=acked_running)
        self.thread.lend_reads = self._reads_lent

    def start(self) -> None:
        self.thread.start()

    def use_journal(self, journal: Journal) -> None:
        """Before ``start``: the worker's journal, which the broker thread writes what it
        takes into (and reads the journals of dead workers beside)."""
        self.thread.consumer.use_journal(journal)

    def parked(self) -> AbstractContextManager[bool]:
        """Around fork(): True while the broker thread is parked (see BrokerThread.parked);
        a take sent here keeps it parked (it waits for the gate this thread holds)."""
        if self._pipe is not None:
            return contextlib.nullcontext(True)
        return self.thread.parked()

    def close(self, timeout: float) -> None:
        """After everything submitted so far: close the connection, end the thread. A
        broker that does not answer within ``timeout`` is left behind (what we did not
        settle comes back from the broker)."""
        self._finish_sent(timeout)
        self._closing = True
        self._stop_reading()            # (the socket is closed with the connection)
        if not self.thread.is_alive():
            self._run_posted()          # its last log records (it gave up, say)
            return
        self.flush()
        self.thread.stop()
        deadline = time.monotonic() + timeout
        while self.thread.is_alive() and time.monotonic() < deadline:
            self.thread.join(0.05)
            self._run_posted()          # its last log records
        if self.thread.is_alive():
            log.warning("the broker did not answer within %.0f s at shutdown; what was not "
                        "settled comes back from it", timeout)

    # ------------------------------------------------------------------ health
    def healthy(self) -> bool:
        """The broker thread turns: connected, or retrying a broker it cannot reach. False
        when it died or hangs inside a call (then the watchdog lets systemd restart us)."""
        return (self.thread.is_alive()
                and time.monotonic() - self.thread.progress < STALL_LIMIT)

    def describe(self) -> str:
        age = time.monotonic() - self.thread.progress
        state = "connected" if self.connected else "not connected"
        return f"broker {self.where} {state}, its thread last turned {age:.1f} s ago"

    # ------------------------------------------------------------------ room and credit
    @property
    def room_read_before_wait(self) -> bool:
        """SQLite and Redis while the takes are made on the loop thread (``_take_here``):
        the room said is read when the loop is about to wait (``_before_wait``), or by a
        take the ack timer makes meanwhile, which then takes less at most. RabbitMQ's
        credit, and a broker thread that fetches, act on it at once."""
        return self.takes_here and not self.push

    @property
    def batch(self) -> int:
        """Free places worth a fetch of their own while children still have work buffered,
        and acks worth a wakeup of their own: half the prefetch window; three quarters
        where the take is done here (``_take_here``), since it arrives before the loop
        waits, not a round trip and a thread's wakeup later, and each transaction costs
        the loop's own time."""
        window = self.thread.prefetch()
        return max(1, window * 3 // 4 if self.takes_here else window // 2)

    def set_room(self, free: int, starved: bool = True) -> None:
        """Free places in the window (0: take nothing). More room than before wakes the
        broker thread to fetch: at once if ``starved`` (nothing is buffered for a child),
        else once ``batch`` places are free, so that one round trip takes several; and
        only once the fetch before has been carried out. (The broker thread reads the room
        when it takes, so one fetch in flight takes what was freed while it waited: a
        fetch for each place freed kept it busy taking one or two messages a round trip,
        while children starved.) RabbitMQ pushes instead, as its credit allows: a fetch
        would only wake the broker thread to find nothing, so it goes only to carry acks
        that are not written here (``_ack_here``)."""
        said = (free, self.received)
        if said != self._room_said:     # (the same count again cannot be more room)
            self._room_said = said
            if self.thread.room.update(free, self.received):
                self._room_grew = True          # since the last fetch
        if self._room_grew and self._fetches == self.thread.fetches_done:
            available = self.thread.room.available()
            if available > 0 and (starved or available >= self.batch):
                self._room_grew = False
                if self.takes_here:
                    self._want_fetch = True     # before the loop waits: see _before_wait
                elif not (self.acks_here and (not self._acks or self._ack_here())):
                    self._fetch()
                elif starved and self.paced and self._reading[0] >= 0:
                    # Quorum queues: the broker thread's poll restarts consumers paused for
                    # the window (``BrokerConsumer._pace``). While the loop reads and acks,
                    # nothing else wakes it but its 1 s safety poll: a starved window does.
                    self._fetch()
                return
        if (self._urgent or len(self._acks) >= self.batch
                or (starved and self._acks and self.push)):
            if self.takes_here:
                self._want_acks = True
            else:
                self.flush()

    def _fetch(self) -> None:
        """Hand the acks held back and a FETCH to the broker thread."""
        self.flush(here=False)
        self._fetches += 1
        self.thread.fetch()

    def _before_wait(self) -> None:
        """SQLite, Redis: the acks and the take this turn asked for, once the turn is done
        (its jobs handed to the children, which run them meanwhile), before the loop
        waits: from this thread where that never waits, else handed to the broker thread.
        RabbitMQ: more credit asked for in the turn (``_send_credit``)."""
        if self._credit_wanted != self._credit and self._credit >= 0:
            self._send_credit()
        fetch, acks = self._want_fetch, self._want_acks
        if not (fetch or acks):
            return
        self._want_fetch = self._want_acks = False
        # An ack at start that the room did not ask a take for goes alone (SQLite): taking
        # the one place each start's task had freed made every start a take of one.
        if self._take_here(take=fetch or not self._urgent):
            return
        if fetch and self._fetches == self.thread.fetches_done:
            self._fetch()
        elif self._acks:
            self.flush(here=False)

    def set_credit(self, count: int) -> None:
        window = self.prefetch()
        if window != self._window and self.push:
            # (the pool's size moves the window with it, and with it the running that
            # may be acked already)
            self._window, acked = window, self.acked_running()
            self.submit(lambda c: c.resize(window, acked), "resizing the prefetch window")
        self._credit_wanted = count
        if count < self._credit or self._credit < 0:
            self._send_credit()

    def _send_credit(self) -> None:
        """The credit the supervisor last asked for, if the broker was told another. Less
        credit goes at once: it must reach the broker before the acks that follow it (an
        ack at start frees a place the running task still holds). More credit waits for
        the end of the turn (``_before_wait``): a task that finished gives its place back,
        and the ack at start of the next one, in the same turn, takes it again; told at
        once, each of them cost RabbitMQ a ``basic.qos`` (two a task with acks at
        start), where the turn's net change is usually none."""
        count = self._credit_wanted
        if count != self._credit:
            self._credit = count
            self.submit(lambda c: c.set_credit(count), "setting the prefetch credit")

    # ------------------------------------------------------------------ settling
    def submit(self, command: Command, what: str) -> None:
        """Run ``command`` on the broker thread, after the acks made before it."""
        if self._acks:
            self.flush(here=self._pipe is None)
        self.thread.submit(command, what)

    def ack(self, message: Message) -> None:
        """A late ack (the task is over; nothing here waits for it) is held back until the
        loop hands the broker thread something else (a fetch, the end of a turn with
        ``batch`` acks waiting) or ACK_DELAY has passed, so acks travel several to a
        round trip (RabbitMQ, while the broker thread reads the deliveries: until the end
        of the turn, see below; while they are read here, as the others, or until no
        message is buffered for a child, see ``set_room``). What it widens is
        the window in which a supervisor killed outright leaves a finished task unacked
        (it is delivered again, as docs/delivery.md allows; with its result stored it is not run
        again) by at most ACK_DELAY."""
        self._acks.append(Ack(message))
        if self.push and self._reading[0] < 0:
            # RabbitMQ sends the next messages only as acks free its credit: an ack held
            # back would hold them back. These go at the end of the turn. (Read here, the
            # deliveries wake no thread, and the acks of one or two tasks a write cost
            # RabbitMQ more than held back: 1.23x the tasks a second. They go when half
            # the window's worth waits, or no message is buffered for a child.)
            self._urgent = True
        elif self._ack_timer is None:
            self._ack_timer = self.loop.call_later(ACK_DELAY, self.flush)

    def ack_then(self, message: Message, then: Callable[[BaseException | None], None]) -> None:
        """Ack, then run ``then(error or None)`` on the loop thread; sent at the end of
        this turn of the loop, with the other acks made in it."""
        self._acks.append(Ack(message, then))
        self._urgent = True

    def flush(self, here: bool = True) -> None:
        """Hand the acks held back to the broker thread (one wakeup for all); on SQLite,
        Redis and RabbitMQ, carry them out here at once where that never waits
        (``_take_here``, ``_ack_here``), unless ``here`` is False."""
        self._cancel_ack_timer()
        if not self._acks or (here and (self._take_here() or self._ack_here())):
            return
        acks, self._acks, self._urgent = self._acks, [], False
        self.thread.submit_acks(acks)

    def _cancel_ack_timer(self) -> None:
        if self._ack_timer is not None:
            self._ack_timer.cancel()
            self._ack_timer = None

    def _take_here(self, take: bool = True) -> bool:
        """SQLite: the acks held back and a take of what there is room for (none unless
        ``take``), in one transaction carried out here, on the loop thread, as the broker
        thread would (``BrokerConsumer.take_now``): no thread to wake, and no interpreter
        lock handed between two threads for every batch. Only while the broker thread is
        parked with nothing submitted to it (nothing is overtaken), and only if it never
        waits: the file's lock held by another process, or any trouble with the file, and
        it is not done (False), and the caller hands it to the broker thread as before.
        (Redis sends the take with its acks whatever ``take`` says: a take of its own would
        be a round trip of its own, and an ack at start sent behind it would wait for it.)"""
        if not self.takes_here:
            return False
        if self.splits:
            return self._send_take()
        acks = self._acks
        with self.thread.borrowed() as consumer:
            if consumer is None:
                return False
            try:
                errors = consumer.take_now([ack.message for ack in acks], take)
            except Exception as exc:  # a bug: said, and each ack fails with it
                log.error("acking %d messages and taking on the loop thread failed: %r",
                          len(acks), exc, exc_info=exc)
                errors = [exc for _ in acks]
            if errors is None:
                return False
            counted = self.thread.counted_arrivals()
            failed = [(ack, error) for ack, error in zip(acks, errors, strict=True)
                      if error is not None and ack.then is None]
            for ack, error in failed:
                say_failed(consumer, error, f"{message_label(ack.message)}: ack")
            unburied = consumer.has_unburied()
        self._cancel_ack_timer()
        self._acks, self._urgent = [], False
        for ack, outcome in zip(acks, errors, strict=True):
            if ack.then is not None:        # as the broker thread posts it: next turn
                self.loop.call_later(0, partial(ack.then, outcome))
        if unburied:
            self.thread.submit(lambda c: c.bury_unburied(), "burying unreadable entries")
        for arrived in counted:
            self._message(*arrived)
        if counted:     # the loop looks at them before it waits again
            self.loop.call_later(0, _nothing)
        return True

    def _ack_here(self) -> bool:
        """RabbitMQ, while the deliveries are read here (``_read_here``), or when an ack at
        start is among them (its task waits for it): the acks held back written here, on
        the loop thread, as the broker thread writes them (``BrokerConsumer.ack_now``): no
        thread to wake and no interpreter lock handed over, and a task waiting for its
        ack starts in the next turn, not after the broker thread's. (Late acks alone,
        while the broker thread reads the deliveries, go to it: it writes several turns'
        at once with the deliveries it reads; written here, one or two a write, they
        cost 0.94x the tasks a second.) Only while the broker thread is parked with
        nothing submitted to it (nothing is overtaken, and nothing else writes on the
        connection), and only if the socket takes the frames at once; else nothing is
        written (False) and the caller hands them to the broker thread. The socket taking
        a part: the broker thread writes the rest before anything else, and only then are
        they acked (``BrokerThread.submit_unsent``)."""
        acks = self._acks
        if not self.acks_here or (self._reading[0] < 0
                                  and all(ack.then is None for ack in acks)):
            return False
        with self.thread.borrowed() as consumer:
            if consumer is None:
                return False
            try:
                written = consumer.ack_now([ack.message for ack in acks])
            except Exception as exc:  # a bug: said; the broker thread acks them
                log.error("acking %d messages on the loop thread failed: %r", len(acks), exc,
                          exc_info=exc)
                return False
            if written is None:
                return False
            if not written:     # before it wakes: it sends the rest first
                self.thread.submit_unsent(acks)
        self._acks, self._urgent = [], False
        if written:
            for ack in acks:
                if ack.then is not None:    # as the broker thread posts it: next turn
                    self.loop.call_later(0, partial(ack.then, None))
        return True

    def _send_take(self) -> bool:
        """Redis: the acks held back and a take of what there is room for, sent from here
        (one script, as the broker thread sends it), the answer read when the socket is
        readable (``_read_sent``): no thread woken, no interpreter lock handed over, and
        the loop never waits. The broker thread is kept parked until every answer is in.
        While one is out, the next waits for its answer (so that one round trip carries
        what several would), unless an ack at start is among them (its task waits for
        it): that one is sent at once, behind it, with a take of the room that is left.
        True if sent, or left for the next (its acks stay held); False if the broker
        thread is to do it (busy, or it cannot be sent at once)."""
        pipe = self._pipe
        if pipe is not None and (not self._urgent or len(self._out) >= MAX_SENT):
            self._deferred = True       # asked again once an answer is in (_read_sent)
            return True
        if pipe is None:
            if not self._acks and self.thread.room.available() <= 0:
                return True             # nothing to ask
            if time.monotonic() < self._sends_paused_until:
                return False
            consumer = self.thread.borrow()
            if consumer is None:
                return False
        else:
            consumer = self.thread.consumer
        acks = self._acks
        try:
            sent = consumer.take_send([ack.message for ack in acks], pipe)
        except Exception as exc:  # noqa: BLE001 - the pipe is closed: its takes are over
            if pipe is not None:
                self._sent_failed(exc)
                return True
            log.warning("sending a take from the loop thread failed (%r); the broker thread "
                        "takes alone for %.0f s", exc, SENT_TAKE_PAUSE)
            self._sends_paused_until = time.monotonic() + SENT_TAKE_PAUSE
            sent = None
        if sent is None:
            if pipe is None:
                self.thread.give_back()
                return False
            self._deferred = True       # (the socket is full: with the next answer)
            return True
        self._cancel_ack_timer()
        self._acks, self._urgent = [], False
        self._out.append(sent)
        self._out_acks.append(acks)
        if pipe is None:
            self._pipe = sent.pipe
            self._out_deadline = self.loop.clock() + SENT_TAKE_TIMEOUT
            if self._out_timer is None:
                self._out_timer = self.loop.call_at(self._out_deadline, self._out_due)
            self._watch(sent.pipe)
        return True

    def _watch(self, pipe: Any) -> None:
        """Read ``pipe``'s answers when its socket is readable. The registration outlives
        the pipe (``_end_pipe``), idle: the next take on the same socket, usually the
        next turn's, takes it back without a system call (two a take, removed and added
        again, where each ack at start is a take of its own). Another socket (a reconnect,
        maybe on the same number): the old registration goes, if it is still ours."""
        watching = (pipe.fd, pipe.sock)
        if self._watching is not None and (
                self._watching[0] == pipe.fd and self._watching[1] is pipe.sock):
            self.loop.resume_reader(pipe.fd, self._read_sent)
            return
        self._unwatch()
        self.loop.add_reader(pipe.fd, self._read_sent)
        self._watching = watching

    def _unwatch(self) -> None:
        if self._watching is not None:
            self.loop.remove_reader(self._watching[0], self._read_sent)
            self._watching = None

    def _read_sent(self) -> None:
        if self._pipe is None:
            # Idle, and readable: the connection is the broker thread's again, and this is
            # its answer (or the connection closing). Not ours to read: watched no more.
            self._unwatch()
            return
        consumer = self.thread.consumer
        try:
            answered = consumer.take_read(self._pipe, self._out)
        except Exception as exc:  # noqa: BLE001 - the pipe is closed: its takes are over
            self._sent_failed(exc)
            return
        if not answered:
            return                  # not whole yet
        outcomes = []
        for sent in answered:
            acks = self._out_acks.popleft()
            for ack, error in zip(acks, sent.errors, strict=True):
                if error is not None and ack.then is None:
                    say_failed(consumer, error, f"{message_label(ack.message)}: ack")
            outcomes += [partial(ack.then, error)
                         for ack, error in zip(acks, sent.errors, strict=True)
                         if ack.then is not None]
        counted = self.thread.counted_arrivals()
        unburied = consumer.has_unburied()
        dry = consumer.found_empty()
        if self._out:               # the next answer has its own second from now
            self._out_deadline = self.loop.clock() + SENT_TAKE_TIMEOUT
        else:
            self._end_pipe()
            self.thread.give_back()
            if unburied:
                self.thread.submit(lambda c: c.bury_unburied(), "burying unreadable entries")
            elif dry:
                self.thread.nudge()     # it arms the waits on the empty lists
        if self._deferred:          # acks held, or a take asked for, meanwhile
            self._deferred = False
            if self._urgent:            # an ack at start waits: before the loop waits
                self._want_fetch = True
            else:
                # A take asked for while this one was out is asked again by the room said
                # next, which knows what this answer brought (sent now, it took the one or
                # two places freed meanwhile: a round trip for little). Late acks held
                # meanwhile go within ACK_DELAY, or with that take.
                self._room_grew = True
                if self._acks and self._ack_timer is None:
                    self._ack_timer = self.loop.call_later(ACK_DELAY, self.flush)
        for then in outcomes:       # as the broker thread posts them: next turn
            self.loop.call_later(0, then)
        for arrived in counted:
            self._message(*arrived)
        if counted:
            self.loop.call_later(0, _nothing)

    def _end_pipe(self) -> None:
        self.loop.idle_reader(self._pipe.fd)
        self._pipe = None

    def _out_due(self) -> None:
        """The timer that gives up on an answer not in by ``_out_deadline``: one timer,
        moved on only when it is due, where one made and cancelled for every take cost a
        timer and two heap operations a task with acks at start. Due with no pipe (its
        answers all in), it goes; the next pipe makes another."""
        self._out_timer = None
        if self._pipe is None:
            return
        if self.loop.clock() < self._out_deadline:
            self._out_timer = self.loop.call_at(self._out_deadline, self._out_due)
            return
        self._sent_late()

    def _sent_late(self) -> None:
        self._sent_failed(TimeoutError(f"no answer from Redis in {SENT_TAKE_TIMEOUT:.0f} s"))

    def _sent_failed(self, exc: BaseException) -> None:
        """The takes sent here are over without an answer (given up, the pipe's connection
        closed): their acks go to the broker thread, to be made again (a lease acked
        already is found gone); what they may have leased comes back when its lease runs
        out."""
        pipe = self._pipe
        acks = [ack for batch in self._out_acks for ack in batch]
        self._out.clear()
        self._out_acks.clear()
        self._end_pipe()
        self._unwatch()             # (before its socket is closed)
        try:
            pipe.close()
        finally:
            self.thread.give_back()
        log.warning("a take sent from the loop thread failed (%r); the broker thread makes "
                    "its %d acks again, and takes alone for %.0f s", exc, len(acks),
                    SENT_TAKE_PAUSE)
        self._sends_paused_until = time.monotonic() + SENT_TAKE_PAUSE
        self._acks[:0] = acks
        self._fetch()

    def _finish_sent(self, timeout: float) -> None:
        """At shutdown: the answers of the takes sent here, waited for (``timeout`` at
        most)."""
        deadline = time.monotonic() + min(timeout, SENT_TAKE_TIMEOUT)
        while self._pipe is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                self._sent_late()
                break
            select.select([self._pipe.fd], [], [], left)
            self._read_sent()

    def requeue(self, queue: str, message: Message) -> None:
        self.submit(lambda c: c.requeue(queue, message), f"{message_label(message)}: requeue")

    def requeue_counted(self, queue: str, message: Message, deliveries: int) -> None:
        self.submit(lambda c: c.requeue_counted(queue, message, deliveries),
                    f"{message_label(message)}: requeue (counted)")

    def requeue_held_loss(self, queue: str, message: Message) -> None:
        self.submit(lambda c: c.requeue_held_loss(queue, message),
                    f"{message_label(message)}: requeue (a held loss)")

    def hand_back(self, queue: str, message: Message) -> None:
        self.submit(lambda c: c.hand_back(queue, message), f"{message_label(message)}: hand back")

    def hand_back_later(self, queue: str, message: Message, seconds: int) -> None:
        self.submit(lambda c: c.hand_back_later(queue, message, seconds),
                    f"{message_label(message)}: hand back for {seconds} s")

    def republish(self, queue: str, message: Message, headers: Mapping[str, Any]) -> None:
        self.submit(lambda c: c.republish(queue, message, headers),
                    f"{message_label(message)}: put back")

    def dead_letter(self, queue: str, message: Message, reason: str, task_id: str | None,
                    worker: str, *, acked: bool, or_requeue: bool = False) -> None:
        """Dead-letter; ``or_requeue``: if that fails (not for a lost connection), give it
        back to its queue instead (a malformed message must not stay held)."""
        def command(consumer: BrokerConsumer) -> None:
            try:
                consumer.dead_letter(queue, message, reason, task_id, worker, acked=acked)
            except Exception as exc:
                if not or_requeue or acked or consumer.is_connection_error(exc):
                    raise
                log.error("%s: could not dead-letter it (%r); it goes back to %s",
                          message_label(message), exc, queue)
                consumer.requeue(queue, message)
        self.submit(command, f"{message_label(message)}: dead-letter")

    def forget(self, message: Message) -> None:
        self.submit(lambda c: c.forget(message), f"{message_label(message)}: forget a lost lease")

    def check_alive(self, then: Callable[[], None]) -> None:
        """After the loop was away: the broker thread reads what the connection holds and
        checks the broker's heartbeats (``BrokerConsumer.check_alive``), then ``then()``
        runs on the loop thread, after the loss of the connection if it found one."""
        def command(consumer: BrokerConsumer) -> None:
            try:
                consumer.check_alive()
            finally:
                self.inbox.put(then)
        self.submit(command, "checking the connection after the loop was away")

    def lease_set_at(self, message: Message) -> float | None:
        """When the lease of ``message`` was taken or last renewed (epoch seconds, the clock
        its broker's sweep reads); None where this worker knows of none (RabbitMQ, or the
        lease is settled or found lost). A look at its channel's own record, one dict
        read, made on the loop thread while the broker thread may change it."""
        if not self.leased:
            return None
        lease_set_at = getattr(message.channel, "lease_set_at", None)
        return None if lease_set_at is None else lease_set_at(message.delivery_tag)

    def renew(self, messages: list[Message],
              then: Callable[[list[Message]], None]) -> None:
        """Renew the leases of ``messages``; ``then(lost)`` runs on the loop thread."""
        def command(consumer: BrokerConsumer) -> None:
            lost = consumer.renew(messages)
            self.inbox.put(lambda: then(lost))
        self.submit(command, "renewing leases")

    def cancel(self) -> None:
        self.submit(lambda c: c.cancel(), "cancelling the consumers")

    def add_queue(self, queue: str) -> threading.Event | None:
        """Consume ``queue`` too; None if it is consumed already, else an event the broker
        thread sets once it consumes it (or will, at its next connect)."""
        if queue in self.queues:
            return None
        self.queues.append(queue)
        return self._then_set(lambda c: c.add_queue(queue), f"consuming {queue}")

    def cancel_queue(self, queue: str) -> threading.Event | None:
        """Stop consuming ``queue``; None if it is not consumed, else an event the broker
        thread sets once it no longer fetches from it."""
        if queue not in self.queues:
            return None
        self.queues.remove(queue)
        return self._then_set(lambda c: c.cancel_queue(queue), f"no longer consuming {queue}")

    def _then_set(self, command: Command, what: str) -> threading.Event:
        """Submit ``command``; the event is set once the broker thread has run it."""
        done = threading.Event()

        def run(consumer: BrokerConsumer) -> None:
            try:
                command(consumer)
            finally:
                done.set()
        self.submit(run, what)
        return done

    def is_connection_error(self, exc: BaseException) -> bool:
        return False        # nothing here raises: the broker thread logs its own errors

    # ------------------------------------------------------------------ from the thread
    def _run_posted(self) -> None:
        for callback in self.inbox.take():
            callback()

    def _message(self, queue: str, message: Message, deliveries: int) -> None:
        self.received += 1
        self.on_message(queue, message, deliveries)

    def _connected(self, consumer: BrokerConsumer, ok: bool) -> None:
        """Reported by the broker thread after each attempt to connect."""
        if not ok:
            self._say_status(f"waiting for the broker at {self.where}")
            return
        self.connected, self.push, self.leased = True, consumer.push, consumer.leased
        self.delayable = consumer.delayable()
        self.splits = consumer.takes_split
        self.takes_here = consumer.takes_at_once or self.splits
        self.acks_here = consumer.acks_at_once
        self.paced = bool(getattr(consumer, "per_consumer", 0))
        self._credit = -1
        self._say_status(f"consuming {', '.join(self.queues)}")
        self.on_connected_cb()

    # ------------------------------------------------------------------ reading here
    def _reads_lent(self, fd: int, generation: int) -> None:
        """The broker thread is idle and lends the reading of the deliveries of connection
        ``generation`` (on socket ``fd``): read here when the socket is readable. Posted,
        it may come late: the connection closed since (its loss is reported after this),
        the number closed or another file's already; then it is not taken (the broker
        thread lends the next connection's reading). ``fd`` -1: the broker thread took the
        reading back (consuming was cancelled)."""
        self._stop_reading()
        if fd < 0 or self._closing or fd in self.loop.readers():
            return
        try:
            self.loop.add_reader(fd, self._read_here)
        except OSError:     # (EBADF: closed with its connection)
            return
        self._reading = (fd, generation)

    def _stop_reading(self) -> None:
        fd = self._reading[0]
        if fd >= 0:
            self.loop.remove_reader(fd, self._read_here)
            self._reading = (-1, -1)

    def _read_here(self) -> None:
        """RabbitMQ: the deliveries the socket holds, read here, never waiting, while the
        broker thread is parked with nothing submitted to it, its frames handed over whole
        (``BrokerConsumer.read_now``); no thread woken and no interpreter lock handed over
        for each batch. Where that cannot be done (the broker thread is busy, the socket
        cannot be read so, a connection of another generation, or it failed: the broker
        thread reports the loss), the reading goes back to the broker thread, which reads
        what is there and lends it again once idle. A redelivered message whose count is
        carried by a published copy (which waits for a confirm) is left to it too."""
        consumer = self.thread.borrow()
        if consumer is None:
            self._reads_back()
            return
        try:
            read = (consumer.read_now() if consumer.generation == self._reading[1]
                    else None)
            counted = self.thread.counted_arrivals(publishing=False) if read else []
            left = self.thread.has_arrivals()
        finally:
            self.thread.give_back()
        if read is None:
            self._reads_back()
        elif left:
            self.thread.nudge()         # its turn counts them and hands them over
        for arrived in counted:
            self._message(*arrived)
        if counted:         # the loop looks at them before it waits again
            self.loop.call_later(0, _nothing)

    def _reads_back(self) -> None:
        self._stop_reading()
        self.thread.reads_back()

    def _lost(self, exc: BaseException) -> None:
        self._stop_reading()
        self.connected = self.takes_here = self.splits = self.acks_here = False
        if self._pipe is not None:
            self._sent_failed(exc)
        # A file's trouble said already is in STATUS by itself (_say_status).
        self._say_status("broker connection lost; reconnecting" if said(exc) else
                         f"broker connection lost ({exc!r}); reconnecting")
        self.on_lost_cb(exc)

    def _say_status(self, status: str | None = None) -> None:
        """systemd's STATUS=: ``status`` (else the last one said), then the troubles of this
        process's SQLite files going on now (``sqlitedb.troubles``): a full disk stays in
        STATUS while it lasts, whatever the connection does meanwhile."""
        if status is not None:
            self._status = status
        self._troubles_said = sqlitedb.troubles.changes
        systemd.notify("STATUS=" + "; ".join([self._status, *sqlitedb.troubles.now()]))

    def say_troubles(self) -> None:
        """Bring STATUS= up to date with the SQLite files' troubles if they changed (the
        broker thread's calls begin and end them; the supervisor's timer calls this)."""
        if sqlitedb.troubles.changes != self._troubles_said:
            self._say_status()


def _nothing() -> None:
    return None
