"""No duplicates, no losses (docs/delivery.md "Duplicates and losses"): leases renewed while
a live worker holds a message, ETA messages held past the visibility timeout, a
supervisor killed outright, the scheduled bound, RabbitMQ's consumer_timeout, and acks
that touch only their own lease."""
from __future__ import annotations

import time
import uuid

import pytest
import redis
from kombu import Connection, Consumer, Producer

from workhorse.broker.queues import ensure_queue
from workhorse.transport import REDIS as REDIS_TRANSPORT

from .conftest import REDIS_URL, require_service, runs, wait_until
from .test_delivery import holds, starts
from .test_unreadable import _taking

pytestmark = pytest.mark.timeout(180)

#: A short visibility timeout, so "three times longer" stays quick.
VT = 2.0


def test_a_task_three_times_longer_than_the_visibility_timeout_runs_once(
        broker, client, start_worker, tmp_path):
    from tests.apps.basic import record
    start_worker(broker, visibility_timeout=VT, concurrency=2)
    result = record.delay(3 * VT)
    assert result.get(timeout=60) == result.id
    holds(lambda: starts(tmp_path, result.id) == 1, VT * 1.5, "one start only")
    assert broker.queue_size() == 0


def test_an_eta_three_times_the_visibility_timeout_runs_once(broker, client, start_worker,
                                                              tmp_path):
    from tests.apps.basic import record
    start_worker(broker, visibility_timeout=VT, concurrency=2)
    sent = time.monotonic()
    result = record.apply_async(countdown=3 * VT)
    assert result.get(timeout=60) == result.id
    assert time.monotonic() - sent >= 3 * VT
    holds(lambda: starts(tmp_path, result.id) == 1, VT * 1.5, "one start only")
    assert broker.queue_size() == 0


def test_a_killed_supervisors_held_messages_run_within_the_lease_time_of_a_new_worker(
        broker, client, start_worker, tmp_path):
    """SIGKILL with 8 held: a fresh worker runs all 8 within visibility_timeout + a few
    seconds; only the task that was running at the kill may run twice."""
    from tests.apps.basic import record
    vt = 4.0
    first = start_worker(broker, visibility_timeout=vt, concurrency=1, prefetch_multiplier=8)
    results = [record.delay(0.5) for _ in range(8)]
    wait_until(lambda: len(runs(tmp_path)) >= 1, 20, "the first task to start")
    wait_until(lambda: broker.queue_size() == 0, 20, "all 8 taken by the worker")
    first.kill()
    killed_at = time.monotonic()
    start_worker(broker, visibility_timeout=vt, concurrency=2)
    for result in results:
        assert result.get(timeout=60) == result.id
    took = time.monotonic() - killed_at
    # Lease time, the new worker's start-up, and 8 × 0.5 s of work on two children.
    assert took < vt + 12, f"held messages came back after {took:.1f} s"
    counts = sorted(starts(tmp_path, r.id) for r in results)
    assert counts[0] >= 1 and counts[-2] == 1 and counts[-1] <= 2, counts


def test_scheduled_messages_beyond_max_scheduled_go_back_and_still_run_once(
        broker, client, start_worker, tmp_path):
    from tests.apps.basic import record
    worker = start_worker(broker, max_scheduled=2, concurrency=2)
    results = [record.apply_async(countdown=2) for _ in range(4)]
    for result in results:
        assert result.get(timeout=60) == result.id
    assert "max_scheduled" in worker.log()
    holds(lambda: all(starts(tmp_path, r.id) == 1 for r in results), 1.0, "one start each")


@pytest.mark.parametrize("broker", ["amqp"], indirect=True)
def test_a_scheduled_message_is_handed_back_before_rabbitmqs_consumer_timeout(
        broker, client, start_worker, tmp_path):
    from tests.apps.basic import record
    worker = start_worker(broker, rabbitmq_consumer_timeout=2)
    result = record.apply_async(countdown=4)
    assert result.get(timeout=60) == result.id
    assert "before RabbitMQ's consumer_timeout" in worker.log()
    holds(lambda: starts(tmp_path, result.id) == 1, 1.0, "one start only")
    assert broker.queue_size() == 0


