"""Broker I/O on a thread of its own, so the supervisor's loop never waits on the broker.

Who owns what:
- The broker thread owns the ``BrokerConsumer`` and every kombu object of its connection
  (channels, drivers, sockets), and its own ``Loop`` (housekeeping timers, reconnect
  back-off). Nothing else touches them.
- The loop thread owns everything else: what is held, the children, the settings.
- They talk through two queues of closures, each with a wakeup pipe the receiving loop
  watches: ``submit`` runs a closure on the broker thread with the consumer; ``post`` runs
  one on the loop thread. ``Room`` (under a lock) says how many more messages the broker
  thread may take, and ``progress`` (written by the broker thread) when it last turned.

The broker thread never writes to stdout or stderr itself: log records made on it (its
own, and kombu's or redis-py's) are handed to the loop thread to emit, so it never holds a
lock on a stream when the loop thread forks a child.
"""
from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

from kombu.message import Message

from ..sqlitedb import said
from ..transport.rabbitmq import BrokerBlocked
from .consumer import BrokerConsumer, BrokerUnavailable
from ..daemon.loop import Loop
from .backoff import LASTED, backoff


log = logging.getLogger("workhorse.broker")

Command = Callable[[BrokerConsumer], None]
#: Makes the session of the connection (``BrokerConsumer``) from what it reports to.
Session = Callable[[Callable[[str, Message], None], Callable[[BaseException], None]],
                   BrokerConsumer]
Callback = Callable[[], None]
#: The broker thread turns at least this often when idle (its progress stays fresh).
IDLE_TURN = 1.0
#: A publish refused while RabbitMQ blocks publishers is tried again this much later.
BLOCKED_RETRY = 1.0


class Wakeup:
    """A queue of closures and a pipe that says something is in it."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[Callable[..., None]] = queue.SimpleQueue()
        self.read_fd, self.write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._signalled = False

    def put(self, item: Callable[..., None]) -> None:
        self.queue.put(item)
        self._wake()

    def put_many(self, items: list[Any]) -> None:
        for item in items:
            self.queue.put(item)
        self._wake()

    def _wake(self) -> None:
        # One byte per batch of puts the reader has not taken yet, not one per put. Safe
        # against a lost wakeup: the reader empties the pipe, then clears the flag, then
        # empties the queue; an item put after the flag is cleared writes a byte that
        # stays in the pipe, and one put before it is in the queue when it is emptied.
        if self._signalled:
            return
        self._signalled = True
        try:
            os.write(self.write_fd, b"\0")
        except BlockingIOError:
            pass            # the pipe is full: the reader is awake already

    def take(self) -> list[Callable[..., None]]:
        # One read empties the pipe: it holds a byte or two (see _wake), and a read returns
        # what is there. (Reading on to EAGAIN cost a system call per wakeup; a byte left
        # over would only wake the reader once more, to find nothing.)
        try:
            os.read(self.read_fd, 4096)
        except BlockingIOError:
            pass
        self._signalled = False     # after emptying the pipe: a byte written from now on stays
        items = []
        while True:
            try:
                items.append(self.queue.get_nowait())
            except queue.Empty:
                return items

    def fds(self) -> tuple[int, int]:
        return self.read_fd, self.write_fd


class Ack:
    """A command to ack ``message`` (``then(error or None)`` is posted to the loop thread
    afterwards, if given). The acks submitted one after another are carried out together,
    in one round trip where the broker allows (``BrokerConsumer.ack_many``)."""

    __slots__ = ("message", "then")

    def __init__(self, message: Message,
                 then: Callable[[BaseException | None], None] | None = None) -> None:
        self.message = message
        self.then = then

    def __call__(self, consumer: BrokerConsumer) -> None:
        """Alone (the broker thread batches them instead): ack, raising what fails."""
        consumer.ack(self.message)


class _Fetch:
    """The command to take what there is room for, after the acks submitted with it (in
    one round trip where the broker allows). However often it is submitted in one turn,
    it is carried out once, after the turn's other commands."""

    def __call__(self, consumer: BrokerConsumer) -> None:
        """Alone (the broker thread carries it with the acks instead)."""
        if consumer.connected:
            consumer.poll()

    def __repr__(self) -> str:
        return "FETCH"


