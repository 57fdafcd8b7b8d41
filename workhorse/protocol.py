"""Celery's task message protocol: building v2 messages, reading v2 and v1 ones back.

Pure functions, no I/O. The v2 layout is in ``shared/WIRE.md``: body ``[args, kwargs,
embed]``, everything else in headers. Unknown headers are kept so a re-published message
carries them. Protocol v1 (Celery 3 producers; Celery 5 workers still read it) has no
``task`` header: the body is one JSON object holding the task name, id, arguments, options
and workflow links; it is read into the same Request and body as v2.
"""
from __future__ import annotations

import json
import os
import reprlib
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from types import MappingProxyType
from typing import Any, NamedTuple, TypeGuard

from kombu.exceptions import ContentDisallowed, DecodeError
from kombu.serialization import loads, registry
from kombu.utils import json as kombu_json

from .exceptions import MalformedMessage

#: The delivery count a copy workhorse re-publishes carries (deliveries of the message
#: before the copy that may have ended in a loss: docs/delivery.md "delivery count").
DELIVERIES_HEADER = "x-workhorse-deliveries"
#: How often the message was only held (never started) by a worker that died: counted
#: apart from deliveries, against the much larger bound ``max_held_losses``.
HELD_LOSSES_HEADER = "x-workhorse-held-losses"
#: Set on a message that may have been running when its worker died: it runs alone from
#: then on (nothing else in that worker beside it), so that another death names it.
SUSPECT_HEADER = "x-workhorse-suspect"
#: Dead letters of a queue go to ``<queue>.dead``, with headers saying why, which task,
#: when, from which queue and by which worker (docs/delivery.md "settle").
DEAD_SUFFIX = ".dead"
DEAD_REASON_HEADER = "x-workhorse-dead-reason"
DEAD_TASK_HEADER = "x-workhorse-dead-task-id"
DEAD_AT_HEADER = "x-workhorse-dead-at"
DEAD_QUEUE_HEADER = "x-workhorse-dead-queue"
DEAD_WORKER_HEADER = "x-workhorse-dead-worker"
#: RabbitMQ: a message whose headers (an AMQP field table) nest too deeply for Python to
#: read comes with these two in their place, why and the table's bytes in base64 (up to
#: 48 KiB of them), and is dead-lettered as malformed (``transport.amqpframes``): the
#: worker goes on.
UNREADABLE_HEADERS_HEADER = "x-workhorse-unreadable-headers"
RAW_HEADERS_HEADER = "x-workhorse-raw-headers"
#: The content types a worker accepts; pickle is refused because it runs code on load.
ACCEPT_CONTENT = frozenset({"application/json"})
ORIGIN = f"gen{os.getpid()}@{socket.gethostname()}"

_repr = reprlib.Repr()
_repr.maxstring = 80
_repr.maxother = 80
_repr.maxlevel = 3


def utcnow() -> datetime:
    return datetime.now(UTC)


#: The headers ``build_message`` writes afresh for each message (canvas bookkeeping such
#: as ``stamps`` passes through).
_PROTOCOL_HEADERS = frozenset({
    "lang", "task", "id", "shadow", "eta", "expires", "group", "group_index", "retries",
    "timelimit", "root_id", "parent_id", "argsrepr", "kwargsrepr", "origin", "ignore_result"})
#: Headers a message gets from its broker or from workhorse's handling of it, never from
#: its producer: a copy the task sends of itself (a retry) starts without them.
_DELIVERY_HEADERS = frozenset({"redelivered", "x-death", "x-delivery-count"})


def custom_headers(headers: Mapping[str, Any]) -> dict[str, Any]:
    """The headers a producer added to a task message (``apply_async(headers=…)``): what
    a retry carries on. The protocol's own are written afresh for the copy; the broker's
    and workhorse's bookkeeping (delivery counts, dead-letter reasons) stay behind."""
    return {key: value for key, value in headers.items()
            if key not in _PROTOCOL_HEADERS and key not in _DELIVERY_HEADERS
            and not key.startswith("x-workhorse-")}


#: A decoded body: args, kwargs and embed (callbacks, errbacks, chain, chord).
Body = tuple[list[Any], dict[str, Any], dict[str, Any]]


@dataclass(frozen=True)
class TaskMessage:
    """What a producer hands to kombu: the body to serialize, headers and properties."""

    body: Body
    headers: dict[str, Any]
    properties: dict[str, Any]


#: Headers of a task sent by a schedule: its name, and the due time it is for (ISO 8601 in
#: the schedule's time zone); a task reads them as self.request.schedule / .nominal_time.
SCHEDULE_HEADER = "workhorse_schedule"
NOMINAL_HEADER = "workhorse_nominal_time"


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


def countdown_to_eta(countdown: float, now: datetime | None = None) -> datetime:
    return (now or utcnow()) + timedelta(seconds=countdown)


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