# ---------------------------------------------------------------- Redis: the delivery tag
def _publish(url: str, queue: str, transport: str | None) -> None:
    with Connection(url, transport=transport) as conn:
        ensure_queue(conn, queue)
        Producer(conn).publish({"n": 1}, exchange="", routing_key=queue, serializer="json")


def _redelivered_elsewhere(url: str, queue: str, transport: str | None):
    """A takes a message; its lease runs out (as if A stalled) and kombu's sweep puts it
    back; B takes it, under the same delivery tag. Returns (A's message, B's message, A's
    and B's connections)."""
    a_conn = Connection(url, transport=transport, transport_options={"visibility_timeout": 1})
    b_conn = Connection(url, transport=transport, transport_options={"visibility_timeout": 1})
    a_msg = ensure_queue(a_conn, queue)(a_conn.channel()).get(no_ack=False)
    server = redis.Redis.from_url(url)
    server.zadd("unacked_index", {a_msg.delivery_tag: time.time() - 60})
    b_channel = b_conn.channel()
    b_channel.qos.restore_visible(num=None, interval=1)
    b_msg = ensure_queue(b_conn, queue)(b_channel).get(no_ack=False)
    assert b_msg is not None and b_msg.delivery_tag == a_msg.delivery_tag
    return a_msg, b_msg, a_conn, b_conn


@pytest.fixture
def redis_queue():
    require_service("Redis", 6379)
    queue = f"t-{uuid.uuid4().hex[:10]}"
    yield queue
    with Connection(REDIS_URL) as conn:
        ensure_queue(conn, queue)(conn.default_channel).delete()


def test_a_late_ack_leaves_the_new_holders_copy_alone(redis_queue):
    _publish(REDIS_URL, redis_queue, REDIS_TRANSPORT)
    a_msg, b_msg, a_conn, b_conn = _redelivered_elsewhere(REDIS_URL, redis_queue,
                                                         REDIS_TRANSPORT)
    server = redis.Redis.from_url(REDIS_URL)
    tag = a_msg.delivery_tag
    try:
        assert a_msg.channel.renew([tag]) == [tag]       # A learns it lost the lease
        a_msg.ack()
        assert server.hexists("unacked", tag)            # B's copy is still accounted for
        assert server.zscore("unacked_index", tag) is not None
        assert b_msg.channel.renew([tag]) == []          # and B's lease is intact
        b_msg.ack()
        assert not server.hexists("unacked", tag)
        assert server.zscore("unacked_index", tag) is None
    finally:
        a_conn.release()
        b_conn.release()


def test_kombus_own_redis_ack_removes_the_other_copys_bookkeeping(redis_queue):
    """Why workhorse has its own Redis QoS: with kombu's, A's late ack deletes B's entry, so
    B's copy would never come back if B died. (If this starts failing, kombu fixed it.)"""
    _publish(REDIS_URL, redis_queue, None)
    a_msg, b_msg, a_conn, b_conn = _redelivered_elsewhere(REDIS_URL, redis_queue, None)
    server = redis.Redis.from_url(REDIS_URL)
    try:
        a_msg.ack()
        assert not server.hexists("unacked", b_msg.delivery_tag)
    finally:
        b_msg.ack()
        a_conn.release()
        b_conn.release()


def test_renewal_moves_only_existing_leases(redis_queue):
    _publish(REDIS_URL, redis_queue, REDIS_TRANSPORT)
    server = redis.Redis.from_url(REDIS_URL)
    with Connection(REDIS_URL, transport=REDIS_TRANSPORT) as conn:
        message = ensure_queue(conn, redis_queue)(conn.channel()).get(no_ack=False)
        tag = message.delivery_tag
        before = server.zscore("unacked_index", tag)
        wait_until(lambda: time.time() > before + 0.01, 1, "the clock to move")
        assert message.channel.renew([tag, "no-such-tag"]) == ["no-such-tag"]
        assert server.zscore("unacked_index", tag) > before
        assert server.zscore("unacked_index", "no-such-tag") is None
        message.ack()
        assert message.channel.renew([tag]) == [tag]
        assert server.zscore("unacked_index", tag) is None


