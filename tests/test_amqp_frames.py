"""Our reader of RabbitMQ's frames (``workhorse.transport.amqpframes``) against py-amqp's:
the same properties and headers from the same bytes, for every value type and property,
text that is not UTF-8 included; the same errors for bytes it cannot read; the same
messages handed over in the same order from the same frames."""
from __future__ import annotations

import random
import struct
from datetime import datetime
from decimal import Decimal
from types import SimpleNamespace
from typing import Any

import pytest
from amqp import spec
from amqp.basic_message import Message
from amqp.exceptions import FrameSyntaxError, UnexpectedFrame
from amqp.method_framing import frame_handler as amqp_frame_handler
from amqp.serialization import decode_properties_basic, dumps

from workhorse.transport.amqpframes import decode_basic_properties, frame_handler

pytestmark = pytest.mark.timeout(60)


def both(raw: bytes, offset: int = 0) -> tuple[Any, Any]:
    return decode_basic_properties(raw, offset), decode_properties_basic(raw, offset)[0]


def headers_only(table: bytes) -> bytes:
    """A content header's properties: only application_headers, this encoded table."""
    return struct.pack(">HI", 0x2000, len(table)) + table


def field(key: bytes, letter: bytes, value: bytes) -> bytes:
    return bytes([len(key)]) + key + letter + value


def nested(letter: bytes, depth: int) -> bytes:
    """A table whose one field ``x`` holds a table (``F``) or an array (``A``) holding
    another, ``depth`` deep, a void at the bottom."""
    value = b"V"
    for _ in range(depth):
        inner = field(b"x", value[:1], value[1:]) if letter == b"F" else value
        value = letter + struct.pack(">I", len(inner)) + inner
    return field(b"x", value[:1], value[1:])


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["str", "int", "big", "bool", "none", "float", "bytes", "time", "decimal"]
    if depth < 3:
        kinds += ["list", "dict"]
    kind = rng.choice(kinds)
    if kind == "str":
        return "".join(rng.choice("aé€𝄞 {}()'\"0") for _ in range(rng.randrange(0, 40)))
    if kind == "int":
        return rng.randrange(-2**31, 2**31)
    if kind == "big":
        return rng.randrange(-2**63, 2**63)
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "none":
        return None
    if kind == "float":
        return rng.uniform(-1e9, 1e9)
    if kind == "bytes":
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 20)))
    if kind == "time":
        return datetime(2000 + rng.randrange(40), 1 + rng.randrange(12), 1 + rng.randrange(28),
                        rng.randrange(24), rng.randrange(60), rng.randrange(60))
    if kind == "decimal":
        return Decimal(rng.randrange(-10**6, 10**6)) / Decimal(10 ** rng.randrange(5))
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    return {f"k{n}": random_value(rng, depth + 1) for n in range(rng.randrange(0, 5))}


@pytest.mark.parametrize("seed", range(40))
def test_random_tables_read_as_py_amqp_reads_them(seed):
    rng = random.Random(seed)
    table = {f"key{n}": random_value(rng) for n in range(rng.randrange(0, 25))}
    encoded = dumps("F", [table])
    ours, theirs = both(struct.pack(">H", 0x2000) + encoded)
    assert ours == theirs
    assert _types(ours) == _types(theirs)


