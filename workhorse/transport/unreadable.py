"""Entries the SQLite and Redis transports cannot read, and the envelope that keeps them.

Both store a message as kombu's JSON: ``{"body", "content-type", "content-encoding",
"headers", "properties": {"body_encoding", "delivery_tag", "delivery_info", ...}}``.
Anything else on a queue (written by another program or by hand, or cut short) cannot be
delivered, acked or put back. It is dead-lettered in an *envelope*: a message of that form
whose body is the entry's bytes as they were (base64, as kombu encodes bodies), and whose
headers say ``unreadable: <why>``, when, and from which queue. The envelope replaces the
entry in one step, so the entry is always in one place or the other.
"""
from __future__ import annotations

import base64
import binascii
import json
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import msgspec
from kombu.utils.json import loads

from ..protocol import DEAD_AT_HEADER, DEAD_QUEUE_HEADER, DEAD_REASON_HEADER, dead_letter_queue

#: How the reason of an envelope starts.
UNREADABLE = "unreadable"
#: The envelope's body is the entry as it was: bytes of no known type.
RAW_CONTENT_TYPE = "application/octet-stream"
#: Levels of Python's recursion limit added while a taken entry is decoded again (see
#: ``headroom``).
HEADROOM = 200

_headroom_lock = threading.Lock()
_headroom_users = 0
_limit_before = 0


@contextmanager
def headroom() -> Iterator[None]:
    """Python's recursion limit raised by HEADROOM while an entry taken before is decoded
    (or encoded) again: put back, or recovered from a worker that is gone. How deep a
    document the decoders read depends on how deep the stack already is; one the take read
    with a few levels to spare, read again from a deeper stack, raised RecursionError, and
    the put-back failed, or kombu's sweep stopped at it, leaving every entry behind it
    unrestored. (Several threads may be inside at once: the first raises it, the last
    sets it back.)"""
    global _headroom_users, _limit_before
    with _headroom_lock:
        if _headroom_users == 0:
            _limit_before = sys.getrecursionlimit()
            sys.setrecursionlimit(_limit_before + HEADROOM)
        _headroom_users += 1
    try:
        yield
    finally:
        with _headroom_lock:
            _headroom_users -= 1
            if _headroom_users == 0:
                sys.setrecursionlimit(_limit_before)


def read(raw: bytes | str, *, tagged: bool) -> tuple[dict[str, Any] | None, str | None]:
    """``(message, None)`` for an entry kombu can deliver, else ``(None, why)``.
    ``tagged``: the entry must carry its delivery tag (Redis keeps it in the entry; the
    SQLite transport makes a fresh one for each lease)."""
    if not raw:
        return None, "an empty entry"
    message, why = decode(raw)
    if why is not None:
        return None, why
    if not isinstance(message, dict):
        return None, f"JSON {type(message).__name__}, not kombu's message object"
    properties = message.get("properties")
    if not isinstance(properties, dict):
        return None, "no properties object"
    if tagged and not isinstance(properties.get("delivery_tag"), str):
        return None, "no delivery tag"
    if not isinstance(message.get("headers") or {}, dict):
        return None, "headers are not an object"
    body, encoding = message.get("body"), properties.get("body_encoding")
    if body is not None and not isinstance(body, str):
        return None, f"body is JSON {type(body).__name__}, not a string"
    if encoding is not None and encoding != "base64" and str(encoding).lower() != "utf-8":
        return None, f"unknown body_encoding {encoding!r}"
    if body and encoding == "base64":
        try:
            binascii.a2b_base64(body)  # as kombu's b64decode does, minus its wrapper
        except (binascii.Error, ValueError) as exc:
            return None, f"body is not base64 ({exc})"
    return message, None


def decode(raw: bytes | str) -> tuple[Any, str | None]:
    """``(value, None)``: ``raw``'s JSON as kombu decodes it; else ``(None, why)``."""
    try:
        return _loads(raw), None
    except RecursionError:      # (no decoder here reads it: kombu's neither)
        return None, "JSON nested too deeply to read"
    except (ValueError, TypeError) as exc:   # UnicodeDecodeError, kombu's typed values
        return None, f"not JSON ({exc})"
    except Exception as exc:    # noqa: BLE001 - a typed value ({"__type__": ..., ...})
        # whose decoder raised something else: an AttributeError, decimal's InvalidOperation
        return None, f"a value kombu cannot decode ({type(exc).__name__}: {exc})"


def _loads(raw: bytes | str) -> Any:
    """kombu's JSON decoding, which turns ``{"__type__": ..., "__value__": ...}`` objects
    into the values they stand for. Its hook runs in Python for every object, and makes
    ``json`` build a decoder per call. Text with neither that key nor an escape (which
    could spell it) has no such object: msgspec's decoder reads it, to the same values
    (integers of any size included), in about 1.4 µs for a Celery message where kombu's
    takes 5.2 and the standard decoder with no hook 4.3. What msgspec refuses goes to
    the standard decoder, which reads it as kombu would or says why not: NaN, Infinity,
    numbers past a float's range, text that is not JSON. (Nesting too deep for it is
    too deep for any: RecursionError, as from the others.)"""
    # (A backslash first: a search for one byte is memchr, a fifth of the time the
    # search for two takes, and most messages have none.)
    if isinstance(raw, str):
        marked = "__type__" in raw or ("\\" in raw and "\\u" in raw)
    else:
        if type(raw) is not bytes:
            raw = bytes(raw)        # (a bytearray, a memoryview, a subclass)
        marked = b"__type__" in raw or (b"\\" in raw and b"\\u" in raw)
    if not marked:
        try:
            return _decode(raw)
        except (msgspec.DecodeError, UnicodeEncodeError):   # (a str with a lone surrogate)
            pass
    text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    return loads(text) if marked else json.loads(text)


#: (A decoder made once: msgspec's ``json.decode`` makes one a call.)
_decode = msgspec.json.Decoder().decode


def body(message: dict[str, Any]) -> bytes | str | None:
    """The body of a message ``read`` accepted, decoded as kombu decodes it."""
    value = message.get("body")
    if value and message["properties"].get("body_encoding") == "base64":
        return base64.b64decode(value)
    return value


def envelope(raw: bytes | str, why: str, queue: str, now: datetime | None = None) -> str:
    """kombu's JSON for a dead letter holding ``raw``, an entry of ``queue`` that could not
    be read because of ``why``."""
    data = raw.encode("utf-8", "surrogateescape") if isinstance(raw, str) else raw
    headers = {
        DEAD_REASON_HEADER: f"{UNREADABLE}: {why}",
        DEAD_AT_HEADER: (now or datetime.now(UTC)).isoformat(),
        DEAD_QUEUE_HEADER: queue,
    }
    return json.dumps({
        "body": base64.b64encode(data).decode("ascii"),
        "content-type": RAW_CONTENT_TYPE,
        "content-encoding": "binary",
        "headers": headers,
        "properties": {
            "body_encoding": "base64",
            "delivery_tag": str(uuid.uuid4()),
            "delivery_info": {"exchange": "", "routing_key": dead_letter_queue(queue)},
            "delivery_mode": 2,
            "priority": 0,
        },
    })


def is_envelope(headers: dict[str, Any]) -> bool:
    reason = headers.get(DEAD_REASON_HEADER)
    return isinstance(reason, str) and reason.startswith(f"{UNREADABLE}:")
