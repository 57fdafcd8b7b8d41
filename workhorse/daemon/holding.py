"""Every message the supervisor holds, by stage, and the arithmetic of the prefetch window.

    NEW --buffer--> BUFFERED --start--> RUNNING --store--> STORING --settle--> SETTLED
    NEW/BUFFERED/RUNNING --schedule--> SCHEDULED --buffer--> BUFFERED
    NEW --ack at start--> ACKING --acked--> BUFFERED (first in line, acked)
    any but SETTLED --settle--> SETTLED

``Holding`` is the only code that moves a delivery from one stage to another; each move is
one guarded method, as ``Child``'s transitions are. It does no I/O: the supervisor's other
parts carry out the broker and store work and tell it what became of each delivery.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from kombu.message import Message

from ..pool.child import InvalidTransition
from .delivery import (ACKING, BUFFERED, NEW, RUNNING, SCHEDULED, SETTLED, STORING, Delivery,
                       Stage)


def windows(size: int, prefetch_multiplier: int, async_concurrency: int,
            tasks: Iterable[Any]) -> tuple[int, int]:
    """The sync and async windows of a pool of ``size`` (async: 0 without async tasks)."""
    window = size * prefetch_multiplier
    has_async = any(getattr(task, "is_async", False) for task in tasks)
    return window, window * async_concurrency if has_async else 0


class Holding:
    def __init__(self, window: int, async_window: int = 0) -> None:
        #: concurrency × prefetch_multiplier: sync messages buffered + running (+ received)
        #: at most.
        self.window = window
        #: concurrency × async_concurrency × prefetch_multiplier: the same for async
        #: messages (0: the app has no async task).
        self.async_window = async_window
        #: Async messages buffered, acking or running; of them, buffered.
        self.held_async = 0
        self.buffered_async = 0
        #: Whether each of the last messages placed was async (``room``).
        self.recent: deque[bool] = deque(maxlen=max(1, window))
        #: Received (queue, message, delivery count), not yet looked at.
        self.inbox: deque[tuple[str, Message, int]] = deque()
        self.buffer: deque[Delivery] = deque()
        self.scheduled: set[Delivery] = set()
        self.running: set[Delivery] = set()
        self.acking: set[Delivery] = set()      # acks_late = false: ack on its way
        self.storing: set[Delivery] = set()     # over; waiting to store their result
        #: Fetching stops until this monotonic time (after a max_scheduled hand-back).
        self.paused_until = 0.0

    # ------------------------------------------------------------------ arithmetic
    @property
    def held(self) -> int:
        """Received (not yet looked at), buffered, about to start and running: what the
        window bounds."""
        return len(self.inbox) + len(self.buffer) + len(self.acking) + len(self.running)

    def room(self) -> int:
        """How many more messages may be taken now (can be less than 0).

        Which kind a message is shows only once it is here; the two bounds hold all the
        same, because one that fits neither is handed back (``fits``). So that this is
        rare, the room is that of the kinds among the last ``window`` messages placed,
        the least of them: a queue that carries both kinds fills no more than both have
        room for, and a hand-back can only come in the first batch after a run of one
        kind. (No kind seen yet: both.)"""
        if not self.async_window:
            return self.window - self.held
        inbox = len(self.inbox)
        free_sync = self.window - (self.held - self.held_async)
        free_async = self.async_window - self.held_async - inbox
        recent, seen_async = len(self.recent), sum(self.recent)
        if recent and seen_async == recent:
            return free_async
        if recent and not seen_async:
            return free_sync
        return min(free_sync, free_async)

    def has_room(self, now: float) -> bool:
        """May one more message be taken? Our own count, not the broker's QoS."""
        return self.room() > 0 and now >= self.paused_until

    def fits(self, delivery: Delivery) -> bool:
        """Is there a place for one more of its kind? (Noted as the latest kind seen.)"""
        self.recent.append(delivery.asynchronous)
        if delivery.asynchronous:
            return self.held_async < self.async_window
        return self.held - len(self.inbox) - self.held_async < self.window

    def limit(self) -> int:
        """What the window is now, held included (the broker's credit follows it)."""
        if not self.async_window:
            return self.window
        return self.held + max(0, self.room())

    def set_windows(self, window: int, async_window: int) -> None:
        self.window, self.async_window = window, async_window
        self.recent = deque(self.recent, maxlen=max(1, window))

    def credit(self, now: float) -> int:
        """How many unacknowledged messages the broker may have out with us.

        The broker counts what we have not acked: buffered, scheduled, running tasks not
        acked at start, and finished ones whose result is still being stored. For
        buffered + running <= window, that is the window plus the scheduled and the unacked
        storing, minus those acked already (acks_late = false: acked, waiting for a child or
        running) and those whose ack is on its way (the credit shrinks before the ack frees
        a place). Paused: none.
        """
        if now < self.paused_until:
            return 0
        acked_running = (len(self.acking) + sum(1 for d in self.buffer if d.acked)
                         + sum(1 for d in self.running if d.acked))
        unacked_storing = sum(1 for d in self.storing if not d.acked)
        return self.limit() + len(self.scheduled) + unacked_storing - acked_running

    def unsettled(self) -> list[Delivery]:
        """Everything taken from the broker and not yet settled with it (leases to renew)."""
        return [d for d in self.all() if not d.acked]

    def all(self) -> Iterator[Delivery]:
        yield from self.buffer
        yield from self.scheduled
        yield from self.acking
        yield from self.running
        yield from self.storing

    def twin(self, task_id: str) -> Delivery | None:
        """The copy of this task running here, or finished and storing its result."""
        for stage in (self.running, self.storing):
            for delivery in stage:
                if delivery.request.id == task_id:
                    return delivery
        return None

    # ------------------------------------------------------------------ transitions
    def buffer_last(self, delivery: Delivery) -> None:
        """A new message waits for an idle child, behind the others."""
        self._leave(delivery, NEW)
        delivery.stage = BUFFERED
        self.buffer.append(delivery)
        self.held_async += delivery.asynchronous
        self.buffered_async += delivery.asynchronous

    def buffer_first(self, delivery: Delivery) -> None:
        """Its time has come (ETA reached), its ack at start is done, or a child could not
        take it: first in line."""
        self._leave(delivery, NEW, SCHEDULED, RUNNING, ACKING)
        delivery.stage = BUFFERED
        self.buffer.appendleft(delivery)
        self.held_async += delivery.asynchronous
        self.buffered_async += delivery.asynchronous

    def next_buffered(self, wait: Callable[[Delivery], bool] | None = None) -> Delivery | None:
        """Take the first buffered delivery out of line, passing those ``wait`` says must
        wait (they keep their places); the caller moves it on at once (start, schedule or
        settle)."""
        if not self.buffer:
            return None
        if wait is None or not wait(self.buffer[0]):
            delivery = self.buffer.popleft()
        else:
            found = next((d for d in self.buffer if not wait(d)), None)
            if found is None:
                return None
            self.buffer.remove(found)
            delivery = found
        delivery.stage = NEW
        self.held_async -= delivery.asynchronous
        self.buffered_async -= delivery.asynchronous
        return delivery

    def schedule(self, delivery: Delivery) -> None:
        """Wait for its ETA, or to be looked at again (its ``timer`` is set by the caller)."""
        self._leave(delivery, NEW, RUNNING, ACKING)
        delivery.stage = SCHEDULED
        self.scheduled.add(delivery)

    def ack_at_start(self, delivery: Delivery) -> None:
        """acks_late = false: its ack is on its way to the broker; it starts once done."""
        self._leave(delivery, NEW)
        delivery.stage = ACKING
        self.acking.add(delivery)
        self.held_async += delivery.asynchronous

    def start(self, delivery: Delivery) -> None:
        self._leave(delivery, NEW)
        delivery.stage = RUNNING
        self.running.add(delivery)
        self.held_async += delivery.asynchronous

    def store(self, delivery: Delivery) -> None:
        """Over; held until its result is stored (a retry timer is set by the caller)."""
        self._leave(delivery, NEW, RUNNING, STORING, BUFFERED, SCHEDULED)
        delivery.stage = STORING
        self.storing.add(delivery)

    def settle(self, delivery: Delivery) -> None:
        """Acked, requeued, dead-lettered, handed back or left to the broker: not ours."""
        self._leave(delivery, NEW, BUFFERED, SCHEDULED, ACKING, RUNNING, STORING)
        delivery.stage = SETTLED

    def take_waiting(self) -> list[Delivery]:
        """Warm shutdown, or a connection that took them back: every buffered and scheduled
        delivery, in the order received, settled here (the caller gives them back)."""
        waiting = [*self.buffer, *sorted(self.scheduled, key=lambda d: d.seq)]
        for delivery in waiting:
            self.settle(delivery)
        return waiting

    def _leave(self, delivery: Delivery, *expected: Stage) -> None:
        """Take ``delivery`` out of its stage, which must be one of ``expected``."""
        stage = delivery.stage
        if stage not in expected:
            raise InvalidTransition(
                f"{delivery.label} is {stage.value}, expected "
                f"{' or '.join(s.value for s in expected)}")
        if stage is BUFFERED:
            self.buffer.remove(delivery)
            self.held_async -= delivery.asynchronous
            self.buffered_async -= delivery.asynchronous
        elif stage is SCHEDULED:
            self.scheduled.discard(delivery)
        elif stage is RUNNING:
            self.running.discard(delivery)
            self.held_async -= delivery.asynchronous
        elif stage is ACKING:
            self.acking.discard(delivery)
            self.held_async -= delivery.asynchronous
        elif stage is STORING:
            self.storing.discard(delivery)
        if delivery.timer is not None:      # its ETA, recheck or store-retry timer
            delivery.timer.cancel()
            delivery.timer = None