def test_a_lease_is_known_by_its_score_until_it_is_acked(redis_queue):
    """What the supervisor reads before it starts a buffered message (``lease_set_at``):
    the score the sweep reads, moved by each renewal; nothing once acked."""
    _publish(REDIS_URL, redis_queue, REDIS_TRANSPORT)
    server = redis.Redis.from_url(REDIS_URL)
    with Connection(REDIS_URL, transport=REDIS_TRANSPORT) as conn:
        message = _take(conn, redis_queue)
        tag, channel = message.delivery_tag, message.channel
        assert channel.lease_set_at(tag) == server.zscore("unacked_index", tag)
        before = channel.lease_set_at(tag)
        wait_until(lambda: time.time() > before + 0.01, 1, "the clock to move")
        assert channel.renew([tag]) == []
        assert channel.lease_set_at(tag) == server.zscore("unacked_index", tag) > before
        message.ack()
        assert channel.lease_set_at(tag) is None


# ---------------------------------------------------------------- Redis: the delivery count
def _take(conn: Connection, queue: str):
    """Take one message the way the worker does (Channel.take, one Lua step)."""
    from kombu import Consumer
    channel = conn.channel()
    got: list = []
    consumer = Consumer(channel, [ensure_queue(conn, queue)], on_message=got.append,
                        no_ack=False)
    consumer.consume()
    wait_until(lambda: channel.take() and got, 5, "a message to be taken")
    return got[0]


def _count(server: redis.Redis, tag: str) -> int | None:
    value = server.hget("delivery_counts", tag)
    return None if value is None else int(value)


def test_a_take_counts_the_delivery_in_the_same_step_and_an_ack_removes_it(redis_queue):
    _publish(REDIS_URL, redis_queue, REDIS_TRANSPORT)
    server = redis.Redis.from_url(REDIS_URL)
    with Connection(REDIS_URL, transport=REDIS_TRANSPORT) as conn:
        message = _take(conn, redis_queue)
        tag = message.delivery_tag
        assert message.delivery_info["delivery_count"] == 1 and _count(server, tag) == 1
        assert message.payload == {"n": 1}
        message.ack()
        assert _count(server, tag) is None


def test_a_clean_requeue_takes_back_the_count_and_kombus_sweep_keeps_it(redis_queue):
    """reject(requeue=True) by a live worker is not a delivery that counts; a message the
    sweep puts back (its worker died) stays counted, under the tag kombu keeps."""
    _publish(REDIS_URL, redis_queue, REDIS_TRANSPORT)
    server = redis.Redis.from_url(REDIS_URL)
    with Connection(REDIS_URL, transport=REDIS_TRANSPORT,
                    transport_options={"visibility_timeout": 1}) as conn:
        first = _take(conn, redis_queue)
        tag = first.delivery_tag
        first.requeue()
        assert _count(server, tag) == 0
        second = _take(conn, redis_queue)
        assert second.delivery_tag == tag and second.delivery_info["delivery_count"] == 1
        server.zadd("unacked_index", {tag: time.time() - 60})     # as if its worker died
    with Connection(REDIS_URL, transport=REDIS_TRANSPORT,
                    transport_options={"visibility_timeout": 1}) as conn:
        conn.channel().qos.restore_visible(num=None, interval=1)
        assert _count(server, tag) == 1
        third = _take(conn, redis_queue)
        assert third.delivery_tag == tag and third.delivery_info["delivery_count"] == 2
        third.ack()
        assert _count(server, tag) is None


def test_forgetting_a_lost_lease_takes_back_its_count_from_the_new_holder(redis_queue):
    _publish(REDIS_URL, redis_queue, REDIS_TRANSPORT)
    server = redis.Redis.from_url(REDIS_URL)
    options = {"visibility_timeout": 1}
    a_conn = Connection(REDIS_URL, transport=REDIS_TRANSPORT, transport_options=options)
    b_conn = Connection(REDIS_URL, transport=REDIS_TRANSPORT, transport_options=options)
    try:
        lost = _take(a_conn, redis_queue)
        tag = lost.delivery_tag
        server.zadd("unacked_index", {tag: time.time() - 60})     # A stalled past its lease
        b_conn.channel().qos.restore_visible(num=None, interval=1)
        held = _take(b_conn, redis_queue)
        assert held.delivery_info["delivery_count"] == 2
        assert lost.channel.renew([tag]) == [tag]
        lost.channel.forget(tag)
        assert _count(server, tag) == 1
        assert server.zscore("unacked_index", tag) is not None    # B's lease untouched
        assert held.channel.renew([tag]) == []
        held.ack()
        assert _count(server, tag) is None
    finally:
        a_conn.release()
        b_conn.release()


