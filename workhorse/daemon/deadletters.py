"""Operator tools for dead-letter queues: look at them, replay, or drop messages.

Works the same on every broker: messages are taken without acknowledging, then each is
acted on or handed back, in the order they were taken: RabbitMQ and the SQLite broker put a
requeued message back in its old place, and Redis pushes it onto the far end of the list,
so handing back in order keeps the order (on Redis, behind any letters not taken).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kombu import Connection, Producer
from kombu.message import Message

from ..protocol import DELIVERIES_HEADER
from ..queues import ensure_queue
from .counting import BROKER_HEADERS
from .consumer import (
    DEAD_AT_HEADER,
    DEAD_QUEUE_HEADER,
    DEAD_REASON_HEADER,
    DEAD_TASK_HEADER,
    DEAD_WORKER_HEADER,
)

DEAD_HEADERS = (DEAD_AT_HEADER, DEAD_QUEUE_HEADER, DEAD_REASON_HEADER, DEAD_TASK_HEADER,
                DEAD_WORKER_HEADER)


@dataclass(frozen=True)
class DeadLetter:
    task_id: str | None
    task: str | None
    reason: str | None
    dead_at: str | None
    queue: str | None
    worker: str | None
    args: str | None

    @classmethod
    def from_message(cls, message: Message) -> DeadLetter:
        h: dict[str, Any] = dict(message.headers or {})
        return cls(h.get(DEAD_TASK_HEADER) or h.get("id"), h.get("task"), h.get(DEAD_REASON_HEADER),
                   h.get(DEAD_AT_HEADER), h.get(DEAD_QUEUE_HEADER), h.get(DEAD_WORKER_HEADER),
                   h.get("argsrepr"))


Action = Callable[[Message], bool]   # True: the message was settled; False: hand it back


def _walk(connection: Connection, dead_queue: str, act: Action, limit: int | None) -> int:
    queue = ensure_queue(connection, dead_queue)(connection.channel())
    held: list[Message] = []
    settled = 0
    try:
        while limit is None or len(held) + settled < limit:
            message = queue.get(no_ack=False, accept=["application/json"])
            if message is None:
                break
            if act(message):
                settled += 1
            else:
                held.append(message)
    finally:
        for message in held:
            message.reject(requeue=True)
    return settled


def list_dead(connection: Connection, dead_queue: str, limit: int = 100) -> list[DeadLetter]:
    seen: list[DeadLetter] = []

    def look(message: Message) -> bool:
        seen.append(DeadLetter.from_message(message))
        return False
    _walk(connection, dead_queue, look, limit)
    return seen


def requeue_dead(connection: Connection, dead_queue: str, task_ids: Iterable[str] | None,
                 default_queue: str) -> int:
    """Publish matching dead letters back to the queue they died in, as fresh deliveries
    (their delivery count starts again), then remove them from the dead-letter queue."""
    wanted = set(task_ids) if task_ids is not None else None
    producer = Producer(connection.channel())
    ready: set[str] = set()

    def replay(message: Message) -> bool:
        letter = DeadLetter.from_message(message)
        if wanted is not None and letter.task_id not in wanted:
            return False
        target = letter.queue or default_queue
        if target not in ready:
            ensure_queue(connection, target)
            ready.add(target)
        headers = {k: v for k, v in (message.headers or {}).items()
                   if k not in DEAD_HEADERS and k not in BROKER_HEADERS and k != "redelivered"}
        headers[DELIVERIES_HEADER] = 0      # an operator's replay: a fresh delivery count
        properties = {k: message.properties[k] for k in ("correlation_id", "reply_to", "priority")
                      if message.properties.get(k) is not None}
        producer.publish(message.body, exchange="", routing_key=target, headers=headers,
                         content_type=message.content_type,
                         content_encoding=message.content_encoding, delivery_mode=2,
                         **properties)
        message.ack()        # after the copy is out: a crash in between duplicates, never loses
        return True
    return _walk(connection, dead_queue, replay, None)


def purge_dead(connection: Connection, dead_queue: str, task_ids: Iterable[str] | None) -> int:
    wanted = set(task_ids) if task_ids is not None else None

    def drop(message: Message) -> bool:
        if wanted is not None and DeadLetter.from_message(message).task_id not in wanted:
            return False
        message.ack()
        return True
    return _walk(connection, dead_queue, drop, None)
