"""What every broker driver is: how the broker thread watches and reads one kind of broker
connection, and what that kind of broker does, as data (``Capabilities``): the rest of the
worker asks the capabilities, never which kind of broker it has."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from kombu import Connection

from ..journal import Journal

#: Brokers with no socket to watch: polled this often while the worker has room.
POLL_INTERVAL = 0.05
#: Brokers that wake the worker when a message is there (Redis, RabbitMQ, SQLite with its
#: wakeups) are still polled this often while the worker has room: a safety net for a
#: wakeup that could not reach it, never the way messages normally arrive.
SAFETY_POLL = 1.0


@dataclass(frozen=True)
class Capabilities:
    """What a kind of broker does, reported once per connection."""

    #: It delivers up to a credit the worker keeps moving, and takes back what a lost
    #: connection held (RabbitMQ); else the worker takes what it has room for.
    push: bool = False
    #: It holds what the worker took under leases the worker renews (SQLite, Redis).
    leased: bool = False
    #: A turn's acks and the next take share one round trip (SQLite, Redis).
    takes_with_acks: bool = False
    #: The loop thread may take itself, never waiting (SQLite: a transaction on a local
    #: file, not a round trip). The one exception to "the broker thread owns every kombu
    #: object": see ``BrokerLink``'s inline take.
    takes_inline: bool = False
    #: The loop thread may send a take and read its answer when it comes, never waiting
    #: (Redis: a script on a connection of the channel's own). See ``BrokerLink``.
    takes_split: bool = False
    #: The loop thread may write acks itself, never waiting (RabbitMQ: the frames
    #: written to the socket without blocking, or else left to the broker thread). See
    #: ``BrokerLink``.
    acks_inline: bool = False
    #: The loop thread may read the deliveries itself, never waiting (RabbitMQ: the
    #: frames the socket holds, read without blocking). See ``BrokerLink``.
    reads_inline: bool = False
    #: No socket to watch: polled on a timer.
    polled: bool = False


def drain(connection: Connection, max_messages: int = 1000) -> None:
    """Deliver what the broker already sent us, without waiting for more."""
    for _ in range(max_messages):
        try:
            connection.drain_events(timeout=0)
        except TimeoutError:
            return


class Driver:
    """How the broker thread watches and reads one kind of broker connection."""

    capabilities: ClassVar[Capabilities] = Capabilities()
    #: How often the broker thread polls while there is room (it also polls whenever the
    #: room grows); brokers that wake the worker need it only as a safety net.
    poll_interval = SAFETY_POLL

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self.polled_at = 0.0        # monotonic time of the last poll

    def own_leases(self, journal: Journal) -> None:
        """Before the first take: mark what this connection leases as the journal's (its
        owner), so that whoever finds the journal dead finds the leases (leased brokers)."""

    def send_qos(self, channel: Any, count: int, per_consumer: bool = False) -> None:
        """Push brokers: how many unacknowledged messages it may have out with us (on the
        channel; ``per_consumer``: each consumer started after, instead)."""
        raise NotImplementedError

    def tick(self) -> None:
        return None

    def fds(self) -> set[int]:
        return set()

    def on_readable(self, fd: int) -> None:
        drain(self.connection)

    def poll(self) -> None:
        """Take what is ready now, without waiting."""
        drain(self.connection)

    def periodic(self) -> list[tuple[float, Callable[[], None]]]:
        return []

    def read_now(self) -> bool | None:
        """``reads_inline``: deliver what the socket holds, never waiting; None if it
        cannot be read so (nothing was read)."""
        raise NotImplementedError

    def ack_and_take(self, tags: Sequence[str]) -> bool:
        """``takes_with_acks``: a turn's acks and a take in one round trip."""
        raise NotImplementedError

    def take_now(self, tags: Sequence[str], take: bool = True) -> None:
        """``takes_inline``: ``ack_and_take`` on the loop thread, never waiting (the acks
        alone unless ``take``)."""
        raise NotImplementedError

    def take_send(self, tags: Sequence[str], pipe: Any = None) -> Any:
        """``takes_split``: ``ack_and_take``'s request, sent without waiting for its answer:
        on ``pipe``, after the takes sent on it before, or on a new pipe (the sent take's
        ``pipe``), whose answers ``take_read`` reads once its ``fd`` is readable. None if
        it cannot be sent without waiting: nothing was sent."""
        raise NotImplementedError

    def take_read(self, pipe: Any) -> list[Any]:
        """``takes_split``: the takes on ``pipe`` answered now, in order, each with the
        number of messages it took (delivered). Raises if the pipe failed: the takes not
        answered are over, their acks to be made again."""
        raise NotImplementedError

    def has_unburied(self) -> bool:
        """Did an inline take lease unreadable entries, waiting for ``bury_unburied``?"""
        return False

    def bury_unburied(self) -> None:
        """Bury what an inline take leased unreadable (burying may wait)."""

    def finish(self) -> None:
        """Before closing: collect any fetch still in flight, so closing loses nothing."""


class PolledDriver(Driver):
    """Brokers without a socket (memory): the broker thread calls ``poll()`` on a timer."""

    capabilities = Capabilities(polled=True)
    poll_interval = POLL_INTERVAL


class TakingDriver(Driver):
    """Transports whose channel takes as many messages as there is room for in one round
    trip, with a turn's acks (``Channel.take(limit, acks)``): Redis and SQLite."""

    def __init__(self, connection: Connection, channel: Any,
                 room: Callable[[], int]) -> None:
        super().__init__(connection)
        self.channel = channel
        self.room = room
        #: Did the last take find the queues empty (it took less than it asked for)? Until
        #: one does, takes come only with the loop's ``FETCH`` (once enough room is free
        #: for one round trip to take several), with acks, and from the safety poll; Redis
        #: arms no waits on its lists.
        self.dry = True

    def _take(self, room: int, tags: Sequence[str] = (), **options: bool) -> int:
        """``options``: the channel's own (SQLite's ``wait``)."""
        limit = min(max(0, room), self.channel.MAX_TAKE)
        took: int = self.channel.take(limit, tags, **options)
        if limit > 0:
            self.dry = took < limit
        return took

    def ack_and_take(self, tags: Sequence[str]) -> bool:
        """The acks of a turn and the fetch it asked for, in one round trip (Redis: one
        script; SQLite: one transaction), the acks sent even when there is no room now.
        Raises what that round trip raised (the caller hands it to each ack). True if
        there is room for more than one round trip takes and the queues may hold more:
        take again. (Room freed while this one was on its way is the loop's to ask for,
        once enough is free: taking it at once took one message a round trip.)"""
        room = self.room()
        self._take(room, tags)
        return room > self.channel.MAX_TAKE and not self.dry

    def _take_while_room(self) -> bool:
        """Take as many as there is room for, several per round trip."""
        took = False
        while (room := self.room()) > 0 and self._take(room):
            took = True
        return took

    def poll(self) -> None:
        self._take_while_room()
