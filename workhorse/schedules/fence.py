"""Where a worker's schedules keep their fences, and the one send that moves one.

- **SQLite and Redis brokers**: in the broker, moved in the step that puts the message (one
  transaction on the file, one Lua script): a due time's message exists if and only if the
  fence moved for it. Nothing a worker dies or freezes between can split the two.
- **RabbitMQ** (no conditional publish): in the result store (SQLite or Redis). The fence
  moves first, and the due time is noted *pending*; then the message is published with a
  publisher confirm, and the note removed. A publish that fails moves the fence back. A
  worker killed between the move and the confirm leaves its note behind: after
  ``SENDING_STALE`` another worker takes it over (a compare-and-set on the note) and
  publishes it, late, under the same task id. A worker frozen there for longer than that
  publishes too when it wakes: two messages of one task id, of which the stored result
  lets one run (if the first has finished by then).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from ..transport.fenced import FenceClosed, Record, Ticket, fenced

#: A due time pending this long is taken over (its worker died before the confirm): longer
#: than a publish may wait for its confirm (PUBLISH_TIMEOUT), and then some.
SENDING_STALE = 15.0


class Fence(Protocol):
    where: str

    def records(self, names: Iterable[str]) -> dict[str, Record]: ...

    def orphans(self, name: str) -> list[Record]:
        """Due times whose fence moved but whose worker never confirmed the publish."""
        ...

    def resend(self, name: str, orphan: Record, by: str, publish: Callable[[], None]) -> bool:
        """Take ``orphan`` over and publish it; False if another worker took it first."""
        ...

    def send(self, ticket: Ticket, publish: Callable[[], None],
             previous: Record | None) -> Record | None:
        """Publish if the fence moves: None. Refused: the record that holds it."""
        ...


class BrokerFence:
    """The fence is in the broker the message goes to (SQLite, Redis)."""

    where = "the broker"

    def __init__(self, channel: Any) -> None:
        self.channel = channel

    def records(self, names: Iterable[str]) -> dict[str, Record]:
        found: dict[str, Record] = self.channel.fence_records(list(names))
        return found

    def orphans(self, name: str) -> list[Record]:
        return []           # (the fence and the message are one step: no orphan)

    def resend(self, name: str, orphan: Record, by: str, publish: Callable[[], None]) -> bool:
        return False

    def send(self, ticket: Ticket, publish: Callable[[], None],
             previous: Record | None) -> Record | None:
        try:
            with fenced(ticket):
                publish()
        except FenceClosed as closed:
            return closed.holder or previous
        return None


class StoreFence:
    """The fence is in the result store; the message goes to RabbitMQ after it moved."""

    where = "the result store"

    def __init__(self, backend: Any, clock: Callable[[], float] = time.time) -> None:
        self.backend = backend
        self.clock = clock

    def records(self, names: Iterable[str]) -> dict[str, Record]:
        found: dict[str, Record] = self.backend.fence_records(list(names))
        return found

    def orphans(self, name: str) -> list[Record]:
        now = self.clock()
        return [record for record in self.backend.pending_fences(name)
                if now - record.at > SENDING_STALE]

    def resend(self, name: str, orphan: Record, by: str, publish: Callable[[], None]) -> bool:
        """Another worker's due time, moved and never confirmed (it died, or is frozen
        for longer than SENDING_STALE): taken over, then published under the same task
        id. Should the frozen one wake and publish too, the copy has that id, and its
        stored result stops a second run."""
        mine = Record(orphan.nominal, orphan.task_id, by, self.clock(), "sending")
        if not self.backend.take_pending(name, orphan, mine):
            return False
        publish()
        self.backend.settle_fence(Ticket(name, mine), Record(
            mine.nominal, mine.task_id, by, self.clock(), "sent"))
        return True

    def send(self, ticket: Ticket, publish: Callable[[], None],
             previous: Record | None) -> Record | None:
        record = ticket.record
        sending = Ticket(ticket.name, Record(record.nominal, record.task_id, record.by,
                                             record.at, "sending"))
        moved, holder = self.backend.move_fence(sending)
        if not moved:
            return holder
        try:
            publish()
        except BaseException:
            back = previous or Record(0.0, "", "", 0.0)
            try:
                self.backend.settle_fence(sending, back)
            except Exception:  # noqa: BLE001 - the publish's error is the one to raise
                pass
            raise
        self.backend.settle_fence(sending, Record(record.nominal, record.task_id, record.by,
                                                  self.clock(), "sent"))
        return None


def fence_for(connection: Any, backend: Any) -> Fence | None:
    """The fence this worker's schedules use; None if it has none (RabbitMQ with a result
    store that cannot hold one)."""
    channel = connection.default_channel
    if hasattr(channel, "fence_records"):
        return BrokerFence(channel)
    if type(backend)._move_fence is not _base_move_fence():
        return StoreFence(backend)
    return None


def can_fence(broker_url: str, backend: Any) -> bool:
    """Without connecting: will ``fence_for`` find a fence for this broker and store?"""
    from ..urls import scheme_of
    if scheme_of(broker_url) in ("sqlite", "redis", "rediss", "sentinel", "valkey", "valkeys"):
        return True
    return type(backend)._move_fence is not _base_move_fence()


def _base_move_fence() -> Any:
    from ..backends.base import Backend
    return Backend._move_fence
