"""Failover on a real 3-node RabbitMQ cluster (tests/rabbitmq_cluster.py starts its own
nodes, apart from the shared one): a Celery client sends tasks and countdown tasks to a
quorum queue, a workhorse worker with the cluster's failover URL drains it with late acks,
and mid-drain the node that leads the queue, or the node the worker is connected to, is
SIGKILLed. Every task completes; none is lost; a task runs twice only if it had started
before the kill; the worker goes on by itself.

By hand: ``CI=true pytest tests/test_rabbitmq_cluster.py -s`` (it prints its figures)."""
from __future__ import annotations

import re
import time
import uuid
from datetime import datetime, timedelta, UTC
from pathlib import Path

import pytest

from .conftest import IN_CI, REDIS_URL, BrokerEnv, require_service, runs, wait_until
from .rabbitmq_cluster import Cluster, available

pytestmark = [pytest.mark.timeout(600), pytest.mark.broker("amqp")]

RESULTS_URL = REDIS_URL.rsplit("/", 1)[0] + "/2"
TASKS = 150
COUNTDOWNS = 3
CONCURRENCY, MULTIPLIER = 2, 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    why = available()
    if why:
        if IN_CI:
            pytest.fail(f"{why}, and CI=true makes the cluster test mandatory")
        pytest.skip(f"{why}: the cluster test needs RabbitMQ's scripts and Erlang")
    cluster = Cluster(tmp_path_factory.mktemp("rabbitmq-cluster"))
    try:
        yield cluster.up()
    finally:
        cluster.down()


def send(cluster: Cluster, queue: str, exchange_type: str, declare_on: int):
    """A Celery client on the cluster's URL whose queue is a quorum queue, declared through
    node ``declare_on`` (which so leads it); TASKS tasks sent, confirmed by the broker."""
    celery = pytest.importorskip("celery")
    from kombu import Exchange, Queue
    app = celery.Celery("cluster", broker=cluster.url, backend=RESULTS_URL)
    app.conf.task_default_queue = queue
    app.conf.task_default_queue_type = "quorum"
    app.conf.broker_transport_options = {"confirm_publish": True}
    app.conf.task_queues = [Queue(queue, Exchange(queue, type=exchange_type),
                                  routing_key=queue, queue_arguments={"x-queue-type": "quorum"})]
    from kombu import Connection
    with Connection(cluster.nodes[declare_on].url) as connection:
        app.amqp.queues[queue](connection.default_channel).declare()
    results = [app.send_task("tests.apps.basic.record", (0.05,), queue=queue)
               for _ in range(TASKS)]
    return app, results


@pytest.mark.parametrize(("victim", "exchange_type"), [("leader", "direct"),
                                                        ("connected", "topic")])
def test_a_node_killed_mid_drain_loses_no_task(cluster, victim, exchange_type, start_worker,
                                               tmp_path: Path):
    require_service("Redis", 6379)
    cluster.heal()
    queue = f"qc-{uuid.uuid4().hex[:8]}"
    app, results = send(cluster, queue, exchange_type, declare_on=1)
    leader = cluster.leader(queue)
    assert leader is cluster.nodes[1], f"the queue's leader is {leader}, not node 1"
    worker = start_worker(BrokerEnv("quorum", cluster.url, queue), concurrency=CONCURRENCY,
                          prefetch_multiplier=MULTIPLIER, acks_late=True,
                          result_backend=RESULTS_URL)
    # Said as the worker gets ready, at times just after "ready:" is written.
    worker.wait_for_log(r"broker: connected to 127\.0\.0\.1:\d+")
    port = int(re.search(r"broker: connected to 127\.0\.0\.1:(\d+)", worker.log())[1])
    connected = cluster.connected_node(port)
    assert connected is cluster.nodes[0]        # the list's first URL, not the leader's
    # Countdown tasks: with a topic exchange they wait in Celery's delay levels (quorum
    # queues, replicated), with a direct one the worker holds them as ETA messages.
    sent_at = datetime.now(UTC)
    later = [app.send_task("tests.apps.basic.record", countdown=4, queue=queue)
             for _ in range(COUNTDOWNS)]
    wait_until(lambda: len(runs(tmp_path)) >= TASKS // 3, 120, "a third of the tasks to run")

    target = cluster.nodes[1] if victim == "leader" else connected
    started_before = {task_id for _, task_id, _ in runs(tmp_path)}
    killed_at = time.monotonic()
    cluster.kill(target)
    ran_then = len(runs(tmp_path))
    # More than the window ran since: some of them were delivered after the kill.
    wait_until(lambda: len(runs(tmp_path)) > ran_then + CONCURRENCY * MULTIPLIER, 120,
               "tasks delivered after the kill to run")
    resumed = time.monotonic() - killed_at

    ids = [r.id for r in results + later]
    for result in results + later:
        assert result.get(timeout=180) == result.id       # every task completed
    ran = [task_id for _, task_id, _ in runs(tmp_path)]
    assert set(ran) == set(ids), "a task never ran"
    twice = {task_id for task_id in ran if ran.count(task_id) > 1}
    # A task runs again only if it had started before the kill and its ack was not yet
    # committed by the queue (late acks): at most the window.
    assert twice <= started_before, twice - started_before
    assert len(twice) <= CONCURRENCY * MULTIPLIER
    for result in later:                                   # countdowns kept their time
        assert result.date_done >= sent_at + timedelta(seconds=3.9), result.date_done
    assert worker.proc.poll() is None
    log = worker.log()
    if victim == "connected":
        assert re.search(r"broker connection restored \(to 127\.0\.0\.1:\d+\)", log), log
    assert "Traceback" not in log
    new_leader = cluster.leader(queue)
    print(f"\ncluster failover, {victim} node killed ({exchange_type} exchange): "
          f"{len(ids)} tasks, 0 lost, {len(twice)} ran twice, a window and one "
          f"more ran {resumed:.2f} s after the kill; leader now {new_leader and new_leader.name}")
    app.close()
