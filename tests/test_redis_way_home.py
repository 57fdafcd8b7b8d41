"""A message taken from a Redis queue goes back to that queue, once, whatever its
delivery_info says (docs/delivery.md, "Redis: no message is ever only in transit"): the
take records the queue in the unacked entry. Before, a message whose producer (another
program) gave no routing key stopped kombu's sweep at it for good, one with null headers
or delivery_info was dropped by it, and one a topic exchange routed was put back into
every queue its routing key matched."""
from __future__ import annotations

import base64
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Iterator

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue

from workhorse.broker.queues import ensure_queue
from workhorse.protocol import (DEAD_AT_HEADER, DEAD_REASON_HEADER, HELD_LOSSES_HEADER,
                                Verdict, after_loss)
from workhorse.transport import REDIS as REDIS_TRANSPORT
from workhorse.transport.redis import NO_WAY_HOME, UNROUTED

from .conftest import REDIS_URL, require_service, wait_until
from .test_unreadable import _taking

pytestmark = pytest.mark.timeout(60)

UNROUTED_DEAD = UNROUTED + ".dead"
#: kombu's separator of a queue's name and its priority, in the names of its lists.
SEP = "\x06\x16"


@pytest.fixture
def server() -> Iterator[redis.Redis]:
    """Redis, and every key these tests leave: their queues and exchanges, and the lease
    bookkeeping of the tags they made (a lease left behind would be swept into the next
    tests' queues)."""
    require_service("Redis", 6379)
    client = redis.Redis.from_url(REDIS_URL)
    made: list[str] = []
    client.made = made      # type: ignore[attr-defined]
    yield client
    names = [name for name in made if name.startswith(("t-", "x-"))]  # queues, exchanges
    for tag in set(made) - set(names):
        for key in ("unacked", "delivery_counts", "lease_owners"):
            client.hdel(key, tag)
        client.zrem("unacked_index", tag)
    for raw, _ in _unrouted(client, made):
        client.lrem(UNROUTED_DEAD, 1, raw)
    for name in names:
        client.delete(name, *[f"{name}{SEP}{priority}" for priority in (3, 6, 9)],
                      *[f"_kombu.{kind}.{name}" for kind in ("binding", "binding_permanent")])


def _unrouted(server: redis.Redis, marks: Iterable[str]) -> list[tuple[bytes, dict]]:
    """The entries of unrouted.dead (raw, and read) that carry one of ``marks`` (these
    tests' tags), in them or in their envelope's body: another test's are not ours."""
    found = []
    for raw in server.lrange(UNROUTED_DEAD, 0, -1):
        entry = json.loads(raw)
        text = raw + base64.b64decode(entry.get("body") or "")
        if any(mark.encode() in text for mark in marks):
            found.append((raw, entry))
    return found


def _queue(server: redis.Redis) -> str:
    name = f"t-{uuid.uuid4().hex[:10]}"
    server.made.append(name)      # type: ignore[attr-defined]
    with Connection(REDIS_URL, transport=REDIS_TRANSPORT) as conn:
        ensure_queue(conn, name)
    return name


def _foreign(server: redis.Redis, queue: str, variant: str) -> str:
    """A task message as another program's producer might push it: kombu's layout, with
    its delivery_info or headers missing or null. Returns its delivery tag."""
    tag = str(uuid.uuid4())
    server.made.append(tag)      # type: ignore[attr-defined]
    properties: dict = {"delivery_tag": tag, "body_encoding": "base64", "priority": 0,
                        "delivery_mode": 2}
    headers: dict | None = {"task": "tests.apps.basic.record", "id": tag}
    if variant == "empty delivery_info":
        properties["delivery_info"] = {}
    elif variant == "null delivery_info":
        properties["delivery_info"] = None
    elif variant == "null headers":
        headers = None
    server.lpush(queue, json.dumps({
        "body": base64.b64encode(b'[[], {}, {}]').decode(), "content-encoding": "utf-8",
        "content-type": "application/json", "headers": headers, "properties": properties}))
    return tag


def _expire(server: redis.Redis, *tags: str) -> None:
    """As if the worker holding them died: their leases are long past."""
    server.zadd("unacked_index", {tag: time.time() - 600 for tag in tags})


def _sweep() -> None:
    """kombu's sweep of expired leases, as every consumer runs it."""
    with Connection(REDIS_URL, transport=REDIS_TRANSPORT,
                    transport_options={"visibility_timeout": 1}) as conn:
        conn.channel().qos.restore_visible(num=None, interval=1)


def _take_and_put_back(server: redis.Redis, conn: Connection, queue: str, how: str) -> str:
    """Take ``queue``'s next message as the worker does, then put it back: requeued, or
    swept once its lease is long past. Returns its tag."""
    channel, got = _taking(conn, queue)
    wait_until(lambda: channel.take() and got, 5, "a message to be taken")
    tag = got[0].delivery_tag
    server.made.append(tag)      # type: ignore[attr-defined]
    if how == "requeue":
        got[0].requeue()
    else:
        _expire(server, tag)
        _sweep()
    return tag