def test_one_take_takes_up_to_its_limit_in_order_each_leased_and_counted(redis_queue):
    """The worker takes as many as it has room for in one Lua step: in queue order, each
    with its lease and delivery count, never more than the limit."""
    with Connection(REDIS_URL, transport=REDIS_TRANSPORT) as conn:
        ensure_queue(conn, redis_queue)
        producer = Producer(conn)
        for n in range(8):
            producer.publish({"n": n}, exchange="", routing_key=redis_queue,
                             serializer="json")
        server = redis.Redis.from_url(REDIS_URL)
        channel, got = _taking(conn, redis_queue)
        assert channel.take(5)
        assert [m.payload["n"] for m in got] == [0, 1, 2, 3, 4]
        assert server.llen(redis_queue) == 3
        for message in got:
            assert message.delivery_info["delivery_count"] == 1
            assert _count(server, message.delivery_tag) == 1
            assert server.zscore("unacked_index", message.delivery_tag) is not None
        assert channel.take(64) and [m.payload["n"] for m in got[5:]] == [5, 6, 7]
        assert not channel.take(64)
        for message in got:
            message.ack()


def test_takes_read_the_lists_by_priority_then_queue_turn_by_turn(redis_queue):
    """Each take reads the lists in kombu's BRPOP order, worked out once per order of the
    queues: priority 0 of every queue first, then the next step; the queue a take last
    took from goes to the back for the next take."""
    other = f"{redis_queue}-b"
    with Connection(REDIS_URL, transport=REDIS_TRANSPORT) as conn:
        ensure_queue(conn, redis_queue)
        ensure_queue(conn, other)
        producer = Producer(conn)
        for queue, name, priority in ((redis_queue, "a9", 9), (redis_queue, "a0", 0),
                                      (other, "b0", 0), (redis_queue, "a0 again", 0)):
            producer.publish({"n": name}, exchange="", routing_key=queue,
                             serializer="json", priority=priority)
        channel = conn.channel()
        got: list = []
        for queue in (redis_queue, other):
            Consumer(channel, [ensure_queue(conn, queue)], on_message=got.append,
                     no_ack=False).consume()
        order = []
        while channel.take(1):
            order.append(got[-1].payload["n"])
        assert order == ["a0", "b0", "a0 again", "a9"]
        for message in got:
            message.ack()
        redis.Redis.from_url(REDIS_URL).delete(other)


def test_acks_in_one_round_trip_remove_only_leases_still_ours(redis_queue, caplog):
    """``ack_many``: one script for all, and a lease lost meanwhile (the sweep gave the
    message to another holder) is left to that holder, said in the log."""
    with Connection(REDIS_URL, transport=REDIS_TRANSPORT) as conn:
        ensure_queue(conn, redis_queue)
        for n in range(3):
            Producer(conn).publish({"n": n}, exchange="", routing_key=redis_queue,
                                   serializer="json")
        server = redis.Redis.from_url(REDIS_URL)
        channel, got = _taking(conn, redis_queue)
        assert channel.take(3) and len(got) == 3
        tags = [m.delivery_tag for m in got]
        server.zadd("unacked_index", {tags[1]: 12345.0})     # now another holder's lease
        channel.qos.ack_many(tags)
        assert server.zscore("unacked_index", tags[0]) is None
        assert server.zscore("unacked_index", tags[2]) is None
        assert _count(server, tags[0]) is None and _count(server, tags[2]) is None
        assert server.zscore("unacked_index", tags[1]) == 12345.0
        assert server.hexists("unacked", tags[1]) and _count(server, tags[1]) == 1
        assert f"message {tags[1]}: lease lost before it was settled" in caplog.text
        server.zrem("unacked_index", tags[1])
        server.hdel("unacked", tags[1])
        server.hdel("delivery_counts", tags[1])


