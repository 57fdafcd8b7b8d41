"""RabbitMQ's quorum queues: the worker declares and consumes them (``queue_type =
quorum``), keeps its prefetch window exact on them (each consumer's own prefetch, as they
refuse a channel-wide one), and runs what a Celery 5.5+ client sends them, countdown tasks
included, through Celery's native delayed delivery or as plain ETA messages."""
from __future__ import annotations

import shutil
import signal
import subprocess
import threading
import time
import uuid

import pytest

from .conftest import REDIS_URL, make_broker, require_service, runs, wait_until

pytestmark = [pytest.mark.timeout(120), pytest.mark.broker("amqp")]

RESULTS_URL = REDIS_URL.rsplit("/", 1)[0] + "/1"


def unacked(queue: str) -> int | None:
    """The queue's unacknowledged messages as RabbitMQ counts them (rabbitmqctl)."""
    done = subprocess.run(["rabbitmqctl", "-q", "list_queues", "name",
                           "messages_unacknowledged"], capture_output=True, text=True,
                          timeout=30)
    for line in done.stdout.splitlines():
        name, _, count = line.partition("\t")
        if name == queue and count.strip().isdigit():
            return int(count)
    return None


@pytest.fixture
def backlog(tmp_path, monkeypatch):
    """A quorum queue on the local RabbitMQ and ``send(n, seconds)``, which puts ``n``
    record tasks of that many seconds on it; RabbitMQ's own count is read with rabbitmqctl."""
    if shutil.which("rabbitmqctl") is None:
        pytest.skip("rabbitmqctl is not installed: RabbitMQ's count cannot be read")
    from .conftest import basic_client
    broker = make_broker("quorum", tmp_path)
    basic = basic_client(monkeypatch, broker, "disabled", tmp_path)
    monkeypatch.setenv("WORKHORSE_QUEUE_TYPE", "quorum")

    def send(n: int, seconds: float) -> None:
        basic.app.configure()
        try:
            for _ in range(n):
                basic.record.delay(seconds)
        finally:
            basic.app.close()
    yield broker, send
    broker.cleanup()


@pytest.mark.parametrize("multiplier", [1, 3])
def test_the_window_is_exact_on_a_quorum_queue_during_a_drain(tmp_path, start_worker,
                                                             backlog, multiplier):
    """Late acks: RabbitMQ's own count of what the worker holds unacknowledged never passes
    concurrency × prefetch_multiplier while 100 tasks of 0.1 s drain."""
    broker, send = backlog
    send(100, 0.1)
    seen: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            count = unacked(broker.queue)
            if count is not None:
                seen.append(count)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start_worker(broker, concurrency=2, prefetch_multiplier=multiplier,
                 result_backend="disabled")
    wait_until(lambda: len(runs(tmp_path)) >= 100, 90, "100 tasks to run")
    stop.set()
    sampler.join(30)
    assert len(seen) >= 3, "too few samples of RabbitMQ's count"
    assert max(seen) <= 2 * multiplier, seen
    assert max(seen) == 2 * multiplier, "the window was never full: a weak test"


@pytest.fixture(params=["direct", "topic"])
def celery_quorum(request, tmp_path, start_worker):
    """A Celery 5.7 client whose queue is a quorum queue on an exchange of this kind, and a
    workhorse worker with queue_type = quorum consuming it."""
    require_service("Redis", 6379)
    celery = pytest.importorskip("celery")
    from kombu import Exchange, Queue
    broker = make_broker("quorum", tmp_path)
    app = celery.Celery("quorum", broker=broker.url, backend=RESULTS_URL)
    app.conf.task_default_queue = broker.queue
    app.conf.task_default_queue_type = "quorum"
    app.conf.task_queues = [Queue(broker.queue, Exchange(broker.queue, type=request.param),
                                  routing_key=broker.queue,
                                  queue_arguments={"x-queue-type": "quorum"})]
    with app.connection_for_write() as connection:     # as Celery's producers declare it
        app.amqp.queues[broker.queue](connection.default_channel).declare()
    worker = start_worker(broker, result_backend=RESULTS_URL)
    yield request.param, app, broker, worker
    app.close()
    broker.cleanup()
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        try:
            channel.exchange_delete(broker.queue)
        except Exception:  # noqa: BLE001 - cleanup is best effort
            pass


def test_a_celery_client_sends_tasks_and_countdowns_to_a_quorum_queue(celery_quorum):
    kind, app, broker, worker = celery_quorum
    now = app.send_task("tests.apps.basic.add", (2, 40), queue=broker.queue)
    assert now.get(timeout=30) == 42
    sent = time.monotonic()
    later = app.send_task("tests.apps.basic.context", countdown=2, queue=broker.queue)
    info = later.get(timeout=60)
    assert time.monotonic() - sent >= 1.9
    if kind == "topic":
        # Celery's native delayed delivery: through celery_delayed_27 and down the levels,
        # then celery_delayed_delivery, which the worker bound its queue to
        bits = info["routing_key"].split(".")
        assert len(bits) == 29 and set(bits[:28]) <= {"0", "1"}
        assert int("".join(bits[:28]), 2) == 2 and bits[28] == broker.queue
    else:
        # a direct exchange: Celery sends a plain ETA message, which the worker holds
        assert info["routing_key"] == broker.queue
    assert "is a quorum queue" not in worker.log()