def _message(tag: str) -> dict:
    return {"body": "e30=", "content-encoding": "utf-8", "content-type": "application/json",
            "headers": {}, "properties": {"delivery_tag": tag, "body_encoding": "base64"}}


def _two_abandoned(server: redis.Redis, queue: str,
                   entry: Callable[[str], bytes | str]) -> tuple[str, str]:
    """Two leases of a worker that is gone, as its takes recorded them (counted, long
    expired): one whose unacked entry is ``entry(its tag)``, swept first (the sweep goes
    newest first), and an ordinary message of ``queue``. Returns their tags."""
    first, neighbour = str(uuid.uuid4()), str(uuid.uuid4())
    server.made += [first, neighbour]      # type: ignore[attr-defined]
    server.hset("unacked", mapping={first: entry(first),
                                    neighbour: json.dumps([_message(neighbour), "", queue])})
    server.hset("delivery_counts", mapping={first: 1, neighbour: 1})
    server.zadd("unacked_index", {first: time.time() - 600, neighbour: time.time() - 601})
    return first, neighbour


def _tags(server: redis.Redis, queue: str) -> list[str]:
    return [json.loads(entry)["properties"]["delivery_tag"]
            for entry in server.lrange(queue, 0, -1)]


@pytest.mark.parametrize("variant", [
    "no delivery_info", "empty delivery_info", "null delivery_info", "null headers"])
def test_a_message_with_no_routing_key_is_swept_back_to_its_queue_with_the_rest(
        server, variant):
    queue = _queue(server)
    odd = _foreign(server, queue, variant)
    with Connection(REDIS_URL, transport=REDIS_TRANSPORT) as conn:
        Producer(conn).publish({"n": 1}, exchange="", routing_key=queue, serializer="json")
        channel, got = _taking(conn, queue)
        wait_until(lambda: channel.take(limit=2) and len(got) == 2, 5, "both to be taken")
        neighbour = got[1].delivery_tag
        server.made.append(neighbour)      # type: ignore[attr-defined]
        assert [m.delivery_tag for m in got] == [odd, neighbour]
        _expire(server, odd, neighbour)
        _sweep()        # (from another connection: this one still thinks it holds them)
        assert sorted(_tags(server, queue)) == sorted([odd, neighbour])
        assert not server.hexists("unacked", odd) and not server.hexists("unacked", neighbour)
        assert _unrouted(server, [odd, neighbour]) == []
        # a put-back counts the delivery it had (kombu's sweep keeps it)
        assert int(server.hget("delivery_counts", odd)) == 1
        back = json.loads(next(e for e in server.lrange(queue, 0, -1) if odd.encode() in e))
        if isinstance(back["headers"], dict):
            assert back["headers"]["redelivered"] is True


@pytest.mark.parametrize("how", ["requeue", "sweep"])
def test_a_message_a_topic_exchange_routed_goes_back_only_to_its_own_queue(server, how):
    """kombu puts a message back by its exchange and routing key: a topic exchange routes
    that to every queue the key matches, each of which had its copy already."""
    first, second = _queue(server), _queue(server)
    exchange = Exchange(f"x-{uuid.uuid4().hex[:8]}", type="topic")
    server.made.append(exchange.name)      # type: ignore[attr-defined]
    with Connection(REDIS_URL, transport=REDIS_TRANSPORT) as conn:
        for name in (first, second):
            Queue(name, exchange, routing_key="jobs.#")(conn.default_channel).declare()
        Producer(conn).publish({"n": 1}, exchange=exchange, routing_key="jobs.one",
                               serializer="json")
        assert server.llen(first) == server.llen(second) == 1
        tag = _take_and_put_back(server, conn, first, how)
        assert (server.llen(first), server.llen(second)) == (1, 1)
        assert not server.hexists("unacked", tag)


def test_an_entry_with_no_way_home_goes_to_unrouted_dead_and_the_sweep_goes_on(
        server, caplog):
    """An entry written before takes recorded the queue, of a message with no routing key
    (or a Celery worker's, of a queue whose binding is gone): kombu raised on it at every
    sweep, and the entries behind it never came back."""
    queue = _queue(server)
    lost, neighbour = _two_abandoned(
        server, queue, lambda tag: json.dumps([_message(tag), "", ""]))
    with caplog.at_level(logging.ERROR, logger="workhorse.transport.redis"):
        _sweep()
    assert _tags(server, queue) == [neighbour]
    [(_, moved)] = _unrouted(server, [lost])
    assert moved["properties"]["delivery_tag"] == lost
    assert moved["headers"][DEAD_REASON_HEADER] == f"{UNROUTED}: {NO_WAY_HOME}"
    assert moved["headers"][DEAD_AT_HEADER]
    assert not server.hexists("unacked", lost) and not server.hexists("unacked", neighbour)
    assert f"message {lost}: put back, but it has no way home" in caplog.text