def test_a_script_the_server_forgot_is_sent_again(redis_queue):
    """Scripts run by SHA1; after a restart or SCRIPT FLUSH the server has none of them."""
    _publish(REDIS_URL, redis_queue, REDIS_TRANSPORT)
    server = redis.Redis.from_url(REDIS_URL)
    server.script_flush()
    with Connection(REDIS_URL, transport=REDIS_TRANSPORT) as conn:
        message = _take(conn, redis_queue)
        assert message.payload == {"n": 1}
        server.script_flush()
        message.ack()
        assert server.zscore("unacked_index", message.delivery_tag) is None


@pytest.mark.parametrize("foreign_visibility", [3600, 30])
def test_a_lease_another_kind_of_consumer_took_is_swept_only_after_celerys_timeout(
        redis_queue, foreign_visibility, caplog):
    """A Celery worker's BRPOP (kombu's own transport) counts no delivery and renews
    nothing: a workhorse sweep leaves its lease until celery_visibility_timeout, saying so,
    instead of running a live Celery worker's long task twice."""
    _publish(REDIS_URL, redis_queue, None)
    celery_like = Connection(REDIS_URL, transport_options={"visibility_timeout": 3600})
    ours = Connection(REDIS_URL, transport=REDIS_TRANSPORT, transport_options={
        "visibility_timeout": 1, "foreign_visibility_timeout": foreign_visibility})
    server = redis.Redis.from_url(REDIS_URL)
    try:
        held = ensure_queue(celery_like, redis_queue)(celery_like.channel()).get(no_ack=False)
        server.zadd("unacked_index", {held.delivery_tag: time.time() - 60})   # held 60 s
        channel = ours.channel()
        with caplog.at_level("WARNING", logger="workhorse.transport.redis"):
            channel.qos.restore_visible(num=None, interval=1)
        again = ensure_queue(ours, redis_queue)(channel).get(no_ack=False)
        if foreign_visibility == 3600:
            assert again is None and server.hexists("unacked", held.delivery_tag)
            assert "not a workhorse worker" in caplog.text
        else:                                   # past celery_visibility_timeout: put back
            assert again is not None and again.delivery_tag == held.delivery_tag
            again.ack()
    finally:
        held.ack()
        celery_like.release()
        ours.release()


def test_a_turns_acks_travel_with_its_next_take(redis_queue, caplog):
    """``take(limit, acks)``: the acks of a turn and the next messages in one script. Only
    leases still ours are removed; what was taken is leased and counted as by a take."""
    with Connection(REDIS_URL, transport=REDIS_TRANSPORT) as conn:
        ensure_queue(conn, redis_queue)
        for n in range(6):
            Producer(conn).publish({"n": n}, exchange="", routing_key=redis_queue,
                                   serializer="json")
        server = redis.Redis.from_url(REDIS_URL)
        channel, got = _taking(conn, redis_queue)
        assert channel.take(3) == 3
        tags = [m.delivery_tag for m in got]
        server.zadd("unacked_index", {tags[1]: 12345.0})     # now another holder's lease
        assert channel.take(2, acks=tags) == 2
        assert [m.payload["n"] for m in got[3:]] == [3, 4]
        for tag in (tags[0], tags[2]):
            assert server.zscore("unacked_index", tag) is None and _count(server, tag) is None
        assert server.zscore("unacked_index", tags[1]) == 12345.0
        assert f"message {tags[1]}: lease lost before it was settled" in caplog.text
        for message in got[3:]:
            assert message.delivery_info["delivery_count"] == 1
            assert server.zscore("unacked_index", message.delivery_tag) is not None
        assert channel.take(0, acks=[m.delivery_tag for m in got[3:]]) == 0   # acks alone
        assert server.llen(redis_queue) == 1
        assert all(server.zscore("unacked_index", m.delivery_tag) is None for m in got[3:])
        server.zrem("unacked_index", tags[1])
        server.hdel("unacked", tags[1])
        server.hdel("delivery_counts", tags[1])
