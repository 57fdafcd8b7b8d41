"""The delivery count (docs/delivery.md "delivery count") on every broker: a delivery that may
have ended in a loss counts even when nothing survives to write it down (a supervisor
killed outright), and a clean hand-back by a live worker never counts."""
from __future__ import annotations

import signal
import time

import pytest

from workhorse.broker.consumer import DEAD_REASON_HEADER, DEAD_TASK_HEADER
from workhorse.exceptions import TooManyDeliveries
from workhorse.protocol import DELIVERIES_HEADER

from .conftest import wait_until
from .test_delivery import dead_letters, failure, holds, starts

pytestmark = pytest.mark.timeout(240)


def test_a_task_that_kills_its_supervisor_is_dead_lettered_after_max_deliveries(
        broker, client, start_worker, tmp_path):
    """What an OOM kill of the supervisor looks like: the worker is restarted each time it
    dies (as systemd would), the task starts at most max_deliveries times, and then it is
    dead-lettered before running; the worker goes on with other work."""
    from tests.apps.basic import kill_supervisor, record
    settings = {"max_deliveries": 2, "visibility_timeout": 3, "concurrency": 1,
                "prefetch_multiplier": 1}
    poison = kill_supervisor.delay()
    workers = [start_worker(broker, **settings)]
    dead: list = []

    def dead_lettered() -> bool:
        if workers[-1].proc.poll() is not None:      # killed by its task: start another
            assert len(workers) <= 4, (f"{len(workers)} supervisors killed, the task started "
                                       f"{starts(tmp_path, poison.id)} times, not dead-lettered")
            workers.append(start_worker(broker, **settings))
        dead.extend(broker.drain(broker.queue + ".dead"))
        return bool(dead)
    wait_until(dead_lettered, 150, "the task that kills its supervisor to be dead-lettered")

    assert starts(tmp_path, poison.id) == 2          # max_deliveries, and not one more
    [(headers, _)] = dead
    assert headers[DEAD_TASK_HEADER] == poison.id
    assert headers[DEAD_REASON_HEADER].startswith("too_many_deliveries")
    assert type(failure(poison)).__name__ == TooManyDeliveries.__name__
    after = record.delay()
    assert after.get(timeout=30) == after.id
    assert workers[-1].proc.poll() is None


def test_a_message_requeued_by_several_deploys_in_a_row_still_runs_once(
        broker, client, start_worker, tmp_path):
    """Warm shutdowns hand a scheduled message back each time (four deploys, with
    max_deliveries=2): none of them counts, and it runs once when its time comes."""
    from tests.apps.basic import record
    eta_in = 40.0
    sent = time.monotonic()
    result = record.apply_async(countdown=eta_in)
    for deploy in range(4):
        worker = start_worker(broker, max_deliveries=2)
        wait_until(lambda: broker.queue_size() == 0, 20, f"deploy {deploy + 1} to hold it")
        worker.signal(signal.SIGTERM)
        assert worker.wait_exit(30) == 0
        worker.kill()
        assert broker.queue_size() == 1, f"deploy {deploy + 1} did not hand it back"
    assert time.monotonic() - sent < eta_in - 1, "the deploys took longer than the ETA"
    assert starts(tmp_path, result.id) == 0
    start_worker(broker, max_deliveries=2)
    assert result.get(timeout=eta_in + 30) == result.id
    assert starts(tmp_path, result.id) == 1
    dead_letters(broker, 0)



@pytest.mark.parametrize("broker", ["amqp"], indirect=True)
def test_a_rabbitmq_redelivery_is_replaced_by_a_copy_carrying_the_loss_never_duplicated(
        broker, client):
    """The consumer's connection is lost while it holds a message: RabbitMQ takes it back,
    so handing it back through the new connection would duplicate it. It comes back marked
    redelivered and is replaced by a copy carrying the loss, which is what runs."""
    from tests.apps.basic import record
    from workhorse.broker.consumer import BrokerConsumer, BrokerUnavailable
    received: list = []
    consumer = BrokerConsumer(client, [broker.queue], lambda q, m: received.append(m),
                              lambda exc: None)

    def receive():
        wait_until(lambda: consumer.poll() or received, 10, "a message")
        return received.pop(0)
    try:
        record.delay()
        consumer.connect(4, lambda: 4)
        held = receive()
        assert consumer.count_delivery(broker.queue, held) == 1
        consumer._lost(ConnectionError("lost in the test"))     # as a failed read reports it
        consumer.connect(4, lambda: 4)
        with pytest.raises(BrokerUnavailable):
            consumer.requeue(broker.queue, held)
        again = receive()
        assert again.delivery_info["redelivered"]
        assert consumer.count_delivery(broker.queue, again) is None
        copy = receive()
        assert copy.headers[DELIVERIES_HEADER] == 1 and not copy.delivery_info["redelivered"]
        assert consumer.count_delivery(broker.queue, copy) == 2
        consumer.requeue(broker.queue, copy)                    # a clean hand-back
        back = receive()
        assert back.headers[DELIVERIES_HEADER] == 1 and not back.delivery_info["redelivered"]
        consumer.ack(back)
        holds(lambda: consumer.poll() or not received, 0.5, "no other copy")
    finally:
        consumer.close()
    assert broker.queue_size() == 0
