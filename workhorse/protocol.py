"""Celery task message protocol v2: building messages and reading them back.

Pure functions, no I/O. The layout is in ``shared/WIRE.md``: body ``[args, kwargs, embed]``,
everything else in headers. Unknown headers are kept so a re-published message carries them.
"""
from __future__ import annotations

import os
import reprlib
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from kombu.exceptions import ContentDisallowed, DecodeError
from kombu.serialization import loads

from .exceptions import MalformedMessage

#: The delivery count a copy workhorse re-publishes carries (deliveries of the message
#: before the copy that may have ended in a loss: SEMANTICS.md "delivery count").
DELIVERIES_HEADER = "x-workhorse-deliveries"
#: Dead letters of a queue go to ``<queue>.dead``, with headers saying why, which task,
#: when, from which queue and by which worker (SEMANTICS.md "settle").
DEAD_SUFFIX = ".dead"
DEAD_REASON_HEADER = "x-workhorse-dead-reason"
DEAD_TASK_HEADER = "x-workhorse-dead-task-id"
DEAD_AT_HEADER = "x-workhorse-dead-at"
DEAD_QUEUE_HEADER = "x-workhorse-dead-queue"
DEAD_WORKER_HEADER = "x-workhorse-dead-worker"
#: The content types a worker accepts; pickle is refused because it runs code on load.
ACCEPT_CONTENT = frozenset({"application/json"})
ORIGIN = f"gen{os.getpid()}@{socket.gethostname()}"

_repr = reprlib.Repr()
_repr.maxstring = 80
_repr.maxother = 80
_repr.maxlevel = 3


def utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class TaskMessage:
    """What a producer hands to kombu: the body to serialize, headers and properties."""

    body: tuple[list[Any], dict[str, Any], dict[str, Any]]
    headers: dict[str, Any]
    properties: dict[str, Any]


def build_message(
    task: str,
    task_id: str,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    eta: datetime | None = None,
    expires: datetime | None = None,
    retries: int = 0,
    time_limit: float | None = None,
    soft_time_limit: float | None = None,
    root_id: str | None = None,
    parent_id: str | None = None,
    group: str | None = None,
    group_index: int | None = None,
    ignore_result: bool | None = None,
    shadow: str | None = None,
    callbacks: list[dict[str, Any]] | None = None,
    errbacks: list[dict[str, Any]] | None = None,
    chain: list[dict[str, Any]] | None = None,
    chord: dict[str, Any] | None = None,
    reply_to: str | None = None,
    extra_headers: Mapping[str, Any] | None = None,
    now: datetime | None = None,
) -> TaskMessage:
    """Build a protocol v2 task message exactly as Celery 5 lays it out."""
    kwargs = dict(kwargs or {})
    headers: dict[str, Any] = dict(extra_headers or {})
    headers.update({
        "lang": "py",
        "task": task,
        "id": task_id,
        "shadow": shadow,
        "eta": format_datetime(eta),
        "expires": format_datetime(expires),
        "group": group,
        "group_index": group_index,
        "retries": retries,
        "timelimit": [time_limit, soft_time_limit],
        "root_id": root_id or task_id,
        "parent_id": parent_id,
        "argsrepr": _repr.repr(tuple(args)),
        "kwargsrepr": _repr.repr(kwargs),
        "origin": ORIGIN,
        "ignore_result": ignore_result,
    })
    headers.setdefault("replaced_task_nesting", 0)
    headers.setdefault("stamped_headers", None)
    headers.setdefault("stamps", {})
    properties: dict[str, Any] = {"correlation_id": task_id, "reply_to": reply_to or ""}
    if expires is not None:
        now = now or utcnow()
        properties["expiration"] = str(max(0, int((expires - now).total_seconds() * 1000)))
    embed = {"callbacks": callbacks, "errbacks": errbacks, "chain": chain, "chord": chord}
    return TaskMessage((list(args), kwargs, embed), headers, properties)


def dead_letter_queue(queue: str) -> str:
    return queue + DEAD_SUFFIX


def format_datetime(value: datetime | None) -> str | None:
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.isoformat()


