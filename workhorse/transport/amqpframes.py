"""Reading RabbitMQ's deliveries faster than py-amqp does, with the same results.

A delivery comes as three frames: the ``basic.deliver`` method, a content header holding
the message's properties (Celery's protocol puts some twenty headers in its
``application_headers`` table), and the body. py-amqp decodes the header with a general
reader that tests the type letter of every value against a chain of string comparisons
and unpacks each length with a tuple; on this machine that took 45 µs a delivery, a
tenth of the supervisor's CPU a task on RabbitMQ. ``decode_basic_properties`` reads the
same bytes into the same values (the same Python types, the same fallbacks for text that
is not UTF-8, the same error for a type it does not know) in a loop made for the common
values: strings, voids, booleans and integers. One difference: a table nested too
deeply for Python (RecursionError, from py-amqp's reader too) is not raised into the
connection, which would fail on that message each time RabbitMQ delivers it again, and
hold up every message behind it; the message comes with headers that say so instead, to
be dead-lettered as malformed (``_unreadable``).

``frame_handler`` assembles frames into messages as py-amqp's does (its Message objects,
the same callbacks and order), with the header decoded here; the connection takes it
in place of py-amqp's (``Connection(frame_handler=...)``).
"""
from __future__ import annotations

import base64
import hashlib
import struct
from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from amqp import spec
from amqp.basic_message import Message
from amqp.exceptions import FrameSyntaxError, UnexpectedFrame

from ..protocol import RAW_HEADERS_HEADER, UNREADABLE_HEADERS_HEADER

_U32 = struct.Struct(">I").unpack_from
_U16 = struct.Struct(">H").unpack_from
_U64 = struct.Struct(">Q").unpack_from
_METHOD = struct.Struct(">HH").unpack_from
_HEADER = struct.Struct(">HxxQ").unpack_from

#: Fixed-size table values other than strings: the letter's struct and its size.
_FIXED: dict[int, tuple[Callable[[bytes, int], tuple[Any, ...]], int]] = {
    ord(letter): (struct.Struct(">" + code).unpack_from, struct.calcsize(">" + code))
    for letter, code in (
        ("b", "b"), ("B", "B"),     # short-short int, signed and not
        ("s", "h"), ("U", "h"),     # short int (RabbitMQ writes 's'; py-amqp reads 'U')
        ("u", "H"),
        ("I", "i"), ("i", "I"),     # long int, signed and not
        ("l", "q"), ("L", "q"),     # long-long int: both letters read as signed
        ("f", "f"), ("d", "d"),
    )
}

#: The methods a content (header and body frames) follows.
_CONTENT_METHODS = frozenset((spec.Basic.Deliver, spec.Basic.Return, spec.Basic.GetOk))
_BASIC = spec.Basic.CLASS_ID


def _text(raw: bytes) -> str | bytes:
    """A table's key or string: text if it is UTF-8 (lone surrogates allowed, as
    py-amqp's ``surrogatepass``), else the bytes as they came."""
    try:
        return raw.decode()
    except UnicodeDecodeError:
        pass
    try:
        return raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return raw


#: Table keys seen, decoded (Celery's twenty recur in every message); at most _MAX_KEYS.
_KEYS: dict[bytes, str | bytes] = {}
_MAX_KEYS = 512


def _table(buf: bytes, offset: int, limit: int) -> dict[Any, Any]:
    """The field table in ``buf[offset:limit]``."""
    table: dict[Any, Any] = {}
    keys = _KEYS
    while offset < limit:
        end = offset + 1 + buf[offset]
        raw = buf[offset + 1:end]
        key = keys.get(raw)
        if key is None:
            key = _text(raw)
            if len(keys) < _MAX_KEYS:
                keys[raw] = key
        kind = buf[end]
        offset = end + 1
        if kind == 83:                                  # 'S': long string
            end = offset + 4 + _U32(buf, offset)[0]
            raw = buf[offset + 4:end]
            try:
                table[key] = raw.decode()
            except UnicodeDecodeError:
                table[key] = _text(raw)
            offset = end
        elif kind == 86:                                # 'V': void
            table[key] = None
        elif kind == 116:                               # 't': boolean
            table[key] = buf[offset] != 0
            offset += 1
        else:
            table[key], offset = _value(kind, buf, offset)
    return table


def _value(kind: int, buf: bytes, offset: int) -> tuple[Any, int]:
    """The value of type letter ``kind`` at ``offset``, and the offset after it."""
    fixed = _FIXED.get(kind)
    if fixed is not None:
        unpack, size = fixed
        return unpack(buf, offset)[0], offset + size
    if kind == 83:                                      # 'S'
        end = offset + 4 + _U32(buf, offset)[0]
        return _text(buf[offset + 4:end]), end
    if kind == 86:                                      # 'V'
        return None, offset
    if kind == 116:                                     # 't'
        return buf[offset] != 0, offset + 1
    if kind == 70:                                      # 'F': table
        start = offset + 4
        end = start + _U32(buf, offset)[0]
        return _table(buf, start, end), end
    if kind == 65:                                      # 'A': array
        offset, limit = offset + 4, offset + 4 + _U32(buf, offset)[0]
        items = []
        while offset < limit:
            item, offset = _value(buf[offset], buf, offset + 1)
            items.append(item)
        return items, offset
    if kind == 120:                                     # 'x': byte array
        end = offset + 4 + _U32(buf, offset)[0]
        return buf[offset + 4:end], end
    if kind == 84:                                      # 'T': timestamp, naive UTC
        stamp = datetime.fromtimestamp(_U64(buf, offset)[0], tz=UTC).replace(tzinfo=None)
        return stamp, offset + 8
    if kind == 68:                                      # 'D': decimal
        places, digits = buf[offset], struct.unpack_from(">i", buf, offset + 1)[0]
        return Decimal(digits) / Decimal(10 ** places), offset + 5
    raise FrameSyntaxError(f"Unknown value in table: {chr(kind)!r} ({str!r})")


