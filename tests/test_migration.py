"""A fleet part-way through a migration: Celery and workhorse workers consuming the same
RabbitMQ queue, results in one Redis. Tier 3, with a real Celery worker."""
from __future__ import annotations

import pytest

from workhorse import chord

from .conftest import (
    REDIS_URL,
    basic_client,
    celery_worker,
    make_broker,
    require_service,
    runs,
    wait_until,
)

pytestmark = pytest.mark.timeout(180)
REDIS_RESULTS = REDIS_URL.rsplit("/", 1)[0] + "/1"


def test_celery_and_workhorse_workers_share_a_rabbitmq_queue_and_a_chord(
        tmp_path, start_worker, monkeypatch):
    """Each task runs once, on one worker or the other; a chord whose parts both count
    (Celery's keys, Celery's part encoding) runs its body once."""
    require_service("Redis", 6379)
    pytest.importorskip("celery")
    broker = make_broker("amqp", tmp_path)
    try:
        with celery_worker(tmp_path, broker, REDIS_RESULTS, "-c", "2", "-P", "prefork") as log:
            start_worker(broker, result_backend=REDIS_RESULTS)
            basic = basic_client(monkeypatch, broker, REDIS_RESULTS, tmp_path)
            singles = [basic.add.delay(i, i) for i in range(40)]
            assert [r.get(timeout=60) for r in singles] == [2 * i for i in range(40)]
            result = chord([basic.add.s(i, 1) for i in range(30)],
                           basic.collect.s()).apply_async()
            assert result.get(timeout=90) == [i + 1 for i in range(30)]
            wait_until(lambda: any(r[1] == result.id for r in runs(tmp_path)), 10,
                       "the body's run")
            assert [r for r in runs(tmp_path) if r[1] == result.id][1:] == []   # once
            celery_log = log.read_text(errors="replace")
            assert "tests.apps.basic.add" in celery_log and "succeeded" in celery_log
    finally:
        from tests.apps import basic
        basic.app.close()
        broker.cleanup()


def test_a_celery_workers_long_task_on_a_shared_redis_is_not_run_again_by_workhorse(
        tmp_path, start_worker, monkeypatch):
    """Unsupported, but safe and loud: a workhorse worker's sweep (visibility_timeout 1 s)
    leaves the lease of the Celery worker's 8-second task alone, and says why."""
    require_service("Redis", 6379)
    pytest.importorskip("celery")
    broker = make_broker("redis", tmp_path)
    try:
        with celery_worker(tmp_path, broker, REDIS_RESULTS, "-c", "1", "-P", "solo"):
            basic = basic_client(monkeypatch, broker, REDIS_RESULTS, tmp_path)
            long = basic.record.delay(8)
            wait_until(lambda: any(r[1] == long.id for r in runs(tmp_path)), 30,
                       "the Celery worker to start it")
            worker = start_worker(broker, result_backend=REDIS_RESULTS, visibility_timeout=1)
            worker.wait_for_log(r"not a workhorse worker", 30)
            assert long.get(timeout=30) == long.id
            assert [r for r in runs(tmp_path) if r[1] == long.id][1:] == []   # ran once
    finally:
        from tests.apps import basic
        basic.app.close()
        broker.cleanup()
