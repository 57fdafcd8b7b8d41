"""A publish that happens only if a record says it may: the fence of a periodic task's due
time (``workhorse.schedules``).

A schedule's record holds the last nominal time sent for it. A fenced publish of nominal
time ``n`` checks that record and moves it to ``n`` *in the same atomic step* as it puts
the message: one SQLite transaction on the broker file, one Lua script on Redis. So a
worker that was frozen after it decided to fire, and wakes when another has fired, finds
the record moved on and sends nothing: no lease checked earlier stands in for the check.

The fence travels to the transport's ``_put`` in a context variable, since kombu's
producer has no way to pass it: ``with fenced(ticket): producer.publish(...)``. A put
refused by the fence raises ``FenceClosed`` with the record that refused it.
"""
from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from dataclasses import asdict, dataclass

#: Where each schedule's record is kept (Redis key, after the prefix; SQLite table).
REDIS_PREFIX = "workhorse.schedule."
SQLITE_TABLE = "schedule_fences"


@dataclass(frozen=True)
class Record:
    """What a schedule's fence holds: the last nominal time sent, and who sent it."""

    nominal: float          # epoch seconds
    task_id: str
    by: str                 # the worker that sent it
    at: float               # epoch seconds it was sent
    #: "sent" (in the same step as the fence moved), or "sending": the fence is in the
    #: result store and the publish to the broker (RabbitMQ) comes after it.
    state: str = "sent"

    def dumps(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def loads(cls, text: str | bytes) -> Record:
        data = json.loads(text)
        return cls(float(data["nominal"]), str(data["task_id"]), str(data["by"]),
                   float(data["at"]), str(data.get("state", "sent")))


@dataclass(frozen=True)
class Ticket:
    """A fenced publish: send only if ``name``'s record is older than ``record.nominal``."""

    name: str
    record: Record


class FenceClosed(Exception):
    """The fence refused the publish: this nominal time, or a later one, was sent."""

    def __init__(self, ticket: Ticket, holder: Record | None) -> None:
        self.ticket, self.holder = ticket, holder
        by = f"{holder.task_id} by {holder.by}" if holder else "(record unreadable)"
        super().__init__(f"schedule {ticket.name}: nominal {ticket.record.nominal} sent "
                         f"already: {by}")


FENCE: ContextVar[Ticket | None] = ContextVar("workhorse_fence", default=None)


@contextlib.contextmanager
def fenced(ticket: Ticket) -> Iterator[None]:
    token = FENCE.set(ticket)
    try:
        yield
    finally:
        FENCE.reset(token)


def current() -> Ticket | None:
    """The transport's ``_put``: the fence for this put, if any. A put tried again (a
    producer retrying after a lost connection) finds the record moved by its own first try
    (the same task id): it is done, and puts nothing more."""
    return FENCE.get()


# ---------------------------------------------------------------- SQLite (broker or results)
SQLITE_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS {SQLITE_TABLE} (
    name    TEXT PRIMARY KEY,
    nominal REAL NOT NULL,              -- the last nominal time sent, epoch seconds
    record  TEXT NOT NULL               -- Record as JSON
);
"""


#: The result store's due times moved but not yet confirmed published (RabbitMQ): a worker
#: that dies before the confirm leaves its entry here, and another sends it (``orphans``).
SQLITE_PENDING_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS {SQLITE_TABLE}_pending (
    name    TEXT NOT NULL,
    nominal REAL NOT NULL,
    record  TEXT NOT NULL,
    PRIMARY KEY (name, nominal)
);
"""
SQLITE_PENDING = f"{SQLITE_TABLE}_pending"


def sqlite_move(conn: sqlite3.Connection, ticket: Ticket) -> tuple[bool, Record | None]:
    """Inside a write transaction: move the fence to the ticket's nominal time. (True,
    None): moved, put the message in this transaction. (False, holder): refused. (True,
    holder): moved by this very ticket before (a retried put; the record is the same to
    the microsecond it was made, not only its task id, which every worker shares): done,
    put nothing."""
    row = conn.execute(f"SELECT nominal, record FROM {SQLITE_TABLE} WHERE name = ?",
                       (ticket.name,)).fetchone()
    if row is not None and float(row[0]) >= ticket.record.nominal:
        holder = record_or_none(row[1])
        return holder == ticket.record, holder
    conn.execute(f"INSERT OR REPLACE INTO {SQLITE_TABLE} (name, nominal, record) "
                 "VALUES (?, ?, ?)", (ticket.name, ticket.record.nominal, ticket.record.dumps()))
    return True, None


def sqlite_records(conn: sqlite3.Connection, names: Iterable[str]) -> dict[str, Record]:
    found: dict[str, Record] = {}
    for name in names:
        row = conn.execute(f"SELECT record FROM {SQLITE_TABLE} WHERE name = ?",
                           (name,)).fetchone()
        record = None if row is None else record_or_none(row[0])
        if record is not None:
            found[name] = record
    return found


def record_or_none(text: str | bytes | None) -> Record | None:
    if text is None:
        return None
    try:
        return Record.loads(text)
    except (ValueError, KeyError, TypeError):
        return None


# ---------------------------------------------------------------- Redis
#: KEYS: the schedule's record (a hash: nominal, record), the queue's list, and (result
#: store only) its pending hash. ARGV: nominal, record JSON, task id, payload ('' : move
#: the fence only). Returns 1 (moved, and put), or the record holding it (refused; the
#: caller sees whether it is its own).
REDIS_MOVE = """
local current = redis.call('HGET', KEYS[1], 'nominal')
if current and tonumber(current) >= tonumber(ARGV[1]) then
    return redis.call('HGET', KEYS[1], 'record') or ''
end
redis.call('HSET', KEYS[1], 'nominal', ARGV[1], 'record', ARGV[2])
if ARGV[4] ~= '' then
    redis.call('LPUSH', KEYS[2], ARGV[4])
end
if KEYS[3] then
    redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
end
return 1
"""


def redis_key(name: str) -> str:
    return REDIS_PREFIX + name


def redis_pending_key(name: str) -> str:
    return REDIS_PREFIX + name + ".pending"


def redis_answer(ticket: Ticket, answer: object) -> tuple[bool, Record | None]:
    """What REDIS_MOVE's answer means, as ``sqlite_move``'s."""
    if answer == 1:
        return True, None
    holder = record_or_none(answer if isinstance(answer, (str, bytes)) and answer else None)
    return holder == ticket.record, holder
