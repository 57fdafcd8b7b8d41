"""The broker as the loop thread's parts see it: one port (``BrokerPort``), which the link
(``BrokerLink``) is and the tier-1 fakes mimic. Settlement, dispatch, leases, steering and
the supervisor type against it, and against nothing else of the broker wing.

Every call returns at once: the work is handed to the broker thread, which owns every
kombu object; what comes back (messages, the results of acks and renewals, a lost or
restored connection) runs on the loop thread. What the broker of the current connection
does is data (``push``, ``leased``: its ``Capabilities``), never its kind.

The one exception to "the broker thread owns every kombu object": where the broker takes
inline (``Capabilities.takes_inline``: SQLite, whose take is a transaction on a local
file), the link carries out a turn's acks and take on the loop thread itself, while the
broker thread is parked with nothing submitted to it, and only where that never waits
(``BrokerLink._take_here``).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

from kombu.message import Message

from .journal import Journal
from .queues import DELAY_LEVELS

#: The longest ``hand_back_later`` (seconds): what RabbitMQ's delay levels can hold.
MAX_DELAY = 2 ** DELAY_LEVELS - 1


class BrokerPort(Protocol):
    #: The broker's URL as logs show it (no password), and the queues consumed.
    where: str
    queues: list[str]
    #: What the loop knows of the connection, from the broker thread's reports.
    connected: bool
    #: Capabilities of the broker of the current connection.
    push: bool          # delivers up to a credit; takes back what a lost connection held
    leased: bool        # leases what we hold, to be renewed
    #: Queues whose broker can hold a message for a while for us (RabbitMQ's delay levels,
    #: for quorum queues): ``hand_back_later``.
    delayable: frozenset[str]

    @property
    def room_read_before_wait(self) -> bool:
        """Is the room ``set_room`` says acted on only before the loop waits (the takes
        made then, on the loop thread)? Then more room said later in a turn is as good."""

    # -- life cycle
    def start(self) -> None: ...
    def use_journal(self, journal: Journal) -> None: ...
    def close(self, timeout: float) -> None: ...
    def parked(self) -> AbstractContextManager[bool]: ...
    def healthy(self) -> bool: ...
    def describe(self) -> str: ...
    def say_troubles(self) -> None: ...

    # -- how much may be taken
    def set_room(self, free: int, starved: bool = True) -> None: ...
    def set_credit(self, count: int) -> None: ...
    def cancel(self) -> None: ...
    def add_queue(self, queue: str) -> threading.Event | None: ...
    def cancel_queue(self, queue: str) -> threading.Event | None: ...

    # -- settling (docs/delivery.md "settle")
    def ack(self, message: Message) -> None: ...
    def ack_then(self, message: Message,
                 then: Callable[[BaseException | None], None]) -> None: ...
    def requeue(self, queue: str, message: Message) -> None: ...
    def requeue_counted(self, queue: str, message: Message, deliveries: int) -> None: ...
    def requeue_held_loss(self, queue: str, message: Message) -> None: ...
    def hand_back(self, queue: str, message: Message) -> None: ...
    def hand_back_later(self, queue: str, message: Message, seconds: int) -> None: ...
    def republish(self, queue: str, message: Message, headers: Mapping[str, Any]) -> None: ...
    def dead_letter(self, queue: str, message: Message, reason: str, task_id: str | None,
                    worker: str, *, acked: bool, or_requeue: bool = False) -> None: ...
    def is_connection_error(self, exc: BaseException) -> bool: ...

    # -- leases
    def renew(self, messages: list[Message],
              then: Callable[[list[Message]], None]) -> None: ...
    def forget(self, message: Message) -> None: ...
    def lease_set_at(self, message: Message) -> float | None: ...