FETCH = _Fetch()


class Room:
    """How many more messages the broker thread may take: the loop thread's count of free
    places in its window, less what the broker thread took since that count was made."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free = 0
        self._as_of = 0        # messages the loop had received when it counted
        self._taken = 0        # messages the broker thread has taken

    def update(self, free: int, received: int) -> bool:
        """Loop thread: ``free`` places, counted after receiving ``received`` messages.
        True if that is more room than before (the broker thread may fetch again)."""
        with self._lock:
            before = self._free - (self._taken - self._as_of)
            self._free, self._as_of = free, received
            return self._free - (self._taken - self._as_of) > before

    def available(self) -> int:
        with self._lock:
            return self._free - (self._taken - self._as_of)

    def took(self) -> None:
        with self._lock:
            self._taken += 1

    def gave_back(self) -> None:
        """A message taken (``took``) that the loop will never receive (RabbitMQ's
        redelivery replaced by a counted copy): its place is free again. Without this, each
        one shrank the room for good, until a worker took nothing more."""
        with self._lock:
            self._taken -= 1


class BrokerThread:
    """Connects (with back-off, from the start), consumes, settles, renews, reconnects.

    It runs a ``threading.Thread`` rather than being one: CPython calls private methods of
    every Thread in a forked child (``_stop``, ``_delete``), and a subclass's method of the
    same name would run there, on the parent's broker connection."""

    #: ``FETCH`` commands carried out so far (written by this thread only): the loop
    #: thread, which counts those it submitted, keeps one in flight at a time.
    fetches_done = 0

    def __init__(self, session: Session, post: Callable[[Callback], None],
                 on_message: Callable[[str, Message, int], None],
                 on_connected: Callable[[BrokerConsumer, bool], None],
                 on_lost: Callable[[BaseException], None],
                 on_gave_up: Callable[[BaseException], None],
                 prefetch: Callable[[], int], max_retries: int | None,
                 retry_on_startup: bool, clock: Callable[[], float] = time.monotonic,
                 acked_running: Callable[[], int] = lambda: 0) -> None:
        """``session(on_message, on_lost)`` makes the connection's session (a
        ``BrokerConsumer``; tests give a fake), which reports to this thread."""
        self.thread = threading.Thread(target=self._run, name="broker", daemon=True)
        self.post = post
        self.on_message = on_message
        self.on_connected = on_connected
        self.on_lost = on_lost
        self.on_gave_up = on_gave_up
        self.prefetch = prefetch
        #: How many of the window's running messages may be acked already (at start).
        self.acked_running = acked_running
        #: Failed attempts in a row before giving up (None: never); the first connection
        #: gives up at its first failure unless retry_on_startup.
        self.max_retries = max_retries
        self.retry_on_startup = retry_on_startup
        self.room = Room()
        self.commands = Wakeup()
        self.consumer = session(self._received, self._lost)
        self.loop = Loop(clock)
        #: Monotonic time the thread last turned: stale means it hangs inside a call.
        self.progress = clock()
        #: Held by this thread whenever it is not parked in select(): see ``parked``.
        self.gate = threading.Lock()
        self._stopping = False
        self._attempts = 0          # failed connects since the last success
        self._lost_to: BaseException = BrokerUnavailable()     # what the last loss was
        self._first = True
        #: Commands waiting for RabbitMQ to unblock publishing (0: not blocked).
        self._blocked = 0
        #: Messages kombu handed over during the call running now (a drain, a connect).
        self._arrived: list[tuple[str, Message]] = []
        #: The consumer's sockets the loop watches, and the connection they belong to.
        self._watched: set[int] = set()
        self._watched_generation = -1
        #: Set by the loop thread before ``start``: told ``(fd, generation)`` when the
        #: reading of a connection's deliveries is lent to it (RabbitMQ; see ``_prepare``).
        self.lend_reads: Callable[[int, int], None] | None = None
        #: The generation of the connection whose reads are lent to the loop thread.
        self._lent: int | None = None
        #: The loop thread has the consumer (``borrow``), this thread is parked.
        self._borrowed = False

    # ------------------------------------------------------------------ loop thread's API
    def submit(self, command: Command, what: str = "") -> None:
        """Run ``command(consumer)`` on the broker thread, after every one submitted before.
        An error it raises is logged there, naming ``what``; it never comes back. A publish
        that RabbitMQ refuses because it blocks publishers (a memory or disk alarm) waits:
        the command is run again every BLOCKED_RETRY seconds until the alarm clears."""
        self.commands.put(self._guarded(command, what))

    def fetch(self) -> None:
        """Take what there is room for (see ``FETCH``)."""
        self.commands.put(FETCH)

    def submit_acks(self, acks: list[Ack]) -> None:
        """Ack messages on the broker thread, together with the acks submitted right
        before or after them (see ``Ack``)."""
        self.commands.put_many(acks)

    def submit_unsent(self, acks: list[Ack]) -> None:
        """Acks the loop thread wrote in part (``BrokerConsumer.ack_now``): the rest sent
        here, then each one's outcome posted, as for the acks made here."""
        self.commands.put(lambda consumer: self._finish_acks(acks))

    def _guarded(self, command: Command, what: str) -> Command:
        def run(consumer: BrokerConsumer) -> None:
            try:
                command(consumer)
            except BrokerBlocked as exc:
                if not self._blocked:
                    log.warning("RabbitMQ blocks publishing (%s): requeues, dead letters and "
                                "hand-backs wait, tried again every %.0f s; running tasks go "
                                "on", exc, BLOCKED_RETRY)
                self._blocked += 1
                self.loop.call_later(BLOCKED_RETRY, lambda: run(self.consumer))
                return
            except Exception as exc:  # noqa: BLE001 - logged; the broker delivers it again
                say_failed(consumer, exc, what)
                return
            if self._blocked:
                log.info("RabbitMQ publishes again: the settlements that waited go on")
                self._blocked = 0
        return run

    def stop(self) -> None:
        """After the commands already submitted: close the connection and end."""
        self.commands.put(lambda consumer: self._shut_down())

    def start(self) -> None:
        self.thread.start()

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        divert_logging(self.thread, self.post)
        self.loop.add_reader(self.commands.read_fd, self._run_commands)
        self.loop.call_later(0, self._connect)
        while not self._stopping:
            self.progress = self.loop.clock()
            try:
                with self.gate:
                    self._prepare()
                events = self.loop.wait(IDLE_TURN)      # parked: the gate is free
                with self.gate:
                    self.loop.dispatch(events)
                    self._hand_over()
            except Exception as exc:  # the thread must not die of one bad turn
                log.error("broker thread: %r", exc, exc_info=exc)
        self.loop.close()

    @contextlib.contextmanager
    def parked(self) -> Iterator[bool]:
        """Loop thread, around fork(): True while this thread is parked in select(), where
        it holds no lock and runs no broker code. A child forked otherwise could inherit a
        lock held mid-call, and CPython clears this thread's frames in the child, running
        whatever cleanup they hold (kombu's would give back the parent's messages)."""
        with parked(self.thread, self.gate) as free:
            yield free

    @contextlib.contextmanager
    def borrowed(self) -> Iterator[BrokerConsumer | None]:
        """Loop thread: the consumer, to call ``take_now`` on, while this thread is parked
        with nothing submitted to it still to run (so nothing submitted before is
        overtaken); None otherwise. Never waits: the gate is taken only if it is free."""
        consumer = self.borrow()
        try:
            yield consumer
        finally:
            if consumer is not None:
                self.give_back()

    def borrow(self) -> BrokerConsumer | None:
        """``borrowed``, kept across turns of the loop thread until ``give_back``: this
        thread stays parked meanwhile (waking, it waits for the gate)."""
        if (self._stopping or self._blocked or not self.thread.is_alive()
                or not self.gate.acquire(blocking=False)):
            return None
        if not self.commands.queue.empty():
            self.gate.release()
            return None
        self._borrowed = True
        return self.consumer

    def give_back(self) -> None:
        self._borrowed = False
        self.gate.release()

    def reads_back(self) -> None:
        """Loop thread: it reads the deliveries no more (it found this thread busy, or
        could not read): this thread reads what is there, and lends them again once idle."""
        self.commands.put(self._read_again)

    def _read_again(self, consumer: BrokerConsumer) -> None:
        self._lent = None
        if consumer.connected:
            for fd in consumer.fds():
                consumer.on_readable(fd)

    def nudge(self) -> None:
        """Make this thread turn (a take on the loop thread found the queues empty: its
        turn arms the waits on them)."""
        self.commands.put(_turn)

    def _prepare(self) -> None:
        consumer = self.consumer
        if not consumer.connected:
            self._watch(set(), consumer.generation)
            return
        consumer.tick()
        self._hand_over()       # what the tick delivered (RabbitMQ: frames read ahead)
        fds = consumer.fds()
        generation = consumer.generation
        if self._lent == generation and not consumer.reads_at_once:
            # Consuming was cancelled (a warm shutdown): the reading is taken back, and
            # the loop told to stop (fd -1).
            self._lent = None
            if self.lend_reads is not None:
                self.post(partial(self.lend_reads, -1, generation))
        if (self._lent != generation and self.lend_reads is not None and fds
                and consumer.reads_at_once and self.commands.queue.empty()):
            # Idle: the loop thread reads the deliveries itself from now on (no thread to
            # wake for each, no interpreter lock handed over), while this thread watches
            # only its commands and timers, until the loop thread hands them back.
            self._lent = generation
            self.post(partial(self.lend_reads, min(fds), generation))
        self._watch(set() if self._lent == generation else fds, generation)

    def _watch(self, fds: set[int], generation: int) -> None:
        """Watch exactly ``fds``, the sockets of connection ``generation``. A socket of a
        new connection may get the number of one closed with the old: epoll forgot the old
        socket when it was closed, but the selector still lists its number, and a number
        already listed would never be registered again (so the broker thread slept
        through the new connection's deliveries). Each connection's sockets are
        registered afresh."""
        if generation != self._watched_generation:
            for fd in self._watched:
                self.loop.remove_reader(fd)
            self._watched = set()
            self._watched_generation = generation
        for fd in self._watched - fds:
            self.loop.remove_reader(fd)
        for fd in fds - self._watched:
            self.loop.add_reader(fd, partial(self.consumer.on_readable, fd))
        self._watched = set(fds)

    def _run_commands(self) -> None:
        acks: list[Ack] = []
        fetches = 0
        for command in self.commands.take():
            if isinstance(command, Ack):
                acks.append(command)
            elif command is FETCH:
                fetches += 1
            else:
                if acks:
                    self._ack(acks)
                    acks = []
                command(self.consumer)
        if not (acks or fetches):
            return
        try:
            # Where acks and a take share a round trip (SQLite, Redis), acks take what there
            # is room for too, though the loop did not ask yet: it costs nothing more.
            consumer = self.consumer
            self._ack(acks, consumer.connected and (fetches > 0 or consumer.takes_with_acks))
        finally:        # counted whatever happened: the loop waits for it to fetch again
            if fetches:
                self.fetches_done += fetches
                if not self._arrived:   # nothing to hand over wakes the loop: this does
                    self.post(_nothing)

    def _ack(self, acks: list[Ack], fetch: bool = False) -> None:
        """Acks submitted one after another, in order with the other commands; ``fetch``:
        then take what there is room for, in the same round trip where the broker allows."""
        try:
            errors = self.consumer.ack_many([ack.message for ack in acks], fetch)
        except Exception as exc:  # ack_many hands back errors: this is for a bug, logged
            log.error("acking %d messages%s failed: %r", len(acks),
                      " and fetching" if fetch else "", exc, exc_info=exc)
            errors = [exc] * len(acks)
        self._outcomes(acks, errors)

    def _finish_acks(self, acks: list[Ack]) -> None:
        error: Exception | None = None
        try:
            self.consumer.finish_write(acks[0].message.channel)
        except Exception as exc:  # noqa: BLE001 - each ack's outcome
            error = exc
        self._outcomes(acks, [error] * len(acks))

    def _outcomes(self, acks: list[Ack], errors: list[Exception | None]) -> None:
        for ack, error in zip(acks, errors, strict=True):
            if ack.then is not None:
                self.post(partial(ack.then, error))
            elif error is not None:
                say_failed(self.consumer, error, f"{message_label(ack.message)}: ack")

    def _poll(self) -> None:
        consumer = self.consumer
        if (consumer.connected and self.room.available() > 0
                and consumer.poll_due(self.loop.clock())):
            consumer.poll()

    def _connect(self) -> None:
        if self._stopping or self.consumer.connected:
            return
        consumer = self.consumer
        try:
            consumer.connect(self.prefetch(), self.room.available, retries=0,
                             acked_running=self.acked_running())
        except Exception as exc:  # noqa: BLE001 - unreachable still: said, then retried
            self._attempts += 1
            limit = self.max_retries if self.retry_on_startup or not self._first else 0
            if limit is not None and self._attempts > limit:
                # Said before the loop is told: the loop stops once told, and a record
                # posted after that would never be written.
                log.critical("broker %s: %s; giving up after %d attempt%s (%s)",
                             consumer.where(), consumer.describe_failure(exc), self._attempts,
                             "s" if self._attempts > 1 else "",
                             "broker_connection_max_retries" if limit else
                             "broker_connection_retry_on_startup = false")
                self.post(partial(self.on_gave_up, exc))
                self._stopping = True
                return
            delay = backoff(self._attempts) or backoff(1)
            (log.debug if said(exc) else log.error)(
                "broker %s: %s; next try in %.1f s", consumer.where(),
                consumer.describe_failure(exc), delay)
            self.post(lambda: self.on_connected(consumer, False))
            self.loop.call_later(delay, self._connect)
            return
        first, self._first = self._first, False
        connected_at = consumer.connected_at
        self.loop.call_later(LASTED, lambda: self._lasted(connected_at))
        self._start_housekeeping()
        self.post(lambda: self.on_connected(consumer, True))
        server = consumer.server()
        if not first:       # (quietly after a loss that was said quietly)
            (log.debug if said(self._lost_to) else log.info)(
                "broker connection restored%s", f" (to {server})" if server else "")
        elif server:
            log.info("broker: connected to %s", server)

    def _lasted(self, connected_at: float) -> None:
        """A connection that lasted a while starts the back-off over."""
        if self.consumer.connected and self.consumer.connected_at == connected_at:
            self._attempts = 0

    def _start_housekeeping(self) -> None:
        generation = self.consumer.generation

        def alive() -> bool:
            return not self._stopping and generation == self.consumer.generation
        for interval, function in self.consumer.periodic():
            self.loop.every(interval, function, alive)
        # Polled while there is room: every POLL_INTERVAL where nothing wakes us, else only
        # as a safety net (consumer.SAFETY_POLL); an idle worker turns a few times a second.
        self.loop.every(self.consumer.poll_interval, self._poll, alive)

    def _received(self, queue_name: str, message: Message) -> None:
        """kombu hands over a message, inside a drain or a connect: counted (which may
        publish) once that call has returned, in ``_hand_over``."""
        self.room.took()
        self._arrived.append((queue_name, message))

    def _hand_over(self) -> None:
        """Count what arrived and give it to the loop, all in one post."""
        counted = self.counted_arrivals()
        if counted:
            self.post(partial(_each, self.on_message, counted))

    def counted_arrivals(self, publishing: bool = True) -> list[tuple[str, Message, int]]:
        """What arrived since the last call, each with its delivery count: called by the
        thread that made the call it arrived in (a ``take_now`` on the loop thread). RabbitMQ
        may replace a redelivered message by a counted copy: nothing to give then. Not
        ``publishing`` (the loop thread, which must not wait for a confirm): those are
        kept for this thread's next turn (``has_arrivals``)."""
        arrived, self._arrived = self._arrived, []
        if not publishing:
            kept = [a for a in arrived if self.consumer.counts_with_publish(a[1])]
            if kept:
                self._arrived = kept
                arrived = [a for a in arrived if a not in kept]
        counted = []
        for queue_name, message in arrived:
            deliveries = self.consumer.count_delivery(queue_name, message)
            if deliveries is not None:
                counted.append((queue_name, message, deliveries))
            else:       # the loop never gets it: the place it took in the window is free
                self.room.gave_back()
        return counted

    def has_arrivals(self) -> bool:
        return bool(self._arrived)

    def _lost(self, exc: BaseException) -> None:
        self._lost_to = exc
        self.post(lambda: self.on_lost(exc))
        if self._borrowed:
            # Found by the loop thread, which borrowed the consumer (``read_now``): this
            # thread's loop is its own, so the reconnect is set up there, at its next turn.
            self.commands.put(lambda consumer: self._reconnect_later())
        else:
            self._reconnect_later()

    def _reconnect_later(self) -> None:
        self._attempts = max(self._attempts, 1) if self._recently_connected() else 0
        self.loop.call_later(backoff(self._attempts), self._connect)

    def _recently_connected(self) -> bool:
        return self.loop.clock() - self.consumer.connected_at < LASTED

    def _shut_down(self) -> None:
        try:
            self.consumer.close()
        finally:
            self._stopping = True


