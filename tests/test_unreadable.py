"""Entries the SQLite and Redis transports cannot read: what makes one unreadable, and the
envelope that keeps it, readable, in the dead-letter queue (replacing it in one step)."""
from __future__ import annotations

import base64
import json
import sys
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import redis
from kombu import Connection, Consumer, Producer

from workhorse.protocol import (DEAD_QUEUE_HEADER, DEAD_REASON_HEADER, HELD_LOSSES_HEADER,
                                Verdict)
from workhorse.broker.queues import ensure_queue
from workhorse.transport import REDIS as REDIS_TRANSPORT
from workhorse.transport import unreadable
from workhorse.transport.redis import _BURY_NEXT
from workhorse.transport.store import Store

from .conftest import REDIS_URL, require_service, wait_until

#: Python's recursion limit as the tests found it: the decoders' room to spare is given
#: back once they are done.
limit_before_test = sys.getrecursionlimit()
TAGGED = {"body": "", "properties": {"delivery_tag": "t1", "body_encoding": "base64"}}
#: kombu's JSON nested deeper than any decoder here reads (each raises RecursionError).
TOO_DEEP = ('{"body": "", "properties": {"delivery_tag": "t2", "body_encoding": "base64"}, '
            '"headers": {"x": ' + "[" * 5000 + "]" * 5000 + "}}")


@pytest.mark.parametrize(("raw", "why"), [
    (b"", "an empty entry"),
    (b"garbage{", "not JSON"),
    (b'{"properties": {"delivery_tag": "\xff"}}', "not JSON"),     # not UTF-8
    (b"[1, 2]", "JSON list, not kombu's message object"),
    (b'{"properties": {"delivery_tag": "t", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}}",
     "JSON nested too deeply to read"),
    (b'{"body": "e30="}', "no properties object"),
    (b'{"properties": {}}', "no delivery tag"),
    (json.dumps({**TAGGED, "headers": [1]}).encode(), "headers are not an object"),
    (json.dumps({**TAGGED, "body": 5}).encode(), "body is JSON int, not a string"),
    (json.dumps({**TAGGED, "body": "abc"}).encode(), "body is not base64"),
    (json.dumps({**TAGGED, "body": "w6k\u00e9"}).encode(), "body is not base64"),  # not ASCII
    (json.dumps({**TAGGED, "properties": {"delivery_tag": "t", "body_encoding": "rot13"}}
                ).encode(), "unknown body_encoding 'rot13'"),
    (json.dumps({**TAGGED, "headers": {"x": {"__type__": "bytes", "__value__": 1}}}).encode(),
     "a value kombu cannot decode (AttributeError"),
    (json.dumps({**TAGGED, "headers": {"x": {"__type__": "decimal", "__value__": "x"}}}
                ).encode(), "a value kombu cannot decode (InvalidOperation"),
])
def test_each_kind_of_unreadable_entry_is_named(raw, why):
    message, reason = unreadable.read(raw, tagged=True)
    assert message is None and reason.startswith(why)


def test_kombus_own_messages_are_readable():
    assert unreadable.read(json.dumps(TAGGED), tagged=True)[0] == TAGGED
    assert unreadable.read('{"properties": {}}', tagged=False)[0] == {"properties": {}}


def test_the_envelope_is_a_readable_message_carrying_the_entry_as_it_was():
    raw = b"\xff\x00not a message{"
    message, why = unreadable.read(unreadable.envelope(raw, "not JSON", "q"), tagged=True)
    assert why is None and unreadable.body(message) == raw
    assert message["headers"][DEAD_REASON_HEADER] == "unreadable: not JSON"
    assert message["headers"][DEAD_QUEUE_HEADER] == "q"
    assert unreadable.is_envelope(message["headers"])
    assert message["properties"]["delivery_info"]["routing_key"] == "q.dead"


# ---------------------------------------------------------------------------- Redis
@pytest.fixture
def redis_queue():
    require_service("Redis", 6379)
    queue = f"t-{uuid.uuid4().hex[:10]}"
    yield queue
    redis.Redis.from_url(REDIS_URL).delete(queue, queue + ".dead")


def _taking(conn: Connection, queue: str) -> tuple[object, list]:
    """A channel consuming ``queue`` as the worker does (Channel.take), and what it got."""
    channel = conn.channel()
    got: list = []
    Consumer(channel, [ensure_queue(conn, queue)], on_message=got.append,
             no_ack=False).consume()
    return channel, got


def _dead_envelopes(server: redis.Redis, queue: str) -> list[dict]:
    return [json.loads(e) for e in reversed(server.lrange(queue + ".dead", 0, -1))]


