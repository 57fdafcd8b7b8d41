"""Protocol v2 messages: built as Celery lays them out, read back strictly."""
from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from workhorse.exceptions import MalformedMessage
from workhorse.protocol import DELIVERIES_HEADER, build_message, decode_body, parse_request

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