def _turn(consumer: BrokerConsumer) -> None:
    return None


def _nothing() -> None:
    return None


def _each(function: Callable[..., None], calls: list[tuple[Any, ...]]) -> None:
    for args in calls:
        function(*args)


def message_label(message: Message) -> str:
    headers = message.headers or {}
    return f"{headers.get('task')}[{headers.get('id')}]"


def say_failed(consumer: BrokerConsumer, exc: Exception, what: str) -> None:
    if consumer.is_connection_error(exc):
        (log.debug if said(exc) else log.warning)(
            "%s: the broker connection is gone (%r); the broker will deliver it again",
            what or "a broker call", exc)
    else:
        log.error("%s failed: %r", what or "a broker call", exc, exc_info=exc)


class _ToLoopThread(logging.Filter):
    """On the root logger's handlers: a record made on the broker thread is not emitted
    there but handed to the loop thread, which emits it (see the module docstring)."""

    def __init__(self, thread: threading.Thread, post: Callable[[Callback], None]) -> None:
        super().__init__()
        self.thread = thread
        self.post = post

    def filter(self, record: logging.LogRecord) -> bool:
        if threading.current_thread() is not self.thread:
            return True
        if not getattr(record, "_handed_over", False):
            record._handed_over = True
            self.post(lambda: _emit(record))
        return False


def _emit(record: logging.LogRecord) -> None:
    for handler in logging.getLogger().handlers:
        if record.levelno >= handler.level:
            handler.handle(record)


@contextlib.contextmanager
def parked(thread: threading.Thread, gate: threading.Lock) -> Iterator[bool]:
    """Loop thread, around fork(): True, holding ``gate``, while ``thread`` (which holds
    its gate whenever it runs code that a forked child must not inherit mid-call) is
    parked; False if it is busy (try again later). A thread not running is parked."""
    if not thread.is_alive():
        yield True
        return
    got = gate.acquire(timeout=0.002)
    try:
        yield got
    finally:
        if got:
            gate.release()


def divert_logging(thread: threading.Thread, post: Callable[[Callback], None]) -> None:
    divert = _ToLoopThread(thread, post)
    for handler in logging.getLogger().handlers:
        handler.addFilter(divert)