def parse_datetime(value: Any, name: str) -> datetime | None:
    """Read an ISO-8601 header; naive means UTC (WIRE.md)."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise MalformedMessage(f"header {name!r} must be an ISO-8601 string, not {value!r}")
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise MalformedMessage(f"header {name!r} is not an ISO-8601 date: {value!r}") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _optional_number(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise MalformedMessage(f"{what} must be a positive number or null, not {value!r}")
    return float(value)


@dataclass(frozen=True)
class Request:
    """A task message's headers, read and checked; the body is decoded in the child."""

    id: str
    task: str
    retries: int = 0
    eta: datetime | None = None
    expires: datetime | None = None
    time_limit: float | None = None
    soft_time_limit: float | None = None
    root_id: str | None = None
    parent_id: str | None = None
    group: str | None = None
    group_index: int | None = None
    origin: str | None = None
    ignore_result: bool | None = None
    deliveries: int = 0
    headers: Mapping[str, Any] = field(default_factory=dict, repr=False)


def parse_request(headers: Mapping[str, Any] | None) -> Request:
    """Read the headers of a protocol v2 message, or raise MalformedMessage saying why."""
    if not headers:
        raise MalformedMessage("no headers: not a Celery protocol v2 task message")
    task, task_id = headers.get("task"), headers.get("id")
    if not isinstance(task, str) or not task:
        raise MalformedMessage(f"header 'task' must name a task, not {task!r}")
    if not isinstance(task_id, str) or not task_id:
        raise MalformedMessage(f"header 'id' must be a task id, not {task_id!r}")
    retries = headers.get("retries") or 0
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise MalformedMessage(f"header 'retries' must be a non-negative integer, not {retries!r}")
    deliveries = headers.get(DELIVERIES_HEADER) or 0
    if isinstance(deliveries, bool) or not isinstance(deliveries, int) or deliveries < 0:
        raise MalformedMessage(
            f"header {DELIVERIES_HEADER!r} must be a non-negative integer, not {deliveries!r}")
    limits = headers.get("timelimit") or (None, None)
    if not isinstance(limits, (list, tuple)) or len(limits) != 2:
        raise MalformedMessage(f"header 'timelimit' must be [hard, soft], not {limits!r}")
    hard = _optional_number(limits[0], "timelimit[0] (hard)")
    soft = _optional_number(limits[1], "timelimit[1] (soft)")
    group_index = headers.get("group_index")
    return Request(
        id=task_id,
        task=task,
        retries=retries,
        eta=parse_datetime(headers.get("eta"), "eta"),
        expires=parse_datetime(headers.get("expires"), "expires"),
        time_limit=hard,
        soft_time_limit=soft,
        root_id=headers.get("root_id") or task_id,
        parent_id=headers.get("parent_id"),
        group=headers.get("group"),
        group_index=group_index if isinstance(group_index, int) else None,
        origin=headers.get("origin"),
        ignore_result=headers.get("ignore_result"),
        deliveries=deliveries,
        headers=headers,
    )


def carried_deliveries(headers: Mapping[str, Any] | None) -> int:
    """The delivery count a re-published copy carries; 0 when it carries none, or one that
    is not a count (``parse_request`` says what is wrong with it)."""
    value = (headers or {}).get(DELIVERIES_HEADER)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return 0
    return value


def decode_body(
    body: bytes | str, content_type: str | None, content_encoding: str | None,
) -> tuple[list[Any], dict[str, Any], dict[str, Any]]:
    """Decode ``[args, kwargs, embed]`` or raise MalformedMessage naming the problem."""
    try:
        decoded = loads(body, content_type, content_encoding, accept=ACCEPT_CONTENT)
    except ContentDisallowed:
        raise MalformedMessage(
            f"content type {content_type!r} is not accepted (accepted: "
            f"{', '.join(sorted(ACCEPT_CONTENT))})") from None
    except (DecodeError, ValueError, UnicodeDecodeError) as exc:
        raise MalformedMessage(f"body is not valid {content_type}: {exc}") from None
    if not isinstance(decoded, (list, tuple)) or len(decoded) != 3:
        raise MalformedMessage(
            "body must be the protocol v2 triple [args, kwargs, embed], "
            f"got {_repr.repr(decoded)}")
    args, kwargs, embed = decoded
    if not isinstance(args, (list, tuple)):
        raise MalformedMessage(f"body args must be a list, not {_repr.repr(args)}")
    if not isinstance(kwargs, dict):
        raise MalformedMessage(f"body kwargs must be an object, not {_repr.repr(kwargs)}")
    if embed is not None and not isinstance(embed, dict):
        raise MalformedMessage(f"body embed must be an object, not {_repr.repr(embed)}")
    return list(args), kwargs, embed or {}


def countdown_to_eta(countdown: float, now: datetime | None = None) -> datetime:
    return (now or utcnow()) + timedelta(seconds=countdown)