def test_a_dead_workers_message_with_null_headers_is_recovered_home_counted(server):
    queue = _queue(server)
    tag = _foreign(server, queue, "null headers")
    owner = f"owner-{uuid.uuid4().hex[:8]}"
    with Connection(REDIS_URL, transport=REDIS_TRANSPORT) as conn:
        channel, got = _taking(conn, queue)
        channel.lease_owner = owner
        wait_until(lambda: channel.take() and got, 5, "the message to be taken")
        with Connection(REDIS_URL, transport=REDIS_TRANSPORT) as other:
            recovered = other.channel().recover(
                [owner], lambda _: Verdict(started=False, held_loss=True))
        assert recovered == 1
        [back] = [json.loads(e) for e in server.lrange(queue, 0, -1)]
        assert back["properties"]["delivery_tag"] == tag
        assert back["headers"][HELD_LOSSES_HEADER] == 1


@pytest.mark.parametrize("headers", [None, [], ["not", "pairs"], "text"])
def test_the_headers_after_a_loss_are_a_mapping_whatever_came_in(headers):
    out = after_loss(headers, Verdict(started=True, held_loss=True))
    assert out[HELD_LOSSES_HEADER] == 1 and len(out) == 2


#: Entries no sweep can put back, each marked by its tag where the ``@`` is.
UNREADABLE_ENTRIES = {
    "not JSON": b"\xff not JSON @",
    "invalid UTF-8": b'[{"body": "\xff", "headers": {}, "properties": {"x": "@"}}, "", "q"]',
    "two items": b'[{"properties": {"x": "@"}}, ""]',
    "a list for the message": b'[[1, "@"], "", "q"]',
    "a number for the routing key": b'[{"properties": {"x": "@"}}, "", 5]',
    "an object": b'{"a": "@"}',
    "a kombu typed value that does not decode": (
        b'[{"properties": {"x": "@"}, "headers": {"h": {"__type__": "bytes", "__value__": 1}}},'
        b' "", "q"]'),
}


@pytest.mark.parametrize("raw", UNREADABLE_ENTRIES.values(), ids=UNREADABLE_ENTRIES.keys())
def test_an_unreadable_entry_goes_to_unrouted_dead_in_its_envelope_and_the_sweep_goes_on(
        server, raw):
    """Written by another program or by hand: kombu's sweep raised on it every time,
    and the entries behind it (swept after it: newest first) never came back."""
    queue = _queue(server)
    bad, neighbour = _two_abandoned(server, queue, lambda tag: raw.replace(b"@", tag.encode()))
    _sweep()
    assert _tags(server, queue) == [neighbour]
    [(_, envelope)] = _unrouted(server, [bad])
    assert base64.b64decode(envelope["body"]) == raw.replace(b"@", bad.encode())
    assert envelope["headers"][DEAD_REASON_HEADER].startswith("unreadable: ")
    assert not server.hexists("unacked", bad) and server.zscore("unacked_index", bad) is None


def test_a_dead_workers_unreadable_entry_is_recovered_into_its_envelope(server):
    tag, owner = str(uuid.uuid4()), f"owner-{uuid.uuid4().hex[:8]}"
    server.made.append(tag)      # type: ignore[attr-defined]
    raw = json.dumps([[1, tag], "", "q"]).encode()
    server.hset("unacked", tag, raw)
    server.hset("lease_owners", tag, owner)
    server.zadd("unacked_index", {tag: time.time()})
    with Connection(REDIS_URL, transport=REDIS_TRANSPORT) as conn:
        assert conn.channel().recover(
            [owner], lambda _: Verdict(started=True, held_loss=False)) == 1
    [(_, envelope)] = _unrouted(server, [tag])
    assert base64.b64decode(envelope["body"]) == raw
    assert not server.hexists("unacked", tag) and not server.hexists("lease_owners", tag)


@pytest.mark.parametrize("how", ["requeue", "sweep"])
def test_a_message_of_a_priority_goes_back_to_its_priority_list(server, how):
    """The take records the queue's name, its list's priority suffix cut off: the
    message goes back to the list of its own priority."""
    queue = _queue(server)
    with Connection(REDIS_URL, transport=REDIS_TRANSPORT) as conn:
        Producer(conn).publish({"n": 1}, exchange="", routing_key=queue, priority=9,
                               serializer="json")
        assert server.llen(f"{queue}{SEP}9") == 1
        _take_and_put_back(server, conn, queue, how)
        assert server.llen(f"{queue}{SEP}9") == 1
        assert [k for k in server.keys(f"{queue}*") if k != f"{queue}{SEP}9".encode()] == []


def test_a_message_kombu_delivered_itself_goes_back_by_its_routing_key(server):
    """Consumed through kombu's own delivery (its BRPOP, not the worker's take), a
    message's lease records its exchange and routing key, as kombu's does."""
    queue = _queue(server)
    with Connection(REDIS_URL, transport=REDIS_TRANSPORT) as conn:
        Producer(conn).publish({"n": 1}, exchange="", routing_key=queue, serializer="json")
        got: list = []
        Consumer(conn.channel(), [Queue(queue)], on_message=got.append, no_ack=False).consume()
        wait_until(lambda: conn.drain_events(timeout=1) or got, 10, "the message")
        server.made.append(got[0].delivery_tag)      # type: ignore[attr-defined]
        got[0].requeue()
        assert server.llen(queue) == 1
        assert _unrouted(server, [got[0].delivery_tag]) == []
