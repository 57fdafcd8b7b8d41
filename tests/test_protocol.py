"""Protocol v2 messages: built as Celery lays them out, read back strictly; protocol v1
messages read as the v2 ones they stand for; what a malformed message still tells."""
from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from workhorse.exceptions import MalformedMessage
from workhorse.protocol import (
    DELIVERIES_HEADER,
    build_message,
    decode_body,
    malformed_request,
    parse_request,
    read_message,
    read_request,
    v1_to_v2,
)

NOW = datetime(2026, 11, 22, 8, 40, 1, 751593, tzinfo=UTC)


def test_message_has_every_celery_v2_header():
    msg = build_message("tasks.add", "77a6", [4, 5], {}, eta=NOW,
                        expires=NOW + timedelta(minutes=1), now=NOW)
    assert set(msg.headers) >= {
        "lang", "task", "id", "shadow", "eta", "expires", "group", "group_index", "retries",
        "timelimit", "root_id", "parent_id", "argsrepr", "kwargsrepr", "origin", "ignore_result",
        "replaced_task_nesting", "stamped_headers", "stamps"}
    assert msg.headers["eta"] == "2026-11-22T08:40:01.751593+00:00"
    assert msg.headers["root_id"] == "77a6"
    assert msg.headers["timelimit"] == [None, None]
    assert msg.properties == {"correlation_id": "77a6", "reply_to": "", "expiration": "60000"}
    assert msg.body == ([4, 5], {}, {"callbacks": None, "errbacks": None, "chain": None,
                                     "chord": None})


def test_timelimit_header_is_hard_then_soft():
    msg = build_message("t", "id", time_limit=10, soft_time_limit=5)
    assert msg.headers["timelimit"] == [10, 5]
    request = parse_request(msg.headers)
    assert (request.time_limit, request.soft_time_limit) == (10.0, 5.0)


def test_celery_sent_headers_parse():
    # Copied from a message Celery 5.7 stored in Redis (WIRE.md).
    headers = {"lang": "py", "task": "tasks.add", "id": "77a6c4f8-768a-4964-8707-75ea60b9532f",
               "shadow": None, "eta": "2026-11-22T08:41:01.751593+00:00",
               "expires": "2026-11-22T08:42:01.751593+00:00", "group": None, "group_index": None,
               "retries": 0, "timelimit": [None, None],
               "root_id": "77a6c4f8-768a-4964-8707-75ea60b9532f", "parent_id": None,
               "argsrepr": "(4, 5)", "kwargsrepr": "{}", "origin": "gen9934@vm",
               "ignore_result": False, "replaced_task_nesting": 0, "stamped_headers": None,
               "stamps": {}}
    request = parse_request(headers)
    assert request.task == "tasks.add"
    assert request.eta == datetime(2026, 11, 22, 8, 41, 1, 751593, tzinfo=UTC)
    assert request.deliveries == 0


def test_naive_eta_means_utc():
    request = parse_request({"task": "t", "id": "i", "eta": "2026-11-22T08:41:01"})
    assert request.eta is not None and request.eta.tzinfo == UTC


@pytest.mark.parametrize("headers, complaint", [
    (None, "no headers"),
    ({"id": "x"}, "'task'"),
    ({"task": "t"}, "'id'"),
    ({"task": "t", "id": "i", "eta": "tomorrow"}, "ISO-8601"),
    ({"task": "t", "id": "i", "retries": -1}, "retries"),
    ({"task": "t", "id": "i", "timelimit": [1]}, "timelimit"),
    ({"task": "t", "id": "i", "timelimit": ["x", None]}, "hard"),
    ({"task": "t", "id": "i", DELIVERIES_HEADER: "2"}, DELIVERIES_HEADER),
])
def test_malformed_headers_say_what_is_wrong(headers, complaint):
    with pytest.raises(MalformedMessage, match=complaint):
        parse_request(headers)


def test_body_round_trip():
    body = json.dumps([[1, 2], {"a": 3}, {"callbacks": None}])
    assert decode_body(body.encode(), "application/json", "utf-8") == (
        [1, 2], {"a": 3}, {"callbacks": None})


@pytest.mark.parametrize("body, content_type, complaint", [
    (b"not json", "application/json", "not valid"),
    (b'{"a": 1}', "application/json", "triple"),
    (b'[1, {}, {}]', "application/json", "args must be a list"),
    (b'[[], [], {}]', "application/json", "kwargs must be an object"),
    (b"\x80\x04K\x01.", "application/x-python-serialize", "not accepted"),
])
def test_malformed_bodies_say_what_is_wrong(body, content_type, complaint):
    with pytest.raises(MalformedMessage, match=complaint):
        decode_body(body, content_type, "binary")


# ---------------------------------------------------------------------- v1 and malformed
def v1(**fields) -> bytes:
    """A protocol v1 body as Celery 5.7's ``as_task_v1`` lays it out (Celery 3's layout)."""
    body = {"task": "tasks.add", "id": "v1-id", "args": [4, 5], "kwargs": {"z": 1},
            "group": None, "group_index": None, "retries": 0, "eta": None, "expires": None,
            "utc": True, "callbacks": None, "errbacks": None, "timelimit": [None, None],
            "taskset": None, "chord": None, **fields}
    return json.dumps(body).encode()


