"""Broker connection loss (docs/delivery.md "Duplicates and losses"): the worker keeps
running its tasks, reconnects with back-off, resumes consuming, and settles what finished
meanwhile without losing it or running it twice. Redis runs as the test's own server, so
it can be killed and restarted; RabbitMQ's connections are closed by rabbitmqctl."""
from __future__ import annotations

import shutil
import subprocess
import select
import threading
import uuid

import pytest
import redis

from .conftest import BrokerEnv, wait_until
from .test_delivery import starts

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def redis_broker(tmp_path, private_redis, monkeypatch):
    """The test app on a Redis broker the test can stop, kill and restart."""
    broker = BrokerEnv("redis", private_redis.url(), f"t-{uuid.uuid4().hex[:10]}")
    monkeypatch.setenv("WORKHORSE_BROKER_URL", broker.url)
    monkeypatch.setenv("WORKHORSE_RESULT_BACKEND", f"sqlite:///{tmp_path / 'results.sqlite3'}")
    monkeypatch.setenv("WORKHORSE_QUEUES", broker.queue)
    monkeypatch.setenv("WORKHORSE_STATE_DIR", str(tmp_path / "state"))
    from tests.apps import basic
    basic.app.configure()
    yield broker, basic
    basic.app.close()


def _all_ran_once(tmp_path, results, timeout: float = 60) -> None:
    for result in results:
        assert result.get(timeout=timeout) == result.id
    counts = {r.id: starts(tmp_path, r.id) for r in results}
    assert set(counts.values()) == {1}, counts


def test_killed_redis_connections_are_reconnected_and_consumption_resumes(
        tmp_path, start_worker, redis_broker, private_redis):
    broker, basic = redis_broker
    worker = start_worker(broker, concurrency=2)
    before = [basic.record.delay(1.0) for _ in range(4)]
    wait_until(lambda: len(list(tmp_path.glob("runs.log"))) == 1, 20, "tasks to start")
    killed = redis.Redis(port=private_redis.port).client_kill_filter(_type="normal")
    assert killed >= 1
    worker.wait_for_log("broker connection lost", 20)
    worker.wait_for_log("broker connection restored", 20)
    after = [basic.record.delay() for _ in range(4)]
    _all_ran_once(tmp_path, before + after)
    assert broker.queue_size() == 0


def test_a_redis_restart_mid_run_loses_nothing(tmp_path, start_worker, redis_broker,
                                               private_redis):
    """Redis is killed while tasks run and buffered ones wait, and comes back (from its
    append-only file) a few seconds later: every task completes, each once."""
    broker, basic = redis_broker
    worker = start_worker(broker, concurrency=2, prefetch_multiplier=4)
    before = [basic.record.delay(0.5) for _ in range(8)]
    wait_until(lambda: len(list(tmp_path.glob("runs.log"))) == 1, 20, "tasks to start")
    private_redis.kill()
    worker.wait_for_log("broker connection lost", 20)
    worker.wait_for_log(r"unreachable \(.*\); next try in", 20)
    private_redis.start()
    worker.wait_for_log("broker connection restored", 60)
    after = [basic.record.delay() for _ in range(4)]
    _all_ran_once(tmp_path, before + after, timeout=90)
    assert worker.proc.poll() is None
    assert broker.queue_size() == 0


def _close_rabbitmq_connections() -> None:
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("rabbitmqctl is not installed here: cannot close RabbitMQ connections")
    subprocess.run(["rabbitmqctl", "close_all_connections", "workhorse test"], check=True,
                   capture_output=True, timeout=60)