def test_a_worker_declaring_classic_says_once_that_the_queue_is_quorum(tmp_path,
                                                                        start_worker):
    from kombu import Connection
    from workhorse.broker.queues import task_queue
    broker = make_broker("quorum", tmp_path)
    name = f"t-{uuid.uuid4().hex[:10]}"
    broker.queue = name
    try:
        with Connection(broker.url) as connection:
            task_queue(name, "quorum")(connection.default_channel).declare()
        worker = start_worker(broker, queue_type="classic")
        log = worker.wait_for_log(f"queue {name} is a quorum queue on RabbitMQ, not classic")
        assert log.count("is a quorum queue on RabbitMQ") == 1
        assert "Traceback" not in log
    finally:
        broker.cleanup()


def test_the_window_follows_the_pool_on_a_quorum_queue(tmp_path, start_worker, backlog):
    """RabbitMQ fixes a consumer's prefetch when it starts: after SIGTTOU shrinks the pool
    from 2 children to 1 (window 6 to 3), the consumers start again with the new share, so
    once RabbitMQ's unacknowledged count has come down to 3 it never passes 3 again."""
    broker, send = backlog
    send(100, 0.3)
    worker = start_worker(broker, concurrency=2, prefetch_multiplier=3,
                          result_backend="disabled")
    wait_until(lambda: unacked(broker.queue) == 6, 30, "the window of 6 to fill")
    worker.signal(signal.SIGTTOU)
    worker.wait_for_log(r"pool resized to 1 children, prefetch window 3")
    wait_until(lambda: (unacked(broker.queue) or 0) <= 3, 30, "the held to drain to 3")
    seen: list[int] = []
    until = len(runs(tmp_path)) + 15          # 4.5 s of one child
    deadline = time.monotonic() + 30
    while len(runs(tmp_path)) < until and time.monotonic() < deadline:
        count = unacked(broker.queue)
        if count is not None:
            seen.append(count)
    assert len(seen) >= 3 and max(seen) <= 3, seen
    assert max(seen) == 3, "the smaller window was never full: a weak test"


@pytest.mark.parametrize(("arguments", "warning"), [
    ({"x-delivery-limit": 5}, "has x-delivery-limit = 5 and no dead-letter exchange"),
    ({"x-delivery-limit": 5, "x-dead-letter-exchange": "parking"},
     r"has x-delivery-limit = 5, below workhorse's max_held_losses \(20\)"),
])
def test_a_delivery_limit_that_could_drop_or_dead_letter_early_is_warned_about(
        tmp_path, start_worker, arguments, warning):
    from kombu import Connection, Queue
    broker = make_broker("quorum", tmp_path)
    try:
        with Connection(broker.url) as connection:
            Queue(broker.queue, routing_key=broker.queue, durable=True,
                  queue_arguments={"x-queue-type": "quorum", **arguments}
                  )(connection.default_channel).declare()
        worker = start_worker(broker)
        log = worker.wait_for_log(f"quorum queue {broker.queue} {warning}")
        assert log.count("x-delivery-limit = 5") == 1
    finally:
        broker.cleanup()


def test_a_quorum_queue_without_a_delivery_limit_is_not_warned_about(tmp_path, start_worker):
    broker = make_broker("quorum", tmp_path)
    try:
        worker = start_worker(broker)
        assert "x-delivery-limit" not in worker.log()
    finally:
        broker.cleanup()


def test_a_far_countdown_leaves_the_window_to_the_tasks_sent_after_it(tmp_path, start_worker,
                                                                       backlog):
    """A quorum queue's consumers have a fixed prefetch: a countdown task held by the
    worker would fill a window of 1 for its whole wait. One due in 12 s goes back through
    RabbitMQ's delay levels instead: the tasks sent after it run at once, and it runs at
    its time, once."""
    broker, _ = backlog
    from tests.apps import basic
    start_worker(broker, concurrency=1, prefetch_multiplier=1, result_backend="disabled")
    basic.app.configure()
    try:
        sent = time.monotonic()
        later = basic.record.apply_async(countdown=12).id
        now = [basic.record.delay().id for _ in range(3)]
    finally:
        basic.app.close()

    def ran() -> list[str]:
        return [task_id for _, task_id, _ in runs(tmp_path)]
    wait_until(lambda: set(now) <= set(ran()), 8, "the tasks sent after it to run")
    assert later not in ran()
    wait_until(lambda: later in ran(), 40, "the countdown task to run")
    assert time.monotonic() - sent >= 11.9
    assert ran().count(later) == 1
