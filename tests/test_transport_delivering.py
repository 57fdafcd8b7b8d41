"""A take's messages handed to the consumer without kombu's detour
(``workhorse.transport.delivering``): the same Message as kombu's constructor makes, the
same QoS record, and kombu's path wherever the short one would differ."""
from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection, Consumer, Queue
from kombu.transport import virtual

import workhorse  # noqa: F401 - registers the sqlite:// transport
from workhorse.transport.delivering import _message
from workhorse.transport.store import Store

FIELDS = ("_raw", "errors", "delivery_tag", "content_type", "content_encoding",
          "delivery_info", "headers", "properties", "_decoded_cache", "_state", "accept",
          "body")


#: A Celery body, as kombu's JSON carries it.
BODY = base64.b64encode(b'[[1], {}, {}]').decode()


def raw(body: Any = BODY, encoding: Any = "base64",
        headers: Any = None, **extra: Any) -> dict[str, Any]:
    properties = {"delivery_tag": "7:abc", "delivery_info": {"exchange": "",
                                                              "routing_key": "q"},
                  "priority": 0}
    if encoding is not None:
        properties["body_encoding"] = encoding
    message = {"body": body, "content-type": "application/json",
               "content-encoding": "utf-8", "headers": headers or {"task": "t", "id": "1"},
               "properties": properties}
    message.update(extra)
    return message


@pytest.fixture
def connection(tmp_path: Path):
    with Connection(f"sqlite:///{tmp_path / 'broker.sqlite3'}") as conn:
        yield conn


CASES = {
    "base64": raw(),
    "utf-8 text": raw(json.dumps([[1], {}, {}]), "utf-8"),
    "text, no encoding": raw(json.dumps([[2], {}, {}]), None),
    "empty text": raw("", "base64"),
    "no body": raw(None, "base64"),
    "no headers": {**raw(), "headers": None},
    "no delivery info": raw(json.dumps([[1], {}, {}]), properties={"delivery_tag": "7:abc"}),
    "no content type": {k: v for k, v in raw().items() if k != "content-type"},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_same_message_as_kombus_constructor(connection, case):
    channel = connection.default_channel
    made = _message(CASES[case], channel)
    kombus = virtual.Message(CASES[case], channel=channel)
    assert type(made) is type(kombus)
    for field in FIELDS:
        assert getattr(made, field) == getattr(kombus, field), field
    assert made.channel is channel
    assert made.decode() == kombus.decode()


@pytest.mark.parametrize("message", [raw(headers={"compression": "application/x-gzip"}),
                                     raw(encoding="rot13")], ids=["compressed", "rot13"])
def test_what_kombu_does_more_for_is_left_to_kombu(connection, message):
    assert _message(message, connection.default_channel) is None


def consume(channel: Any, queue: str, got: list[Any]) -> Consumer:
    consumer = Consumer(channel, [Queue(queue)], on_message=got.append, no_ack=False,
                        accept=["json"])
    consumer.consume()
    return consumer


def test_a_take_delivers_to_the_consumer_with_the_qos_record(connection, tmp_path):
    channel = connection.channel()
    got: list[Any] = []
    consume(channel, "q", got)
    paths: list[str] = []
    kombus = connection.transport._deliver
    connection.transport._deliver = lambda *a: (paths.append("kombu"), kombus(*a))
    producer = connection.Producer()
    for n in range(3):
        producer.publish({"n": n}, routing_key="q", serializer="json")
    assert channel.take(limit=3) == 3
    assert paths == []      # the short path, every one
    assert [m.payload for m in got] == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert all(m.accept is not None for m in got)       # the consumer's, set by kombu's
    assert set(channel.qos._delivered) == {m.delivery_tag for m in got}
    assert [m.delivery_info["delivery_count"] for m in got] == [1, 1, 1]
    for message in got:
        message.ack()
    assert Store(tmp_path / "broker.sqlite3").browse("q") == []


def test_another_consumer_of_the_queue_on_the_connection_gets_it_as_kombu_says(connection):
    first, second = connection.channel(), connection.channel()
    mine: list[Any] = []
    theirs: list[Any] = []
    consume(first, "q", mine)
    consume(second, "q", theirs)    # kombu's callback for "q" is now theirs
    connection.Producer().publish({"n": 1}, routing_key="q", serializer="json")
    assert first.take(limit=1) == 1
    assert mine == [] and [m.payload for m in theirs] == [{"n": 1}]
    theirs[0].ack()


def test_a_cancelled_consumer_is_no_longer_delivered_to(connection):
    channel = connection.channel()
    got: list[Any] = []
    consumer = consume(channel, "q", got)
    consumer.cancel()
    assert channel._receivers == {}
    passed: list[Any] = []
    connection.transport._deliver = lambda message, queue: passed.append(queue)
    channel.deliver_taken(raw(), "q")
    assert passed == ["q"] and got == []