@pytest.mark.parametrize("broker", ["amqp", "quorum"], indirect=True)
def test_closed_rabbitmq_connections_are_reconnected_and_nothing_runs_twice(
        broker, client, start_worker, tmp_path):
    """RabbitMQ takes back what the closed connection held (running tasks included) and
    delivers it again: buffered copies run once, and running ones are acked without
    running again once their SUCCESS is stored."""
    from tests.apps.basic import record
    worker = start_worker(broker, concurrency=2, prefetch_multiplier=4)
    before = [record.delay(1.5) for _ in range(6)]
    wait_until(lambda: len(list(tmp_path.glob("runs.log"))) == 1, 20, "tasks to start")
    _close_rabbitmq_connections()
    worker.wait_for_log("broker connection lost", 20)
    worker.wait_for_log("broker connection restored", 30)
    after = [record.delay() for _ in range(4)]
    _all_ran_once(tmp_path, before + after)
    wait_until(lambda: broker.queue_size() == 0, 20, "the queue to drain")


# ---------------------------------------------------------------- the consumer on its own
@pytest.fixture
def consumer_on_private_redis(tmp_path, private_redis, monkeypatch):
    """A BrokerConsumer of the test app on the test's own Redis, and what it received."""
    from workhorse.broker.consumer import BrokerConsumer
    monkeypatch.setenv("WORKHORSE_BROKER_URL", private_redis.url())
    monkeypatch.setenv("WORKHORSE_STATE_DIR", str(tmp_path / "state"))
    from tests.apps import basic
    basic.app.configure()
    received, lost = [], []
    queue = f"t-{uuid.uuid4().hex[:10]}"
    consumer = BrokerConsumer(basic.app, [queue], lambda q, m: received.append(m), lost.append)
    yield consumer, received, lost, basic
    consumer.close()
    basic.app.close()


def _take_one(consumer, received):
    def got() -> bool:
        if not consumer.connected:
            consumer.connect(8, lambda: 8, retries=0)     # as the supervisor would
        consumer.tick()
        # Only the sockets that answered, as the broker thread's selector reports them: a
        # Redis waiter whose list is empty blocks until its wait times out.
        fds = list(consumer.fds())
        for fd in select.select(fds, [], [], 0.1)[0] if fds else ():
            consumer.on_readable(fd)
        return bool(received)
    wait_until(got, 20, "a message to be taken")
    return received.pop()


def test_dead_lettering_after_a_redis_restart_leaves_consumption_working(
        consumer_on_private_redis, private_redis):
    """A publish while Redis is down must not make kombu retry by reconnecting in place:
    that closed the consuming channel unseen, and the worker took nothing more, ever."""
    consumer, received, lost, basic = consumer_on_private_redis
    consumer.connect(8, lambda: 8)
    queue = consumer.queues[0]
    basic.app.send_task("tests.apps.basic.add", (1, 2), queue=queue)
    held = _take_one(consumer, received)
    private_redis.kill()
    back = threading.Timer(1.0, private_redis.start)     # while the publish would retry
    back.start()
    try:
        consumer.dead_letter(queue, held, "test", None, "w", acked=False)
    except Exception:  # noqa: BLE001 - the expected way: a lost connection
        assert lost and not consumer.connected
    back.join()
    basic.app.send_task("tests.apps.basic.add", (3, 4), queue=queue)
    assert _take_one(consumer, received).headers["task"] == "tests.apps.basic.add"
    held.ack()       # through its own, older channel: nothing left for kombu's exit hook


def test_a_connect_that_fails_half_way_keeps_nothing(consumer_on_private_redis,
                                                     private_redis):
    """Redis answers but refuses writes (a replica after a failover): connecting fails in
    the middle, and the next attempt must start afresh rather than think it is connected."""
    consumer, received, lost, basic = consumer_on_private_redis
    server = redis.Redis(port=private_redis.port)
    server.execute_command("REPLICAOF", "127.0.0.1", "1")     # read-only, never synced
    try:
        with pytest.raises(redis.exceptions.ReadOnlyError):
            consumer.connect(8, lambda: 8, retries=0)
        assert not consumer.connected
    finally:
        server.execute_command("REPLICAOF", "NO", "ONE")
    consumer.connect(8, lambda: 8, retries=0)
    assert consumer.connected and consumer.consuming