@pytest.mark.parametrize(("raw", "why"), [
    (b"\xff raw", "unreadable: not JSON"),
    (TOO_DEEP.encode(), "unreadable: JSON nested too deeply to read"),
])
def test_redis_take_replaces_a_raw_entry_by_its_envelope_and_goes_on(redis_queue, raw, why):
    server = redis.Redis.from_url(REDIS_URL)
    server.lpush(redis_queue, raw)
    with Connection(REDIS_URL, transport=REDIS_TRANSPORT) as conn:
        Producer(conn).publish({"n": 1}, exchange="", routing_key=redis_queue)
        channel, got = _taking(conn, redis_queue)
        wait_until(lambda: channel.take() and got, 5, "the message behind it to be taken")
        assert got[0].payload == {"n": 1}
        got[0].ack()
    [envelope] = _dead_envelopes(server, redis_queue)
    assert base64.b64decode(envelope["body"]) == raw
    assert envelope["headers"][DEAD_REASON_HEADER].startswith(why)
    assert server.llen(redis_queue) == 0


@pytest.mark.parametrize("raw", [
    b"\xff raw", TOO_DEEP.encode(), b"[1, 2]",
    json.dumps({**TAGGED, "headers": {"x": {"__type__": "decimal", "__value__": "x"}}}).encode(),
])
def test_redis_backlog_reads_a_queue_whose_next_entry_is_unreadable(redis_queue, raw):
    """Its length is known, its age is not (the autoscaler bounds it); before, a typed
    value that does not decode raised, and the backlog thread read nothing."""
    redis.Redis.from_url(REDIS_URL).lpush(redis_queue, raw)
    with Connection(REDIS_URL, transport=REDIS_TRANSPORT) as conn:
        channel = conn.channel()
        ensure_queue(conn, redis_queue)(channel).declare()
        backlog = channel.backlog(redis_queue)
    assert (backlog.ready, backlog.oldest_sent) == (1, None)


def test_redis_leaves_an_unreadable_entry_alone_once_it_is_no_longer_next(redis_queue):
    """The envelope replaces the entry only if it is still next in its list (another
    worker may have dead-lettered it meanwhile, and the next may be a message)."""
    server = redis.Redis.from_url(REDIS_URL)
    server.lpush(redis_queue, b"next")
    assert _BURY_NEXT(server, (redis_queue, redis_queue + ".dead"),
                      (b"other", b"envelope")) == 0
    assert server.lrange(redis_queue, 0, -1) == [b"next"]
    assert server.llen(redis_queue + ".dead") == 0


@pytest.mark.parametrize(("body", "headers", "why"), [
    ("abc", {}, "body is not base64"),
    # kombu's typed values, whose decoders raise what no JSON error is (a take raised it)
    ("", {"x": {"__type__": "bytes", "__value__": 1}}, "a value kombu cannot decode"),
    ("", {"x": {"__type__": "decimal", "__value__": "x"}}, "a value kombu cannot decode"),
])
def test_redis_replaces_a_taken_message_python_cannot_read_by_its_envelope(
        redis_queue, body, headers, why):
    """Lua's JSON reads it (a delivery tag), Python's does not: its lease, unacked entry
    and delivery count go, its envelope goes to the dead list."""
    server = redis.Redis.from_url(REDIS_URL)
    raw = json.dumps({"body": body, "headers": headers,
                      "properties": {"delivery_tag": "bad-tag", "body_encoding": "base64"}})
    server.lpush(redis_queue, raw)
    with Connection(REDIS_URL, transport=REDIS_TRANSPORT) as conn:
        channel, got = _taking(conn, redis_queue)
        assert channel.take()           # taken, and dead-lettered at once
        assert got == [] and not channel.take()
    assert server.zscore("unacked_index", "bad-tag") is None
    assert not server.hexists("unacked", "bad-tag")
    assert not server.hexists("delivery_counts", "bad-tag")
    [envelope] = _dead_envelopes(server, redis_queue)
    assert base64.b64decode(envelope["body"]).decode() == raw
    assert envelope["headers"][DEAD_REASON_HEADER].startswith(f"unreadable: {why}")


