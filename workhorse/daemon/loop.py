"""The supervisor's event loop: one selector, one timer heap, one thread.

Readers are callbacks stored in ``SelectorKey.data``; timers are the loop's timeout, so a
deadline (time limit, ETA, back-off) is never a sleep.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import selectors
import time
from collections.abc import Callable

Callback = Callable[[], None]

#: The loop was away this much longer than it meant to be (frozen: SIGSTOP, a paused VM;
#: or a turn that blocked): ``Loop.away_for`` says how long, for a start to look at.
STALL = 5.0

log = logging.getLogger("workhorse.supervisor")


class Timer:
    """A callback due at ``when`` (the loop's clock). The heap holds ``(when, seq, timer)``:
    tuples compare in C, where an ordered dataclass compared in Python, several times a
    task (``seq`` is unique, so the timer itself is never compared)."""

    __slots__ = ("when", "seq", "callback", "cancelled")

    def __init__(self, when: float, seq: int, callback: Callback) -> None:
        self.when, self.seq, self.callback = when, seq, callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Loop:
    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 away_clock: Callable[[], float] | None = None) -> None:
        self.clock = clock
        #: What measures how long the loop was away (``away_for``): ``clock``, unless
        #: one that goes on through a suspend of the host is given.
        self.away_clock = clock if away_clock is None else away_clock
        self.selector = selectors.DefaultSelector()
        #: fd -> its key, as registered: looked up for every event (``dispatch``), where the
        #: selector's own mapping costs four Python calls a lookup.
        self._keys: dict[int, selectors.SelectorKey] = {}
        #: Readers registered still, though their owners expect nothing of them for now
        #: (``idle_reader``).
        self._idle: set[int] = set()
        self._timers: list[tuple[float, int, Timer]] = []
        self._seq = itertools.count()
        self._before_wait: list[Callback] = []
        #: When the last wait returned; and the longest time the loop was away (past
        #: STALL: a wait that returned that late, or a turn that took that long) since it
        #: was last taken (``took_away``).
        self._returned: float | None = None
        self.away = 0.0

    # -- readers
    def add_reader(self, fd: int, callback: Callback) -> None:
        self._register(fd, selectors.EVENT_READ, callback)

    def _register(self, fd: int, events: int, callback: Callback) -> None:
        if fd in self._idle:    # (its file was closed since, and the number taken again)
            self.remove_reader(fd)
        self._keys[fd] = self.selector.register(fd, events, callback)

    def remove_reader(self, fd: int, callback: Callback | None = None) -> None:
        """``callback``: only if ``fd``'s reader is still that one."""
        key = self._keys.get(fd)
        if callback is not None and (key is None or key.data != callback):
            return
        self._idle.discard(fd)
        self._keys.pop(fd, None)
        try:
            self.selector.unregister(fd)
        except (KeyError, ValueError):
            pass

    def idle_reader(self, fd: int) -> None:
        """The reader of ``fd`` expects nothing for a while, but stays registered: taken
        back by ``resume_reader``, it costs no system call (two, removed and added). An
        event on it still calls it (it should remove itself then: the selector reports
        a readable fd again and again), and a reader or writer added for the same number
        replaces it (its file may be closed meanwhile, and the number given to another)."""
        if fd in self._keys:
            self._idle.add(fd)

    def resume_reader(self, fd: int, callback: Callback) -> None:
        """``add_reader``, where ``callback`` is ``fd``'s idle reader still: taken back as
        it is. Only for a file that was not closed since ``idle_reader``: a new file on
        the same number is not in the selector's kernel set, whatever the loop holds."""
        key = self._keys.get(fd)
        if fd in self._idle and key is not None and key.data == callback:
            self._idle.discard(fd)
            return
        self.add_reader(fd, callback)

    def add_writer(self, fd: int, callback: Callback) -> None:
        """Call ``callback`` whenever ``fd`` can be written (a fd the loop does not read)."""
        self._register(fd, selectors.EVENT_WRITE, callback)

    def remove_writer(self, fd: int) -> None:
        self.remove_reader(fd)

    def readers(self) -> set[int]:
        return {key.fd for key in self.selector.get_map().values()}

    def before_wait(self, callback: Callback) -> None:
        """Call ``callback`` each time before the loop waits, once what the turn made
        due is done (work that may as well run while the children run theirs). It may
        make a timer due at once: the wait then returns at once."""
        self._before_wait.append(callback)

    # -- timers
    def call_at(self, when: float, callback: Callback) -> Timer:
        seq = next(self._seq)
        timer = Timer(when, seq, callback)
        heapq.heappush(self._timers, (when, seq, timer))
        return timer

    def call_later(self, delay: float, callback: Callback) -> Timer:
        return self.call_at(self.clock() + delay, callback)

    def every(self, interval: float, callback: Callback,
              alive: Callable[[], bool] = lambda: True) -> None:
        """Call ``callback`` every ``interval`` s for as long as ``alive()`` says so. An error
        it raises is logged, never raised into the loop: housekeeping must not stop it."""
        def fire() -> None:
            if not alive():
                return
            try:
                callback()
            except Exception as exc:  # logged; the next call comes all the same
                log.error("periodic %s failed", getattr(callback, "__name__", callback),
                          exc_info=exc)
            self.call_later(interval, fire)
        self.call_later(interval, fire)

    def next_timeout(self, now: float) -> float | None:
        timers = self._timers
        while timers and timers[0][2].cancelled:
            heapq.heappop(timers)
        if not timers:
            return None
        return max(0.0, timers[0][0] - now)

    # -- one turn
    def run_once(self, max_timeout: float | None = None) -> None:
        """Wait for I/O or the next timer (at most ``max_timeout``), then run what is due."""
        self.dispatch(self.wait(max_timeout))

    def wait(self, max_timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        """Wait for I/O or the next timer (at most ``max_timeout``); run nothing but the
        ``before_wait`` callbacks."""
        for callback in self._before_wait:
            callback()
        clock, away_clock = self.clock, self.away_clock
        before = away_clock()
        timeout = self.next_timeout(before if away_clock is clock else clock())
        if max_timeout is not None:
            timeout = max_timeout if timeout is None else min(timeout, max_timeout)
        events = self.selector.select(timeout)
        after = away_clock()
        # Away: in the turn before this wait (its work took that long), or in the wait
        # past its timeout. Either way nothing here ran, the broker thread neither.
        busy = 0.0 if self._returned is None else before - self._returned
        overslept = 0.0 if timeout is None else after - before - timeout
        self._returned = after
        if busy > STALL or overslept > STALL:
            self.away = max(self.away, busy, overslept)
        return events

    def away_for(self) -> float:
        """How long the loop was away (more than STALL): measured at a wait since
        ``took_away`` was last asked, or in this turn so far (the process may have been
        frozen a moment ago, anywhere in it); 0.0 if it was not."""
        if self.away:
            return self.away
        returned = self._returned
        if returned is None:
            return 0.0
        busy = self.away_clock() - returned
        return busy if busy > STALL else 0.0

    def took_away(self) -> float:
        """``away_for()``, then forgotten: from now on, only a new wait that returns late
        or a turn that takes long from here counts."""
        away = self.away_for()
        if away:
            self.away = 0.0
            self._returned = self.away_clock()
        return away

    def dispatch(self, events: list[tuple[selectors.SelectorKey, int]]) -> None:
        """Run the readers of ``events``, then the timers that are due."""
        registered = self._keys
        for key, _mask in events:
            # A callback earlier in this batch may have removed this reader (a child reaped)
            # or put another in its place on the same fd number: skip stale events.
            if registered.get(key.fd) is key:
                key.data()
        self.run_due()

    def run_due(self) -> None:
        """Run the timers that are due by the clock now."""
        now = self.clock()
        timers = self._timers
        while timers and (timers[0][0] <= now or timers[0][2].cancelled):
            timer = heapq.heappop(timers)[2]
            if not timer.cancelled:
                timer.callback()

    def close(self) -> None:
        self.selector.close()
