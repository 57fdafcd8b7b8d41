"""The supervisor's side of its broker connection: the sockets the loop watches, the
housekeeping each connection needs, and what happens when it is lost and restored."""
from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from . import systemd
from .consumer import BrokerConsumer
from .holding import Holding
from .leases import Leases
from .reconnect import Reconnect

if TYPE_CHECKING:
    from .loop import Loop

log = logging.getLogger("workhorse.supervisor")


class BrokerLink:
    def __init__(self, consumer: BrokerConsumer, loop: Loop, holding: Holding, leases: Leases,
                 clock: Callable[[], float], has_room: Callable[[], bool],
                 accepting: Callable[[], bool], stopped: Callable[[], bool],
                 running: Callable[[], int], on_change: Callable[[], None]) -> None:
        self.consumer = consumer
        self.loop = loop
        self.holding = holding
        self.leases = leases
        self.has_room = has_room
        self.accepting = accepting
        #: Housekeeping (heartbeats, sweeps) goes on while running tasks finish, until then.
        self.stopped = stopped
        #: How many tasks run now (for the log line of a lost connection).
        self.running = running
        self.on_change = on_change
        self.reconnect = Reconnect(loop, clock, self._connect,
                                   lambda: accepting() and not consumer.connected,
                                   self._restored)
        self._fds: set[int] = set()

    def connect(self) -> None:
        """The first connection; raises while the broker cannot be reached."""
        self.consumer.connect(prefetch_count=self.holding.window, has_room=self.has_room)
        self.reconnect.connected()
        self._start_housekeeping()

    def before_wait(self) -> None:
        """Let the consumer (re)issue what it needs (Redis's waiters), and watch the
        sockets it reads now (they change on reconnect)."""
        if not self.accepting():
            return
        self.consumer.tick()
        current = self.consumer.fds()
        if current == self._fds:
            return
        for fd in self._fds - current:
            self.loop.remove_reader(fd)
        for fd in current - self._fds:
            self.loop.add_reader(fd, partial(self.consumer.on_readable, fd))
        self._fds = current

    def lost(self, exc: BaseException) -> None:
        """Running tasks go on; what is only buffered or scheduled is the broker's again if
        the broker took it back (RabbitMQ does when a connection closes; SQLite and Redis
        keep our leases, which we go on renewing); we reconnect with back-off."""
        dropped = 0
        if self.consumer.push:
            dropped = len(self.holding.take_waiting()) + len(self.holding.inbox)
            self.holding.inbox.clear()
        log.error("broker connection lost (%r): %d running tasks go on%s; reconnecting",
                  exc, self.running(),
                  f", {dropped} buffered or scheduled messages are back with the broker"
                  if dropped else "")
        systemd.notify(f"STATUS=broker connection lost ({exc!r}); reconnecting")
        self.reconnect.lost()

    def _connect(self) -> None:
        self.consumer.connect(self.holding.window, self.has_room, retries=0)

    def _restored(self) -> None:
        queues = ", ".join(self.consumer.queues)
        log.info("broker connection restored; consuming %s", queues)
        systemd.notify(f"STATUS=consuming {queues}")
        self._start_housekeeping()
        self.leases.renew()         # before the new connection's sweep can take our leases
        self.on_change()

    def _start_housekeeping(self) -> None:
        """What this connection's driver needs every so often, until it is replaced."""
        generation = self.consumer.generation

        def alive() -> bool:
            return not self.stopped() and generation == self.consumer.generation
        for interval, function in self.consumer.periodic():
            self.loop.every(interval, function, alive)