# ---------------------------------------------------------------------------- SQLite
@pytest.mark.parametrize(("raw", "why"), [
    ("garbage{", "unreadable: not JSON"),
    (TOO_DEEP, "unreadable: JSON nested too deeply to read"),
    (json.dumps({**TAGGED, "headers": {"x": {"__type__": "bytes", "__value__": 1}}}),
     "unreadable: a value kombu cannot decode"),
])
def test_sqlite_replaces_an_unreadable_row_by_its_envelope_and_goes_on(tmp_path: Path, raw,
                                                                       why):
    url = f"sqlite:///{tmp_path / 'broker.sqlite3'}"
    store = Store(tmp_path / "broker.sqlite3")
    store.put("q", raw)
    with Connection(url) as conn:
        queue = conn.SimpleQueue("q")
        queue.put({"n": 1})
        message = queue.get(timeout=5)
        assert message.payload == {"n": 1}
        message.ack()
    [(_, payload, deliveries, leased)] = store.browse("q.dead")
    assert deliveries == 0 and not leased
    envelope = json.loads(payload)
    assert base64.b64decode(envelope["body"]) == raw.encode()
    assert envelope["headers"][DEAD_REASON_HEADER].startswith(why)
    assert store.browse("q") == []


def test_sqlite_bury_changes_nothing_once_the_lease_is_lost(tmp_path: Path):
    store = Store(tmp_path / "broker.sqlite3")
    store.put("q", "garbage{")
    ident, token, _, _ = store.lease("q", visibility_timeout=0.01)
    # The lease expires and another consumer takes the row.
    wait_until(lambda: store.lease("q", 60), 5, "the lease to expire")
    assert not store.bury((ident, token), "q.dead", "envelope")
    assert store.browse("q.dead") == [] and len(store.browse("q")) == 1


@pytest.mark.parametrize("raw", [
    b'{"properties": {"delivery_tag": "t"}, "headers": {"task": "a", "retries": 0}}',
    # kombu's typed values, plainly and with the key spelled by escapes
    b'{"properties": {}, "headers": {"eta": {"__type__": "datetime", '
    b'"__value__": "2020-01-01T00:00:00"}}}',
    b'{"properties": {}, "headers": {"eta": {"\\u005f_type__": "datetime", '
    b'"__value__": "2020-01-01T00:00:00"}}}',
    '{"properties": {}, "headers": {"k": "caf\\u00e9 \u00e9"}}',
    b'{"properties": {}, "headers": {"k": "\xc3\xa9"}}',
    b'{"properties": {}, "headers": {"k": "a \\"quoted\\" line\\n\\\\"}}',   # escapes, no \\u
    # what msgspec's decoder refuses, or might read otherwise: the standard one reads it
    b'{"properties": {}, "headers": {"n": NaN, "i": Infinity, "m": -Infinity}}',
    b'{"properties": {}, "headers": {"big": 1e400, "tiny": 1e-400}}',
    b'{"properties": {}, "headers": {"u64": 18446744073709551616, '
    b'"i64": -9223372036854775809, "huge": 123456789012345678901234567890}}',
    b'{"properties": {}, "headers": {"k": 1, "k": 2.0}}',
    b'{"properties": {}, "headers": {"k": "\\ud800"}}',
    b'{"properties": {}, "headers": {"deep": ' + b"[" * 500 + b"]" * 500 + b"}}",
    bytearray(b'{"properties": {}, "headers": {"k": [1, 2.5, true, null]}}'),
    memoryview(b'{"properties": {}, "headers": {"k": {"__type__": "datetime", '
               b'"__value__": "2020-01-01T00:00:00"}}}'),
    '{"properties": {}, "headers": {"k": "lone \ud800 surrogate"}}',
    type("Payload", (bytes,), {})(b'{"properties": {}, "headers": {"k": 1}}'),
])
def test_entries_decode_as_kombu_decodes_them(raw):
    """The fast path (msgspec's decoder, or the standard one where it refuses) gives what
    kombu's decoder gives: the same values of the same types (``repr``: 1 is not 1.0, and
    NaN is not equal to itself)."""
    from kombu.utils.json import loads

    from workhorse.transport.unreadable import _loads
    assert repr(_loads(raw)) == repr(loads(raw if isinstance(raw, str | bytes) else bytes(raw)))