def test_a_v1_message_reads_as_the_v2_request_and_body_it_stands_for():
    callback = {"task": "tasks.mul", "args": [2], "kwargs": {}, "options": {},
                "subtask_type": None, "immutable": False}
    body = v1(eta="2026-11-22T08:41:01.751593+00:00", retries=2, timelimit=[10, 5],
              taskset="g-1", callbacks=[callback], errbacks=[callback], chord=callback)
    request, (args, kwargs, embed) = read_message({}, body, "application/json", "utf-8")
    assert (request.task, request.id, request.root_id) == ("tasks.add", "v1-id", "v1-id")
    assert (request.retries, request.group) == (2, "g-1")
    assert (request.time_limit, request.soft_time_limit) == (10.0, 5.0)
    assert request.eta == datetime(2026, 11, 22, 8, 41, 1, 751593, tzinfo=UTC)
    assert (args, kwargs) == ([4, 5], {"z": 1})
    assert embed == {"callbacks": [callback], "errbacks": [callback], "chain": None,
                     "chord": callback}
    assert read_request({}, body, "application/json", "utf-8") == request


def test_a_v1_message_keeps_its_own_headers_under_the_fields_of_its_body():
    headers = {DELIVERIES_HEADER: 2, "redelivered": True, "id": "stale"}
    request = read_request(headers, v1(), "application/json", "utf-8")
    assert (request.deliveries, request.id) == (2, "v1-id")
    assert request.headers["redelivered"] is True and request.headers["task"] == "tasks.add"


def test_naive_v1_times_are_utc_unless_the_body_says_utc_false():
    as_utc = read_request(None, v1(eta="2026-11-22T08:41:01"), "application/json", "utf-8")
    assert as_utc.eta == datetime(2026, 11, 22, 8, 41, 1, tzinfo=UTC)
    local = read_request(None, v1(eta="2026-11-22T08:41:01", utc=False), "application/json",
                         "utf-8")
    assert local.eta == datetime(2026, 11, 22, 8, 41, 1).astimezone()


def test_v1_to_v2_fills_the_headers_celery_v2_messages_have():
    headers, body = v1_to_v2(json.loads(v1()), {})
    assert set(headers) >= {"lang", "task", "id", "eta", "expires", "group", "group_index",
                            "retries", "timelimit", "root_id", "parent_id", "argsrepr",
                            "kwargsrepr", "origin"}
    assert headers["argsrepr"] == "(4, 5)" and body[0] == [4, 5]


def test_a_message_with_a_task_header_is_v2_even_if_its_body_looks_like_v1():
    with pytest.raises(MalformedMessage, match="triple"):
        read_message({"task": "tasks.add", "id": "x"}, v1(), "application/json", "utf-8")


@pytest.mark.parametrize("headers, body, content_type, complaint", [
    ({}, b"[[1], {}, {}]", "application/json", "no 'task' header"),
    (None, b'{"id": "x", "args": []}', "application/json", "no 'task' header"),
    ({}, b"not json", "application/json", "not valid"),
    ({}, b"\x80\x04K\x01.", "application/x-python-serialize", "not accepted"),
    ({}, v1(args="4, 5"), "application/json", "protocol v1 body.*args must be a list"),
    ({}, v1(id=None), "application/json", "protocol v1 body.*'id'"),
    ({}, v1(eta="tomorrow"), "application/json", "protocol v1 body.*ISO-8601"),
])
def test_malformed_v1_messages_say_what_is_wrong(headers, body, content_type, complaint):
    with pytest.raises(MalformedMessage, match=complaint):
        read_request(headers, body, content_type, "utf-8")


@pytest.mark.parametrize("headers, body, content_type, task_id, task", [
    # v2: the id comes from the headers, whatever the body holds
    ({"task": "tasks.add", "id": "i", "retries": -1}, b"[]", "application/json", "i",
     "tasks.add"),
    ({"task": "tasks.add", "id": "i"}, b"\x80\x04K\x01.", "application/x-python-serialize",
     "i", "tasks.add"),
    ({"task": ["no"], "id": "i"}, b"x", "application/json", "i", "?"),
    ({"task": "tasks.add"}, v1(), "application/json", None, None),     # v2 without an id
    ({"task": "tasks.add", "id": ""}, b"[]", "application/json", None, None),
    # no task header: an id header, else a v1 body's id
    ({"id": "h"}, b"[[], {}, {}]", "application/json", "h", "?"),
    ({}, v1(eta="tomorrow"), "application/json", "v1-id", "tasks.add"),
    (None, b'{"id": "x", "args": []}', "application/json", "x", "?"),
    ({}, b"[[], {}, {}]", "application/json", None, None),
    ({}, b"not json", "application/json", None, None),
    ({}, b"\x80\x04K\x01.", "application/x-python-serialize", None, None),
])
def test_a_malformed_message_gives_the_id_its_failure_is_stored_under(
        headers, body, content_type, task_id, task):
    seen = malformed_request(headers, body, content_type, "utf-8")
    if task_id is None:
        assert seen is None
    else:
        assert seen is not None and (seen.id, seen.task) == (task_id, task)
