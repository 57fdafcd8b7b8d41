"""The delivery count read from a message: what a copy carries, plus what its broker
counted (SQLite and Redis at take time; RabbitMQ's redelivery marks, by server version)."""
from __future__ import annotations

import pytest

from workhorse.broker.counting import RabbitMQ, earlier_deliveries, parse_version
from workhorse.protocol import DELIVERIES_HEADER


@pytest.mark.parametrize("text, expected", [
    ("3.10.8", (3, 10, 8)), (b"4.3.0", (4, 3, 0)), ("4.0.0-rc.2", (4, 0, 0)),
    ("", None), (None, None), ("unknown", None),
])
def test_the_server_version_is_read(text, expected):
    assert parse_version(text) == expected


@pytest.mark.parametrize("headers, info, expected", [
    ({}, {"delivery_count": 1}, 0),                            # first take
    ({}, {"delivery_count": 3}, 2),                            # taken twice before, both lost
    ({DELIVERIES_HEADER: 2}, {"delivery_count": 1}, 2),        # a copy carrying its count
    ({DELIVERIES_HEADER: 2}, {"delivery_count": 2}, 3),
    ({DELIVERIES_HEADER: "2"}, {"delivery_count": 1}, 0),      # not a count: parse_request says
    ({}, {}, 0),                                               # a broker that counts nothing
])
def test_sqlite_and_redis_count_at_take_time(headers, info, expected):
    assert earlier_deliveries(headers, info, None) == expected


@pytest.mark.parametrize("version, headers, info, expected", [
    ((3, 10, 8), {}, {"redelivered": False}, 0),
    ((3, 10, 8), {}, {"redelivered": True}, 1),                # classic queue: the flag only
    ((3, 10, 8), {"x-delivery-count": 3}, {"redelivered": True}, 3),   # quorum, 3.x
    ((3, 10, 8), {"x-delivery-count": 0}, {"redelivered": False}, 0),
    ((3, 10, 8), {"x-delivery-count": 3, DELIVERIES_HEADER: 2}, {"redelivered": True}, 5),
    ((4, 3, 0), {"x-delivery-count": 3}, {"redelivered": True}, 1),    # 4.x: the flag only
    ((4, 0, 1), {"x-delivery-count": 0}, {"redelivered": True}, 1),
    (None, {"x-delivery-count": 3}, {"redelivered": True}, 1),         # unknown: the flag
    ((3, 10, 8), {DELIVERIES_HEADER: 1}, {"redelivered": False, "delivery_count": 5}, 1),
])
def test_rabbitmq_counts_from_its_redelivery_marks(version, headers, info, expected):
    assert earlier_deliveries(headers, info, RabbitMQ(version)) == expected