def test_random_json_decodes_as_kombu_decodes_it_or_fails_as_it_does():
    """Many generated documents (integers past 64 bits, floats of every size, text in
    every plane, control characters, some with bytes changed at random): the fast path
    reads each to what kombu's decoder reads, and fails where it fails."""
    import random
    import struct

    from kombu.utils.json import loads

    from workhorse.transport.unreadable import _loads
    rand = random.Random(31)

    def value(depth: int = 0) -> object:
        kind = rand.randrange(9 if depth < 4 else 6)
        if kind == 0:
            return rand.randrange(-2**70, 2**70) >> rand.randrange(70)
        if kind == 1:
            return struct.unpack("d", rand.randbytes(8))[0]     # NaN and inf among them
        if kind == 2:
            return rand.random() * 10.0 ** rand.randrange(-320, 308)
        if kind == 3:
            return "".join(chr(rand.choice([rand.randrange(0, 127), rand.randrange(0x80, 0xd800),
                                            rand.randrange(0x10000, 0x110000)]))
                           for _ in range(rand.randrange(8)))
        if kind == 4:
            return rand.choice([None, True, False, -0.0, 0])
        if kind == 5:
            return rand.randrange(-10, 10)
        if kind in (6, 7):
            return [value(depth + 1) for _ in range(rand.randrange(4))]
        return {str(rand.randrange(100)) + rand.choice(["", "é", "\u2028"]): value(depth + 1)
                for _ in range(rand.randrange(4))}

    failed = 0
    for _ in range(3000):
        raw = json.dumps({"properties": {}, "headers": {"v": value()}},
                         ensure_ascii=rand.random() < 0.5).encode()
        if rand.random() < 0.3:
            changed = bytearray(raw)
            changed[rand.randrange(len(changed))] = rand.randrange(256)
            raw = bytes(changed)
        try:
            expected = repr(loads(raw))
        except ValueError:
            failed += 1
            with pytest.raises(ValueError):
                _loads(raw)
            continue
        assert repr(_loads(raw)) == expected, raw
    assert 100 < failed < 2000        # (both kinds were tried)



# ------------------------------------------------------- decoded again from a deeper stack
def _deep(depth: int, queue: str = "q") -> str:
    return json.dumps({"body": "", "content-type": "application/json",
                       "content-encoding": "utf-8", "headers": {"x": 0},
                       "properties": {"delivery_tag": uuid.uuid4().hex,
                                      "body_encoding": "base64",
                                      "delivery_info": {"exchange": "",
                                                        "routing_key": queue}}}
                      ).replace('{"x": 0}', '{"x": ' + "[" * depth + "]" * depth + "}")


def _below(frames: int, call: Callable[[], object]) -> object:
    """``call()`` from ``frames`` more frames down the stack."""
    return call() if frames <= 0 else _below(frames - 1, call)


def _deepest_read(frames: int) -> int:
    """The deepest entry ``unreadable.read`` reads from ``frames`` below here."""
    low, high = 1, 5000
    while low < high:
        mid = (low + high + 1) // 2
        message, _ = _below(frames, partial(unreadable.read, _deep(mid), tagged=True))
        low, high = (mid, high) if message is not None else (low, mid - 1)
    return low


def test_redis_puts_back_an_entry_the_take_just_read_from_a_deeper_stack(redis_queue):
    """An entry nested about as deep as the take reads, put back (and by kombu's sweep)
    from further down the stack, is decoded and encoded again there with room to spare:
    before, that raised RecursionError, and a sweep stopped at it."""
    server = redis.Redis.from_url(REDIS_URL)
    depth = _deepest_read(60)
    server.lpush(redis_queue, _deep(depth, redis_queue))
    with Connection(REDIS_URL, transport=REDIS_TRANSPORT) as conn:
        channel, got = _taking(conn, redis_queue)
        assert channel.take() and len(got) == 1, depth      # the take reads it
        tag = got[0].delivery_tag
        try:
            _below(150, lambda: channel.qos.restore_by_tag(tag))
            assert server.llen(redis_queue) == 1
            assert not server.hexists("unacked", tag)
            assert sys.getrecursionlimit() == limit_before_test
        finally:    # (left held, kombu's sweep in the next tests would find it)
            server.delete(redis_queue)
            server.hdel("unacked", tag)
            server.zrem("unacked_index", tag)
            server.hdel("delivery_counts", tag)
            server.hdel("lease_owners", tag)



def test_sqlite_recovers_an_entry_the_take_just_read_from_a_deeper_stack(tmp_path: Path):
    """A worker that is gone held it: its recovery decodes it again (to count the held
    loss) and encodes it, from further down the stack, with room to spare: before, the
    decoder's RecursionError left it uncounted."""
    url = f"sqlite:///{tmp_path / 'broker.sqlite3'}"
    store = Store(tmp_path / "broker.sqlite3")
    store.put("q", _deep(_deepest_read(60)))
    with Connection(url) as conn:
        queue = conn.SimpleQueue("q")
        message = queue.get(timeout=5)          # the take reads it
        channel = message.channel
        prefix = channel.store.prefix
        recovered = _below(150, lambda: channel.recover(
            [prefix], lambda tag: Verdict(started=False, held_loss=True)))
        assert recovered == 1
        assert sys.getrecursionlimit() == limit_before_test
    [(_, payload, _, leased)] = store.browse("q")
    assert not leased
    assert unreadable.read(payload, tagged=False)[0]["headers"][HELD_LOSSES_HEADER] == 1