#: The basic class's short-string properties by flag, in the order they come.
_SHORT_STRINGS = {0x8000: "content_type", 0x4000: "content_encoding",
                  0x0400: "correlation_id", 0x0200: "reply_to", 0x0100: "expiration",
                  0x0080: "message_id", 0x0020: "type", 0x0010: "user_id",
                  0x0008: "app_id", 0x0004: "cluster_id"}


#: Property flags -> the flags set in them, in order (a few combinations recur).
_PRESENT: dict[int, tuple[int, ...]] = {}


def decode_basic_properties(buf: bytes, offset: int) -> dict[str, Any]:
    """The properties of a basic-class content header, read from ``buf`` at ``offset``
    (after its class, weight and body size): what py-amqp's ``decode_properties_basic``
    returns for the same bytes (and for bytes that end too soon, the same: a string cut
    short read as it is, a length or a type cut off an IndexError or struct.error)."""
    return _properties(buf if isinstance(buf, bytes) else bytes(buf), offset)


def _properties(buf: bytes, offset: int) -> dict[str, Any]:
    flags = _U16(buf, offset)[0]
    offset += 2
    present = _PRESENT.get(flags)
    if present is None:
        present = _PRESENT[flags] = tuple(1 << bit for bit in range(15, 1, -1)
                                          if flags & 1 << bit)
    properties: dict[str, Any] = {}
    for flag in present:
        if flag == 0x2000:
            start = offset + 4
            offset = start + _U32(buf, offset)[0]
            try:
                properties["application_headers"] = _table(buf, start, offset)
            except RecursionError:
                properties["application_headers"] = _unreadable(buf[start:offset])
        elif flag == 0x1000:
            properties["delivery_mode"] = buf[offset]
            offset += 1
        elif flag == 0x0800:
            properties["priority"] = buf[offset]
            offset += 1
        elif flag == 0x0040:
            properties["timestamp"] = _U64(buf, offset)[0]
            offset += 8
        else:
            end = offset + 1 + buf[offset]
            properties[_SHORT_STRINGS[flag]] = buf[offset + 1:end].decode(
                "utf-8", "surrogatepass")
            offset = end
    return properties


#: The most of an unreadable table kept, in base64, in its message's headers: the dead
#: letter that carries them must fit in one frame (RabbitMQ's frame_max, 131,072 bytes by
#: default) with its other properties; a header over that fails its connection.
RAW_HEADERS_KEPT = 64 * 1024


def _unreadable(table: bytes) -> dict[str, str]:
    """Headers in place of a table nested too deeply to read (py-amqp's reader raises
    RecursionError as well): the message is delivered, to be dead-lettered as malformed
    with these, rather than failing the connection again each time it is delivered. The
    table's bytes go with them, or, past RAW_HEADERS_KEPT, their size and SHA-256."""
    why = "nested too deeply to read"
    raw = base64.b64encode(table).decode("ascii")
    if len(raw) > RAW_HEADERS_KEPT:
        return {UNREADABLE_HEADERS_HEADER: f"{why}; {len(table)} bytes, too many to keep "
                                           f"(SHA-256 {hashlib.sha256(table).hexdigest()})"}
    return {UNREADABLE_HEADERS_HEADER: why, RAW_HEADERS_HEADER: raw}


def frame_handler(connection: Any, callback: Callable[..., Any]) -> Callable[..., bool]:
    """A connection's reader of frames: ``on_frame((type, channel, payload))`` hands each
    method to ``callback(channel, method, payload, content)`` as py-amqp's own does, a
    content method once its header and body have come (py-amqp's ``Message``, its
    ``properties`` decoded by ``decode_basic_properties``). Returns True when a method
    was handed over."""
    partial: dict[int, Message] = {}        # channel -> its content being assembled
    awaiting: dict[int, int] = {}           # channel -> the frame type its content awaits

    def on_frame(frame: tuple[int, int, bytes]) -> bool:
        kind, channel, payload = frame
        connection.bytes_recv += 1
        expected = awaiting.get(channel, 1)
        if kind != expected:
            if kind == 8:                   # a heartbeat: counted above
                return False
            raise UnexpectedFrame(
                f"Received frame {kind} while expecting type: {expected}")
        if kind == 1:
            method = _METHOD(payload, 0)
            if method in _CONTENT_METHODS:
                partial[channel] = Message(frame_method=method, frame_args=payload)
                awaiting[channel] = 2
                return False
            callback(channel, method, payload, None)
            return True
        message = partial[channel]
        if kind == 2:
            class_id, size = _HEADER(payload, 0)
            message.body_size = size
            if class_id == _BASIC:
                message.properties = decode_basic_properties(payload, 12)
            else:
                message._load_properties(class_id, payload, 12)
            if size:
                awaiting[channel] = 3
                return False
            message.ready = True
        else:
            message.inbound_body(payload)
            if not message.ready:
                return False
        del partial[channel], awaiting[channel]
        callback(channel, message.frame_method, message.frame_args, message)
        return True

    return on_frame
