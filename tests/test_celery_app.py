"""A Celery app's tasks, unchanged, run by a workhorse worker (``-A module:celery_app``),
with Celery's client sending and reading. Tier 3: Redis and RabbitMQ brokers, Redis
results (the store Celery's tasks and client share with the worker)."""
from __future__ import annotations

import pytest

from .conftest import REDIS_URL, Worker, make_broker, require_service, wait_until, worker_env

pytestmark = pytest.mark.timeout(120)
RESULTS_URL = REDIS_URL.rsplit("/", 1)[0] + "/1"


@pytest.fixture(params=["redis", "amqp"])
def celery_client(request, tmp_path):
    require_service("Redis", 6379)
    celery = pytest.importorskip("celery")
    broker = make_broker(request.param, tmp_path)
    env = worker_env(broker, tmp_path, result_backend=RESULTS_URL)
    env.update(WH_CELERY_BROKER=broker.url, WH_CELERY_BACKEND=RESULTS_URL,
               WH_CELERY_QUEUE=broker.queue)
    worker = Worker(tmp_path, env, ["-A", "tests.apps.celery_tasks:app"])
    client = celery.Celery("client", broker=broker.url, backend=RESULTS_URL)
    client.conf.task_default_queue = broker.queue
    try:
        worker.wait_ready()
        yield client, worker
    finally:
        worker.kill()
        client.close()
        broker.cleanup()


def test_a_celery_apps_tasks_run_on_a_workhorse_worker(celery_client):
    client, worker = celery_client
    assert client.send_task("celery_tasks.add", (2, 40)).get(timeout=20) == 42
    with pytest.raises(ValueError, match="no"):
        client.send_task("celery_tasks.fail", ("no",)).get(timeout=20)
    assert "tasks: " in worker.log() and "celery_tasks.add" in worker.log()


def test_a_celery_apps_own_celery_named_tasks_run_and_celerys_builtins_stay_out():
    """``celery.ping`` (celery.contrib.testing, which Celery's test worker pings to know a
    worker is up) is the app's task; Celery's workflow builtins are not registered:
    ``celery.chord_unlock`` is workhorse's own (builtins.py)."""
    pytest.importorskip("celery")
    from tests.apps.celery_tasks import app as celery_app

    from workhorse.celeryapp import from_celery
    app = from_celery(celery_app)
    assert "celery.ping" in app.tasks and "celery_tasks.add" in app.tasks
    assert not {"celery.group", "celery.chain", "celery.chord"} & set(app.tasks)
    assert app.tasks["celery.chord_unlock"].run.__module__ == "workhorse.builtins"


def test_celery_ping_runs_on_a_workhorse_worker(celery_client):
    client, _ = celery_client
    assert client.send_task("celery.ping").get(timeout=20) == "pong"


def test_celerys_task_api_works_inside_them(celery_client):
    """self.request and current_task, self.retry (RETRY stored, then the retry runs),
    self.replace (the replacement's result under the task's id), and Ignore."""
    client, _ = celery_client
    sent = client.send_task("celery_tasks.whoami")
    task_id, routing_key, current = sent.get(timeout=20)
    assert task_id == sent.id and routing_key and current is True
    assert client.send_task("celery_tasks.retry_once").get(timeout=20) == 1
    assert client.send_task("celery_tasks.replaced").get(timeout=20) == 42
    ignored = client.send_task("celery_tasks.ignored")
    assert client.send_task("celery_tasks.add", (1, 1)).get(timeout=20) == 2
    assert ignored.state == "PENDING"          # Ignore: acked, nothing stored


def test_errbacks_are_called_by_their_arity_as_celery_calls_them(celery_client):
    """An errback with stored arguments is told apart as Celery does: what it still takes
    beyond them decides whether it gets the failed task's id (sent as a task) or
    (request, exc, traceback) (called in the child)."""
    import redis
    client, _ = celery_client
    store = redis.Redis.from_url(RESULTS_URL)
    errbacks = {"old-args": client.signature("celery_tasks.errback_old_style", ("a",)),
                "old-kwargs": client.signature("celery_tasks.errback_old_style",
                                               kwargs={"label": "k"}),
                "new-args": client.signature("celery_tasks.errback_new_style", ("n",))}
    expected = {"old-args": b"a", "old-kwargs": b"k", "new-args": b"n: ValueError"}
    for name, errback in errbacks.items():
        failing = client.signature("celery_tasks.fail", ("no",))
        failing.link_error(errback)
        result = failing.apply_async()
        with pytest.raises(ValueError):
            result.get(timeout=20)
        key = f"errback:{result.id}"
        wait_until(lambda key=key: store.lrange(key, 0, -1), 20, f"errback {name}")
        assert store.lrange(key, 0, -1) == [expected[name]], name


def test_a_celery_apps_async_def_tasks_run_many_at_once_each_with_its_own_request(
        celery_client):
    """Celery runs an ``async def`` task's body as a coroutine nobody awaits (celery#6552);
    under workhorse it runs on its child's event loop, 40 at once on 2 children here, and
    ``self.request`` across the await is each one's own (Celery keeps its request stack
    per thread: workhorse gives an async task's one per asyncio task)."""
    import time
    client, _ = celery_client
    started = time.monotonic()
    sent = [client.send_task("celery_tasks.async_whoami", (1.0,)) for _ in range(40)]
    for result in sent:
        assert result.get(timeout=30) == [result.id, result.id]
    assert time.monotonic() - started < 15      # one at a time per child would take 20 s
