"""workhorse's Redis transport: each message is taken and recorded as unacked in one step
(``Channel.take``); while the worker has room and the lists are empty, one idle connection
per list waits for it to fill (``ListWaiter``). No BRPOP: a message is never in flight
between its list and our bookkeeping."""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from time import monotonic
from typing import Any

from kombu import Connection

from ...transport.redis import ListWaiter, SentTake, TakePipe
from ..journal import Journal
from .base import POLL_INTERVAL, Capabilities, TakingDriver

log = logging.getLogger("workhorse.consumer")

#: How often to put back messages whose lease expired (their consumer died).
RESTORE_SWEEP_INTERVAL = 2.0


class RedisDriver(TakingDriver):
    capabilities = Capabilities(leased=True, takes_with_acks=True, takes_split=True)
    #: Seconds a waiter blocks server-side before it is re-armed (a health check: a
    #: waiter silent well past this is a dead connection).
    WAIT_TIMEOUT = 10

    def __init__(self, connection: Connection, channel: Any,
                 room: Callable[[], int]) -> None:
        super().__init__(connection, channel, room)
        self.cycle = connection.transport.cycle
        self.waiters: dict[str, ListWaiter] = {}
        self.blocking = True        # False on Redis < 6.2 (no BLMOVE): polled instead

    def own_leases(self, journal: Journal) -> None:
        """The take script marks each lease with the journal's owner (hash lease_owners)."""
        self.channel.lease_owner = journal.owner

    def tick(self) -> None:
        """With room, once a take found the lists empty: arm a wait on each list not armed
        yet (a list that filled meanwhile answers at once). While they are armed a new
        message wakes us; until a take finds the lists empty, the loop's ``FETCH`` takes
        (a take here on every turn with room took one or two messages a round trip)."""
        if not self.dry or not self.blocking or self.room() <= 0:
            return
        keys = self.channel.list_keys(self.channel.active_queues)
        for key in keys:
            waiter = self.waiters.get(key)
            if waiter is None:
                waiter = self.waiters[key] = ListWaiter(self.channel, key)
            waiter.arm(self.WAIT_TIMEOUT)

    def take_send(self, tags: Sequence[str], pipe: TakePipe | None = None) -> SentTake | None:
        # The room less what the takes still unanswered on the pipe may bring: never more
        # than the window, however many are out.
        pending = sum(sent.limit for sent in pipe.out) if pipe is not None else 0
        limit = min(max(0, self.room() - pending), self.channel.MAX_TAKE)
        sent: SentTake | None = self.channel.take_send(limit, tags, pipe)
        return sent

    def take_read(self, pipe: TakePipe) -> list[SentTake]:
        answered = pipe.read()
        for sent in answered:
            if sent.limit > 0:
                self.dry = (sent.took or 0) < sent.limit
        return answered

    def has_unburied(self) -> bool:
        return bool(self.channel._unburied)

    def bury_unburied(self) -> None:
        self.channel.bury_unburied()

    def fds(self) -> set[int]:
        return {fd for fd in (w.fileno() for w in self.waiters.values()) if fd is not None}

    def on_readable(self, fd: int) -> None:
        for waiter in self.waiters.values():
            if waiter.fileno() == fd:
                try:
                    waiter.read()
                except self.connection.channel_errors as exc:   # no BLMOVE before 6.2
                    log.warning("Redis cannot BLMOVE (%r): polling every %.2f s instead",
                                exc, POLL_INTERVAL)
                    self.blocking = False
                    self.finish()
                break
        self._take_while_room()

    def periodic(self) -> list[tuple[float, Callable[[], None]]]:
        # kombu's sweep puts back messages whose lease ran out (their worker died); ours
        # are renewed long before that, so sweeping often only shortens a dead worker's wait.
        return [(RESTORE_SWEEP_INTERVAL, self.cycle.maybe_restore_messages),
                (self.WAIT_TIMEOUT, self._check_waiters),
                (POLL_INTERVAL, self._poll_unless_blocking)]

    def _poll_unless_blocking(self) -> None:
        if not self.blocking:
            self._take_while_room()

    def _check_waiters(self) -> None:
        """A waiter that is not answered well past its timeout sits on a dead connection."""
        now = monotonic()
        for waiter in self.waiters.values():
            if waiter.sent_at is not None and now - waiter.sent_at > 2 * self.WAIT_TIMEOUT:
                raise ConnectionError(f"no answer from Redis on list {waiter.key!r} for "
                                      f"{now - waiter.sent_at:.0f} s")

    def finish(self) -> None:
        """Waiters take nothing: closing them loses nothing."""
        for waiter in self.waiters.values():
            waiter.close()
        self.waiters.clear()
