"""A held message: what the supervisor knows about one message it has not settled yet."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from kombu.message import Message

from ..outcome import Decision, Outcome, Policy
from ..protocol import Request


class Stage(str, enum.Enum):
    NEW = "new"                # accepted, not yet placed
    BUFFERED = "buffered"      # waiting for an idle child
    SCHEDULED = "scheduled"    # waiting for its ETA
    ACKING = "acking"          # acks_late = false: its ack is on the way, then it starts
    RUNNING = "running"        # a child runs it
    STORING = "storing"        # over; settled once the supervisor has stored its result
    SETTLED = "settled"


# Each stage as a module name too, for the code every message passes through (Holding): an
# Enum class's attribute is read through EnumType.__getattr__ on Python 3.11 (see
# workhorse/outcome.py).
NEW, BUFFERED, SCHEDULED, ACKING, RUNNING, STORING, SETTLED = (
    Stage.NEW, Stage.BUFFERED, Stage.SCHEDULED, Stage.ACKING, Stage.RUNNING, Stage.STORING,
    Stage.SETTLED)

@dataclass(eq=False, slots=True)
class Delivery:
    seq: int
    queue: str
    message: Message
    request: Request
    task: Any                  # the registered Task
    policy: Policy
    received: float = 0.0      # monotonic time it arrived here
    stage: Stage = Stage.NEW
    acked: bool = False        # acked at start (acks_late = false)
    started: bool = False
    #: An async def task's: it runs beside others in a child, and counts in the async window.
    asynchronous: bool = False
    deliveries: int = 0        # its delivery count, this delivery included (when taken)
    #: How the worker's journal names it (None: not journaled, its losses count as starts).
    key: str | None = None
    #: It may have been running when a worker died: it runs alone (``Dispatch``).
    suspect: bool = False
    #: How often it was held (never started) by a worker that died.
    held_losses: int = 0
    #: The same message (its publisher's delivery tag) was held here, running, when it
    #: came up to start: the broker gave it twice (a Redis restart that lost the take).
    copy_seen: bool = False
    timer: Any = field(default=None, repr=False)   # its ETA (or store retry) timer
    #: An idempotent task's claim (key, owner) while its child runs it.
    claim: tuple[str, str] | None = None
    #: What its child reported (Done), for task events.
    done: Any = field(default=None, repr=False)
    #: While STORING: how it ends, carried out once its result is stored.
    settlement: tuple[Outcome, Decision, str | None] | None = field(default=None, repr=False)

    @property
    def label(self) -> str:
        return f"{self.request.task}[{self.request.id}]"