def _types(value: Any) -> Any:
    """The value's shape with every leaf's type: equal values of other types differ."""
    if isinstance(value, dict):
        return {k: _types(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_types(v) for v in value]
    return type(value)


LETTERS = [
    (b"s", struct.pack(">h", -2)), (b"U", struct.pack(">h", -3)),
    (b"u", struct.pack(">H", 65000)), (b"b", struct.pack(">b", -4)),
    (b"B", struct.pack(">B", 250)), (b"I", struct.pack(">i", -5)),
    (b"i", struct.pack(">I", 4000000000)), (b"l", struct.pack(">q", -6)),
    (b"L", struct.pack(">q", -7)), (b"f", struct.pack(">f", 1.5)),
    (b"d", struct.pack(">d", -2.25)), (b"t", b"\x02"), (b"t", b"\x00"), (b"V", b""),
    (b"T", struct.pack(">Q", 1700000000)), (b"D", b"\x02" + struct.pack(">i", -12345)),
    (b"x", struct.pack(">I", 3) + b"\xff\x00\x01"),
    (b"S", struct.pack(">I", 2) + b"\xff\xfe"),            # not UTF-8: bytes
    (b"S", struct.pack(">I", 3) + b"\xed\xa0\x80"),        # a lone surrogate: text
    (b"A", struct.pack(">I", 9) + b"s\xff\xfeV" + b"S" + struct.pack(">I", 0)),
]


@pytest.mark.parametrize(("letter", "value"), LETTERS,
                         ids=[f"{n}-{letter.decode()}" for n, (letter, _) in
                              enumerate(LETTERS)])
def test_every_type_letter_reads_as_py_amqp_reads_it(letter, value):
    table = field(b"k", letter, value) + field(b"after", b"S", struct.pack(">I", 2) + b"ok")
    ours, theirs = both(headers_only(table))
    assert ours == theirs and _types(ours) == _types(theirs)
    assert ours["application_headers"]["after"] == "ok"


@pytest.mark.parametrize("key", [b"\xff", b"\xed\xa0\x80", "clé".encode()])
def test_keys_that_are_not_ascii_read_as_py_amqp_reads_them(key):
    for _ in range(2):                     # the second time from the decoded keys kept
        ours, theirs = both(headers_only(field(key, b"V", b"")))
        assert ours == theirs and _types(list(ours["application_headers"])) == _types(
            list(theirs["application_headers"]))


def test_an_unknown_type_letter_is_the_same_error():
    raw = headers_only(field(b"k", b"Z", b""))
    with pytest.raises(FrameSyntaxError) as ours:
        decode_basic_properties(raw, 0)
    with pytest.raises(FrameSyntaxError) as theirs:
        decode_properties_basic(raw, 0)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("letter", [b"F", b"A"])
def test_headers_nested_too_deeply_come_as_headers_that_say_so(letter):
    """py-amqp's reader raises RecursionError; ours gives headers naming the trouble and
    holding the table's bytes, so the message can be dead-lettered (test_message_formats)."""
    import base64

    from workhorse.protocol import RAW_HEADERS_HEADER, UNREADABLE_HEADERS_HEADER
    table = nested(letter, 5000)
    with pytest.raises(RecursionError):
        decode_properties_basic(headers_only(table), 0)
    properties = decode_basic_properties(headers_only(table) + b"tail", 0)
    assert properties == {"application_headers": {
        UNREADABLE_HEADERS_HEADER: "nested too deeply to read",
        RAW_HEADERS_HEADER: base64.b64encode(table).decode()}}


def test_an_unreadable_table_too_big_to_carry_is_named_by_its_size_and_digest():
    """Its bytes in base64 would not fit in the dead letter's one header frame."""
    import hashlib

    from workhorse.protocol import RAW_HEADERS_HEADER, UNREADABLE_HEADERS_HEADER
    from workhorse.transport.amqpframes import RAW_HEADERS_KEPT
    padding = b"p" * RAW_HEADERS_KEPT
    table = field(b"pad", b"S", struct.pack(">I", len(padding)) + padding) + nested(b"F", 5000)
    headers = decode_basic_properties(headers_only(table), 0)["application_headers"]
    assert RAW_HEADERS_HEADER not in headers
    assert headers[UNREADABLE_HEADERS_HEADER] == (
        f"nested too deeply to read; {len(table)} bytes, too many to keep "
        f"(SHA-256 {hashlib.sha256(table).hexdigest()})")


@pytest.mark.parametrize("cut", range(1, 20))
def test_bytes_that_end_too_soon_read_or_fail_as_with_py_amqp(cut):
    """py-amqp reads a string cut short as the shorter string, and fails on a length or
    a type cut off (IndexError or struct.error, by where the cut falls): so do we (one of
    the two, not always the same one: neither is a connection error)."""
    raw = headers_only(field(b"key", b"S", struct.pack(">I", 5) + b"value")
                       + field(b"n", b"l", struct.pack(">q", 5)))
    assert _outcome(decode_basic_properties, raw[:-cut]) == _outcome(
        lambda *args: decode_properties_basic(*args)[0], raw[:-cut])


def _outcome(decode: Any, raw: bytes) -> Any:
    try:
        return decode(raw, 0)
    except (struct.error, IndexError):
        return "cut off"


EVERY_PROPERTY = dict(
    content_type="application/json", content_encoding="utf-8",
    application_headers={"id": "x", "retries": 3}, delivery_mode=2, priority=9,
    correlation_id="c", reply_to="r", expiration="1000", message_id="m",
    timestamp=1700000000, type="t", user_id="guest", app_id="a", cluster_id="cl")


@pytest.mark.parametrize("drop", [None, *EVERY_PROPERTY])
def test_every_property_reads_as_py_amqp_reads_it(drop):
    properties = {k: v for k, v in EVERY_PROPERTY.items() if k != drop}
    raw = Message(b"", **properties)._serialize_properties()
    ours, theirs = both(b"padding" + raw, 7)
    assert ours == theirs == properties


def test_a_property_that_is_not_utf8_is_the_same_error():
    raw = struct.pack(">HB", 0x8000, 2) + b"\xff\xfe"
    with pytest.raises(UnicodeDecodeError):
        decode_basic_properties(raw, 0)
    with pytest.raises(UnicodeDecodeError):
        decode_properties_basic(raw, 0)


def test_a_memoryview_reads_as_bytes():
    raw = Message(b"", **EVERY_PROPERTY)._serialize_properties()
    assert decode_basic_properties(memoryview(raw), 0) == EVERY_PROPERTY


# -- frames into messages --------------------------------------------------------------

def method(sig: Any, args: bytes = b"") -> tuple[int, bytes]:
    return 1, struct.pack(">HH", *sig) + args


def header(size: int, **properties: Any) -> tuple[int, bytes]:
    raw = Message(b"", **properties)._serialize_properties()
    return 2, struct.pack(">HHQ", spec.Basic.CLASS_ID, 0, size) + raw


DELIVER = dumps("sLbss", ["ctag", 7, False, "", "q"])


def run(handler: Any, frames: list[tuple[int, int, bytes]]) -> tuple[list, list, int]:
    """Feed ``frames`` to a handler made by ``handler``: what it handed over, what each
    frame returned, and the frames it counted."""
    calls: list = []
    connection = SimpleNamespace(bytes_recv=0)
    on_frame = handler(connection, lambda *args: calls.append(args))
    returned = [on_frame(frame) for frame in frames]
    seen = [(channel, sig, args, None if content is None else
             (content.properties, content.body, content.body_size, content.ready))
            for channel, sig, args, content in calls]
    return seen, returned, connection.bytes_recv


def test_frames_are_handed_over_as_py_amqp_hands_them_over():
    frames = [
        (1, 0, method(spec.Connection.Blocked, b"\x03low")[1]),
        (8, 0, b""),                                              # a heartbeat
        (1, 1, method(spec.Basic.Deliver, DELIVER)[1]),
        (8, 0, b""),
        (1, 2, method(spec.Basic.Deliver, DELIVER)[1]),          # interleaved channels
        (2, 1, header(10, content_type="text/plain", application_headers={"a": 1})[1]),
        (2, 2, header(0, priority=1)[1]),                        # no body
        (3, 1, b"01234"),                                        # a body in two frames
        (8, 0, b""),
        (3, 1, b"56789"),
        (1, 1, method(spec.Basic.QosOk)[1]),
    ]
    ours = run(frame_handler, frames)
    assert ours == run(amqp_frame_handler, frames)
    handed, returned, counted = ours
    assert [h[0] for h in handed] == [0, 2, 1, 1] and counted == len(frames)
    assert handed[2][3] == ({"content_type": "text/plain", "application_headers": {"a": 1}},
                            b"0123456789", 10, True)
    assert returned == [True, False, False, False, False, False, True, False, False, True,
                        True]


@pytest.mark.parametrize("frames", [
    [(2, 1, b"")],                                               # a header out of turn
    [(3, 1, b"")],
    [(1, 1, method(spec.Basic.Deliver, DELIVER)[1]), (3, 1, b"x")],
    [(1, 1, method(spec.Basic.Deliver, DELIVER)[1]), (2, 1, header(4)[1]),
     (1, 1, method(spec.Basic.QosOk)[1])],
])
def test_a_frame_out_of_turn_is_the_same_error(frames):
    errors = []
    for handler in (frame_handler, amqp_frame_handler):
        with pytest.raises(UnexpectedFrame) as caught:
            run(handler, frames)
        errors.append(str(caught.value))
    assert errors[0] == errors[1]


# -- deliveries dispatched -------------------------------------------------------------

def channel_with_listener(**attributes: Any) -> tuple[Any, list]:
    """Our Channel, not connected, its basic.deliver listener recording what it gets."""
    from workhorse.transport.rabbitmq import Channel
    got: list = []
    channel = Channel.__new__(Channel)
    channel.is_closing = False
    channel._pending = {}
    channel._callbacks = {spec.Basic.Deliver: lambda *args: got.append(args)}
    channel.auto_decode = True
    channel.channel_id = 1
    for name, value in attributes.items():
        setattr(channel, name, value)
    return channel, got


def delivered(body: bytes, **properties: Any) -> Message:
    message = Message(frame_method=spec.Basic.Deliver, frame_args=b"")
    message.properties = properties
    message.body = body
    return message


@pytest.mark.parametrize(("args", "body", "properties"), [
    (["ctag", 7, False, "", "q"], "é".encode(), {"content_encoding": "utf-8"}),
    (["amq.ctag-Zx", 2**64 - 1, True, "exch", "rk.é"], b"\xff", {"content_encoding": "utf-8"}),
    (["", 1, True, "", ""], b"raw", {}),                         # no encoding: bytes
    (["c", 3, False, "e", "r"], b"x", {"content_encoding": "no-such-codec"}),
    (["c", 3, False, "e", "r"], b"x", {"content_encoding": None}),
])
def test_a_delivery_reaches_the_listener_as_through_py_amqp(args, body, properties):
    from amqp.abstract_channel import AbstractChannel
    payload = dumps("sLbss", args)
    ours, got = channel_with_listener()
    theirs, expected = channel_with_listener()
    ours.dispatch_method(spec.Basic.Deliver, b"\0\0\0\0" + payload,
                         delivered(body, **properties))
    AbstractChannel.dispatch_method(theirs, spec.Basic.Deliver, b"\0\0\0\0" + payload,
                                    delivered(body, **properties))
    assert [(a[:5], a[5].body) for a in got] == [(e[:5], e[5].body) for e in expected]
    assert list(got[0][:5]) == args


def test_a_delivery_with_a_one_shot_wait_or_a_closing_channel_goes_py_amqps_way():
    payload = b"\0\0\0\0" + dumps("sLbss", ["c", 1, False, "", "q"])
    waited: list = []
    channel, got = channel_with_listener(
        _pending={spec.Basic.Deliver: lambda *args: waited.append(args)})
    channel.dispatch_method(spec.Basic.Deliver, payload, delivered(b"x"))
    assert len(got) == 1 and len(waited) == 1 and not channel._pending
    channel, got = channel_with_listener(is_closing=True)
    channel.dispatch_method(spec.Basic.Deliver, payload, delivered(b"x"))
    assert got == []
