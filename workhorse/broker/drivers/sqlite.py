"""SQLite: each take leases as many messages as there is room for in one transaction and
delivers them at once (``Channel.take``), instead of kombu's one message (and one commit)
per fetch. Publishers wake the worker (``transport.wake``); where that cannot be set up
(the broker file's directory read-only), it is polled every POLL_INTERVAL. A take is a
transaction on a local file, not a round trip: the loop thread may make it itself, where
that never waits (``take_now``)."""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from time import monotonic
from typing import Any

from kombu import Connection

from ...transport.wake import Listener
from ..journal import Journal
from .base import POLL_INTERVAL, SAFETY_POLL, Capabilities, TakingDriver

log = logging.getLogger("workhorse.consumer")

#: How often the broker thread checkpoints the broker file's write-ahead log. The loop
#: thread's takes leave it to this thread (a checkpoint waits on the disk), so this bounds
#: how far the log grows past its checkpoint size between two of them.
CHECKPOINT_INTERVAL = 0.5


class SqliteDriver(TakingDriver):
    capabilities = Capabilities(leased=True, takes_with_acks=True, takes_inline=True,
                                polled=True)
    poll_interval = POLL_INTERVAL

    def __init__(self, connection: Connection, channel: Any,
                 room: Callable[[], int]) -> None:
        super().__init__(connection, channel, room)
        self.listener: Listener | None = None
        path = connection.transport.store.path
        try:
            self.listener = Listener(path)
        except OSError as exc:
            log.warning("SQLite broker %s: publishers cannot wake this worker (%r); it polls "
                        "the file every %.2f s instead", path, exc, POLL_INTERVAL)
        else:
            self.poll_interval = SAFETY_POLL

    def own_leases(self, journal: Journal) -> None:
        """Each opening of the file gives its leases' tokens a prefix of its own: the
        journal records this one's (nothing is leased through it yet), and any later one
        before a lease carries it."""
        store = self.connection.transport.store
        store.on_open = journal.owned
        if store.prefix is not None:
            journal.owned(store.prefix)

    def take_now(self, tags: Sequence[str], take: bool = True) -> None:
        """``ack_and_take`` without waiting for the file (the acks alone unless ``take``):
        raises StoreBusy, having changed nothing, where it would wait. One take: whatever
        more there is room for, the loop asks for again."""
        self._take(self.room() if take else 0, tags, wait=False)

    def has_unburied(self) -> bool:
        return bool(self.channel._unburied)

    def bury_unburied(self) -> None:
        self.channel.bury_unburied()

    def fds(self) -> set[int]:
        return {self.listener.fileno()} if self.listener is not None else set()

    def periodic(self) -> list[tuple[float, Callable[[], None]]]:
        return [(CHECKPOINT_INTERVAL, self.connection.transport.store.checkpoint)]

    def on_readable(self, fd: int) -> None:
        if self.listener is not None:
            self.listener.drain()
        self.polled_at = monotonic()
        self.poll()

    def finish(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None