class Request(NamedTuple):
    """A task message's headers (a v1 message's, converted), read and checked; the body
    is decoded in the child. (A named tuple: read for every message the worker takes.)"""

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
    headers: Mapping[str, Any] = MappingProxyType({})


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
    # (None, the usual value of each, is read here: no call for it)
    hard = None if limits[0] is None else _optional_number(limits[0], "timelimit[0] (hard)")
    soft = None if limits[1] is None else _optional_number(limits[1], "timelimit[1] (soft)")
    group_index = headers.get("group_index")
    eta, expires = headers.get("eta"), headers.get("expires")
    return Request(
        id=task_id,
        task=task,
        retries=retries,
        eta=None if eta is None else parse_datetime(eta, "eta"),
        expires=None if expires is None else parse_datetime(expires, "expires"),
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
    return _count(headers, DELIVERIES_HEADER)


def carried_held_losses(headers: Mapping[str, Any] | None) -> int:
    """How often the message was only held by a worker that died (``HELD_LOSSES_HEADER``);
    0 when it says nothing, or nothing that is a count."""
    if not headers or HELD_LOSSES_HEADER not in headers:
        return 0        # (nearly every message: once a task)
    return _count(headers, HELD_LOSSES_HEADER)


def is_suspect(headers: Mapping[str, Any] | None) -> bool:
    return bool((headers or {}).get(SUSPECT_HEADER))


@dataclass(frozen=True)
class Verdict:
    """What a worker's death costs one message it held (its journal says, ``broker.journal``).

    ``started``: it may have started and ended in a loss: a delivery, as its take counted.
    It is then a suspect: it runs alone from now on, so that another death names it and
    none of its neighbours. ``held_loss``: only held, and counted as a held loss (when the
    worker died while looking at another message held at an earlier death, only that one
    is).
    """

    started: bool
    held_loss: bool


def after_loss(headers: Mapping[str, Any] | None, verdict: Verdict) -> dict[str, Any]:
    """A message's headers once its worker died holding it, as ``verdict`` says."""
    if not isinstance(headers, Mapping):    # (another program's producer: null, a list)
        headers = None
    out = dict(headers or {})
    if verdict.held_loss:
        out[HELD_LOSSES_HEADER] = carried_held_losses(headers) + 1
    if verdict.started:
        out[SUSPECT_HEADER] = 1
    return out


def _count(headers: Mapping[str, Any] | None, name: str) -> int:
    value = (headers or {}).get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return 0
    return value


def header_request(headers: Mapping[str, Any] | None,
                   keep: Mapping[str, Any] | None = None) -> Request | None:
    """What the headers alone say of a message (its id and task's name), for one that must
    not be decoded; None when they give no id. Never raises. ``keep``: the headers the
    request carries, when not these."""
    headers = headers or {}
    task_id, task = headers.get("id"), headers.get("task")
    if not _is_name(task_id):
        return None
    return Request(id=task_id, task=task if _is_name(task) else "?",
                   headers=headers if keep is None else keep)


def decode_body(body: bytes | str, content_type: str | None,
                content_encoding: str | None) -> Body:
    """Decode a v2 body ``[args, kwargs, embed]`` or raise MalformedMessage naming the
    problem."""
    decoded = _loads(body, content_type, content_encoding)
    if not isinstance(decoded, (list, tuple)) or len(decoded) != 3:
        raise MalformedMessage(
            "body must be the protocol v2 triple [args, kwargs, embed], "
            f"got {_repr.repr(decoded)}")
    args, kwargs, embed = decoded
    if embed is not None and not isinstance(embed, dict):
        raise MalformedMessage(f"body embed must be an object, not {_repr.repr(embed)}")
    return _arguments(args, kwargs) + (embed or {},)


def _arguments(args: Any, kwargs: Any) -> tuple[list[Any], dict[str, Any]]:
    if not isinstance(args, (list, tuple)):
        raise MalformedMessage(f"body args must be a list, not {_repr.repr(args)}")
    if not isinstance(kwargs, dict):
        raise MalformedMessage(f"body kwargs must be an object, not {_repr.repr(kwargs)}")
    return list(args), kwargs


#: kombu's JSON decoding, its decoder made once rather than for every body: the same
#: object hook reads the types kombu writes (datetimes, UUIDs, ``register_type``'s).
_JSON_DECODER = json.JSONDecoder(object_hook=kombu_json.object_hook)


def _loads(body: bytes | str, content_type: str | None, content_encoding: str | None) -> Any:
    if (content_type == "application/json" and body and type(body) is bytes
            and registry._decoders.get(content_type) is kombu_json.loads):
        # What kombu's registry would do with it, less its lookups (a decoder registered
        # for JSON in kombu's place is used through the registry).
        try:
            return _JSON_DECODER.decode(body.decode())
        except Exception as exc:  # noqa: BLE001 - kombu wraps every error as DecodeError
            raise MalformedMessage(f"body is not valid {content_type}: {exc}") from None
    try:
        return loads(body, content_type, content_encoding, accept=ACCEPT_CONTENT)
    except ContentDisallowed:
        raise MalformedMessage(
            f"content type {content_type!r} is not accepted (accepted: "
            f"{', '.join(sorted(ACCEPT_CONTENT))})") from None
    except (DecodeError, ValueError, UnicodeDecodeError) as exc:
        raise MalformedMessage(
            f"body is not valid {content_type or 'JSON (no content type given)'}: {exc}"
        ) from None


# ---------------------------------------------------------------------- v2 or v1
def read_request(headers: Mapping[str, Any] | None, body: bytes | str,
                 content_type: str | None, content_encoding: str | None) -> Request:
    """The request a message makes, or MalformedMessage saying why there is none. A v2
    message is read from its headers alone (its body is the child's to decode); a message
    without a ``task`` header is read as protocol v1, from its body."""
    if _is_v2(headers):
        return parse_request(headers)
    return _read_v1(headers, body, content_type, content_encoding)[0]


def read_message(headers: Mapping[str, Any] | None, body: bytes | str,
                 content_type: str | None, content_encoding: str | None,
                 ) -> tuple[Request, Body]:
    """The request and the decoded body, v2 or v1, or MalformedMessage saying why not."""
    if _is_v2(headers):
        return parse_request(headers), decode_body(body, content_type, content_encoding)
    return _read_v1(headers, body, content_type, content_encoding)


def malformed_request(headers: Mapping[str, Any] | None, body: bytes | str,
                      content_type: str | None, content_encoding: str | None,
                      ) -> Request | None:
    """What can be read of a message ``read_message`` refused: its id (and its task's name,
    if it gives one) to store the failure under; None when it gives no id. Never raises."""
    request = header_request(headers)
    if request is not None or _is_v2(headers):
        return request
    try:
        fields = _loads(body, content_type, content_encoding)
    except MalformedMessage:
        return None
    if not isinstance(fields, dict):
        return None
    return header_request({**(headers or {}), "id": fields.get("id"),
                           "task": fields.get("task")}, headers)


def _is_v2(headers: Mapping[str, Any] | None) -> bool:
    """Celery's own test: a v2 message has a ``task`` header, whatever its value."""
    return headers is not None and "task" in headers


def _is_name(value: Any) -> TypeGuard[str]:
    return isinstance(value, str) and bool(value)


# ---------------------------------------------------------------------- protocol v1
def _read_v1(headers: Mapping[str, Any] | None, body: bytes | str,
            content_type: str | None, content_encoding: str | None) -> tuple[Request, Body]:
    """Read a message without a ``task`` header as protocol v1: its body a JSON object
    naming its ``task`` (Celery's own test)."""
    unreadable = (headers or {}).get(UNREADABLE_HEADERS_HEADER)
    if unreadable is not None:
        kept = (f"; their bytes are kept in {RAW_HEADERS_HEADER}, base64"
                if RAW_HEADERS_HEADER in (headers or {}) else "")
        raise MalformedMessage(f"its headers could not be read ({unreadable}){kept}")
    fields = _loads(body, content_type, content_encoding)
    if not isinstance(fields, dict) or "task" not in fields:
        raise MalformedMessage(
            "no 'task' header (protocol v2), and the body is not a protocol v1 task "
            f"(an object naming its 'task'): got {_repr.repr(fields)}")
    try:
        v2_headers, v2_body = v1_to_v2(fields, headers or {})
        return parse_request(v2_headers), v2_body
    except MalformedMessage as exc:
        raise MalformedMessage(f"protocol v1 body (its fields read as v2 headers): {exc}"
                               ) from None


def v1_to_v2(fields: Mapping[str, Any], headers: Mapping[str, Any],
             ) -> tuple[dict[str, Any], Body]:
    """The v2 headers and body a v1 body stands for. The message's own headers (a delivery
    count, a redelivered mark) are kept; the body's fields take precedence over them.
    ``taskset`` is v1's name for the group; ``utc = false`` means naive times are local."""
    args, kwargs = fields.get("args"), fields.get("kwargs")
    args, kwargs = _arguments([] if args is None else args, {} if kwargs is None else kwargs)
    task_id = fields.get("id")
    utc = fields.get("utc", True) is not False
    v2_headers = dict(headers)
    v2_headers.update({
        "lang": "py",
        "task": fields.get("task"),
        "id": task_id,
        "shadow": None,
        "eta": _v1_time(fields.get("eta"), utc),
        "expires": _v1_time(fields.get("expires"), utc),
        "group": fields.get("group") or fields.get("taskset"),
        "group_index": fields.get("group_index"),
        "retries": fields.get("retries") or 0,
        "timelimit": fields.get("timelimit") or [None, None],
        "root_id": fields.get("root_id") or task_id,
        "parent_id": fields.get("parent_id"),
        "argsrepr": _repr.repr(tuple(args)),
        "kwargsrepr": _repr.repr(kwargs),
        "origin": fields.get("origin"),
    })
    embed = {"callbacks": fields.get("callbacks"), "errbacks": fields.get("errbacks"),
             "chain": None, "chord": fields.get("chord")}
    return v2_headers, (args, kwargs, embed)


def _v1_time(value: Any, utc: bool) -> Any:
    """A v1 time as v2 reads it: naive means UTC in v2, local time in a ``utc = false`` v1
    body. What is not a date is passed on for ``parse_request`` to refuse."""
    if utc or not isinstance(value, str):
        return value
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return value
    return (parsed if parsed.tzinfo else parsed.astimezone()).isoformat()
