"""Result stores (SQLite and Redis) and workflows, with real workers: states as stored,
groups, chords, expiry, caching, and reading each other's results with Celery."""
from __future__ import annotations

import json
import signal
from datetime import datetime

import pytest
import redis

from workhorse import ChordError, GroupResult, chord, group
from workhorse.states import FAILURE, PENDING, RETRY, REVOKED, STARTED, SUCCESS

from .conftest import (
    REDIS_URL,
    basic_client,
    celery_worker,
    make_broker,
    require_service,
    runs,
    wait_until,
)
from .test_delivery import failure, starts

pytestmark = pytest.mark.timeout(180)
REDIS_RESULTS = REDIS_URL.rsplit("/", 1)[0] + "/1"


@pytest.fixture(params=["sqlite", "redis"])
def results_url(request, tmp_path):
    if request.param == "redis":
        require_service("Redis", 6379)
        return REDIS_RESULTS
    return f"sqlite:///{tmp_path / 'results.sqlite3'}"


@pytest.fixture
def app(client, results_url, monkeypatch):
    monkeypatch.setenv("WORKHORSE_RESULT_BACKEND", results_url)
    client.configure()
    return client


def sqlite_broker(request):
    return pytest.mark.parametrize("broker", ["sqlite"], indirect=True)(request)


# ---------------------------------------------------------------- states as stored
@sqlite_broker
def test_states_as_stored(broker, app, results_url, start_worker):
    from tests.apps.basic import fail, flaky, record
    start_worker(broker, result_backend=results_url, track_started=True)
    slow = record.delay(1.0)
    wait_until(lambda: slow.state == STARTED, 20, "STARTED")
    assert slow.get(timeout=20) == slow.id and slow.state == SUCCESS
    meta = app.backend.get_task_meta(slow.id)
    assert meta["date_done"] and meta["task_id"] == slow.id
    retried = flaky.delay(1, 1.0)
    wait_until(lambda: retried.state == RETRY, 20, "RETRY")
    assert retried.get(timeout=20) == "ok after 1 retries"
    failed = fail.delay("no")
    assert isinstance(failure(failed), ValueError) and failed.state == FAILURE
    expired = record.apply_async(countdown=0.5, expires=0.1)
    wait_until(lambda: expired.state == REVOKED, 20, "REVOKED")


@sqlite_broker
def test_forget_and_expiry(broker, app, results_url, start_worker, monkeypatch):
    from tests.apps.basic import add
    start_worker(broker, result_backend=results_url, result_expires=1)
    result = add.delay(1, 1)
    assert result.get(timeout=20) == 2
    result.forget()
    assert app.AsyncResult(result.id).state == PENDING
    short = add.delay(2, 2)
    assert short.get(timeout=20) == 4
    wait_until(lambda: app.backend.get_task_meta(short.id)["status"] == PENDING, 5,
               "expiry after 1 s")
    if results_url.startswith("sqlite"):
        assert app.backend.purge_expired() >= 1


@sqlite_broker
def test_redis_results_carry_a_ttl(broker, client, start_worker, monkeypatch):
    require_service("Redis", 6379)
    monkeypatch.setenv("WORKHORSE_RESULT_BACKEND", REDIS_RESULTS)
    client.configure()
    from tests.apps.basic import add
    start_worker(broker, result_backend=REDIS_RESULTS, result_expires=100)
    result = add.delay(1, 2)
    assert result.get(timeout=20) == 3
    ttl = redis.Redis.from_url(REDIS_RESULTS).ttl(f"celery-task-meta-{result.id}")
    assert 0 < ttl <= 100


@sqlite_broker
def test_ready_results_are_cached(broker, app):
    app.backend.mark_as_done("cached-1", 42)
    assert app.AsyncResult("cached-1").result == 42
    app.backend._forget("cached-1")          # gone from the store, not from the cache
    assert app.AsyncResult("cached-1").get(timeout=1) == 42
    app.AsyncResult("cached-1").forget()
    assert app.AsyncResult("cached-1").state == PENDING


@sqlite_broker
def test_result_extended_stores_the_request(broker, app, monkeypatch):
    monkeypatch.setenv("WORKHORSE_RESULT_EXTENDED", "true")
    app.configure()
    app.backend.mark_as_done("ext-1", 1, request={
        "task": "t.x", "args": [1], "kwargs": {}, "hostname": "w", "retries": 0,
        "delivery_info": {"routing_key": "q"}})
    meta = app.backend.get_task_meta("ext-1")
    assert (meta["name"], meta["args"], meta["worker"], meta["queue"]) == ("t.x", [1], "w", "q")


# ---------------------------------------------------------------- client objects
@sqlite_broker
def test_get_inside_a_task_raises_instead_of_deadlocking(broker, app, results_url, start_worker):
    from tests.apps.basic import get_inside
    start_worker(broker, result_backend=results_url, concurrency=1)
    exc = failure(get_inside.delay())
    assert isinstance(exc, RuntimeError) and "Never call result.get() within a task" in str(exc)


@pytest.mark.parametrize(("broker", "kind"), [("sqlite", "single"), ("sqlite", "group")],
                         indirect=["broker"])
def test_a_task_may_return_a_workflow_it_started(broker, app, results_url, start_worker,
                                                 kind):
    """Stored as Celery stores it (the result's tuple form), which Celery's
    result_from_tuple and ours turn back into the result."""
    from celery.result import result_from_tuple as celery_result_from_tuple

    from tests.apps.basic import start_workflow
    from workhorse.result import result_from_tuple
    start_worker(broker, result_backend=results_url)
    stored = start_workflow.delay(kind).get(timeout=20)
    started = result_from_tuple(stored, app)
    expected = [0, 2, 4] if kind == "group" else 4
    assert (started.join(timeout=20) if kind == "group" else started.get(timeout=20)) == expected
    theirs = celery_result_from_tuple(stored)
    assert theirs.id == started.id


def test_children_and_parents(broker, app, results_url, start_worker):
    from tests.apps.basic import add, spawn_children
    start_worker(broker, result_backend=results_url)
    parent = spawn_children.delay(3)
    child_ids = parent.get(timeout=20)
    assert [c.id for c in parent.children] == child_ids
    assert [c.get(timeout=20) for c in parent.children] == [0, 2, 4]
    last = (add.s(1, 1) | add.s(1)).apply_async()
    assert last.get(timeout=20) == 3 and last.parent.get(timeout=20) == 2


@sqlite_broker
def test_group_result(broker, app, results_url, start_worker):
    from tests.apps.basic import add, fail
    start_worker(broker, result_backend=results_url)
    result = group(add.s(i, i) for i in range(5)).apply_async()
    assert isinstance(result, GroupResult)
    assert result.join(timeout=20) == [0, 2, 4, 6, 8]
    assert result.ready() and result.successful() and result.completed_count() == 5
    result.save()
    restored = GroupResult.restore(result.id, app=app)
    assert restored is not None and [r.id for r in restored] == [r.id for r in result]
    assert restored.get(timeout=5) == [0, 2, 4, 6, 8]
    mixed = group(add.s(1, 1), fail.s("x")).apply_async()
    with pytest.raises(ValueError):
        mixed.join(timeout=20)
    wait_until(mixed.ready, 20, "both done")
    assert mixed.failed() and not mixed.successful() and mixed.completed_count() == 1
    assert mixed.join(timeout=5, propagate=False)[0] == 2


# ---------------------------------------------------------------- chords
def test_chord_with_100_header_tasks_runs_its_body_once(broker, app, results_url, start_worker,
                                                        tmp_path):
    from tests.apps.basic import add, collect
    start_worker(broker, result_backend=results_url, concurrency=2)
    result = chord([add.s(i, 0) for i in range(100)], collect.s()).apply_async()
    assert result.get(timeout=120) == list(range(100))        # in header order
    wait_until(lambda: len(runs(tmp_path)) >= 1, 5, "the body's run")
    assert starts(tmp_path, result.id) == 1
    assert isinstance(result.parent, GroupResult) and len(result.parent) == 100


@sqlite_broker
def test_chains_inside_groups_and_chords_run_as_chains(broker, app, results_url, start_worker):
    """A chain that is a group member, a chord header part or a chord body is its steps,
    not a message named celery.chain; its id and place are its last step's."""
    from workhorse import chain

    from tests.apps.basic import add, collect
    start_worker(broker, result_backend=results_url, concurrency=2)
    grouped = group(add.s(1, 1) | add.s(10), chain(add.s(2, 2), add.s(20))).apply_async()
    assert grouped.join(timeout=30) == [12, 24]
    workflow = chord([add.s(i, i) | add.s(1) for i in range(3)],
                     collect.s() | add.s([100])).apply_async()
    assert workflow.get(timeout=30) == [1, 3, 5, 100]
    two_groups = chain(add.si(1, 0), group(add.s(1), add.s(2)), group(collect.s(), collect.s()),
                       collect.s(), add.s([9]))
    assert two_groups.apply_async().get(timeout=30) == [[2, 3], [2, 3], 9]
    # Nested groups are unrolled; a chain ending in a group, or in a chord, inside a chord
    # header returns that group's members' (that chord body's) results to the chord.
    nested = chain(add.si(1, 0), group(add.si(1, 100), chain(add.si(1, 200), group(
        add.si(1, 1000), add.si(1, 2000)))), collect.s())
    assert nested.apply_async().get(timeout=30) == [101, [1001, 2001]]
    inner = chord([add.si(4, 0), add.si(5, 0)], add.si(6, 0))
    assert chain(add.si(1, 0), chord([add.si(2, 0), chain(add.si(3, 0), inner)], collect.s())
                 ).apply_async().get(timeout=30) == [2, 6]
    assert group(add.si(1, 0), group(add.si(2, 0), group(add.si(3, 0)))).apply_async(
        ).join(timeout=30) == [1, 2, 3]
    # A header member whose result is a group's gives the body a nested list.
    tail = chord([add.si(1, 0), chain(add.si(42, 0), group(add.s(0), add.s(1)))], collect.s())
    assert tail.apply_async().get(timeout=30) == [1, [42, 43]]
    callback = add.s(1000).set(task_id="the-chains-link")
    assert (add.s(1, 1) | add.s(1)).apply_async(link=callback).get(timeout=30) == 3
    assert app.AsyncResult("the-chains-link").get(timeout=30) == 1003


@sqlite_broker
def test_a_failed_chord_fails_the_rest_of_its_chain(broker, app, results_url, start_worker):
    """The group waits on the chain's last step, so it must be failed, not left PENDING;
    so must each member of a group body."""
    from workhorse import chain

    from tests.apps.basic import add, collect, fail
    start_worker(broker, result_backend=results_url, concurrency=2)
    for body in (collect.s(), group(add.s([1]).set(task_id="member-1"),
                                    add.s([2]).set(task_id="member-2"))):
        inner = chain(chord([add.s(1, 1), fail.s("header")], body),
                      chord([add.s(1), add.s(2)], collect.s()))
        result = group(inner, add.s(1, 1)).apply_async()
        exc = failure(result.results[0])
        assert type(exc).__name__ == ChordError.__name__ and "header" in str(exc)
        assert result.results[0].state == FAILURE and result.results[1].get(timeout=20) == 2
        if isinstance(body, group):
            for member in body.tasks:
                assert app.AsyncResult(member.options["task_id"]).state == FAILURE


@sqlite_broker
def test_errbacks_of_a_failed_chords_group_body_and_of_its_members(
        broker, app, results_url, start_worker, tmp_path):
    """As Celery: a failed header fails each member of a group body with the header's
    exception and calls each member's errbacks (one signature or a list) and the
    group's; a group's errbacks replace its members' when it runs; an errback of a chord
    whose header chain fails midway is called in the child, new style."""
    from workhorse import chain

    from tests.apps.basic import add, collect, errback_label, errback_new, fail

    from .test_failures import errback_lines
    start_worker(broker, result_backend=results_url, concurrency=2)

    def labels(count: int) -> list[str]:
        wait_until(lambda: len(errback_lines(tmp_path)) >= count, 20, f"{count} errbacks")
        lines = errback_lines(tmp_path)
        (tmp_path / "grandchild.pid.errback").unlink()
        return sorted(lines)

    body = group(collect.s().set(task_id="own-member", link_error=errback_label.si("own")),
                 collect.s().set(task_id="other-member"))
    failed = chord([add.s(1, 1), fail.s("header")], body).apply_async()
    with pytest.raises(ValueError):
        failed.get(timeout=30)
    assert labels(1) == ["label own"]
    for member in ("own-member", "other-member"):
        assert app.AsyncResult(member).state == FAILURE
        assert isinstance(failure(app.AsyncResult(member)), ValueError)

    body = group(fail.s(), collect.s()).set(link_error=errback_label.si("group"))
    ran = chord([add.si(1, 1)], body).apply_async(link_error=errback_label.si("chord"))
    with pytest.raises(ValueError):
        ran.get(timeout=30)
    assert labels(2) == ["label chord", "label group"]

    midway = chord([chain(add.si(1, 1), fail.s(), add.si(0, 0))], collect.s())
    result = midway.apply_async(link_error=errback_new.s())
    failure(result)
    line = labels(1)[0].split()
    assert line[0] == result.id and line[1] == ChordError.__name__


@sqlite_broker
def test_a_failing_header_task_fails_the_chord_and_calls_the_body_errbacks(
        broker, app, results_url, start_worker, tmp_path):
    from tests.apps.basic import add, collect, errback_new, fail
    start_worker(broker, result_backend=results_url)
    body = collect.s().on_error(errback_new.s())
    result = chord([add.s(1, 1), fail.s("header"), add.s(2, 2)], body).apply_async()
    exc = failure(result)
    assert type(exc).__name__ == ChordError.__name__ and "header" in str(exc)
    assert starts(tmp_path, result.id) == 0
    from .test_failures import errback_lines
    wait_until(lambda: errback_lines(tmp_path), 20, "the chord body's errback")
    assert errback_lines(tmp_path)[0].split()[0] == result.id


@sqlite_broker
def test_a_killed_header_task_still_completes_the_chord(broker, app, results_url, start_worker,
                                                        tmp_path):
    from tests.apps.basic import add, collect, die
    start_worker(broker, result_backend=results_url, reject_on_worker_lost=False)
    result = chord([add.s(1, 1), die.s()], collect.s()).apply_async()
    exc = failure(result)
    assert type(exc).__name__ == ChordError.__name__ and "WorkerLostError" in str(exc)


def test_celery_sent_chord_completes_on_a_workhorse_worker(tmp_path, start_worker):
    require_service("Redis", 6379)
    celery = pytest.importorskip("celery")
    broker = make_broker("redis", tmp_path)
    start_worker(broker, result_backend=REDIS_RESULTS)
    capp = celery.Celery("chord-client", broker=broker.url, backend=REDIS_RESULTS)
    capp.conf.task_default_queue = broker.queue
    try:
        header = [capp.signature("tests.apps.basic.add", args=(i, 1)) for i in range(10)]
        body = capp.signature("tests.apps.basic.collect")
        result = celery.chord(header)(body)
        assert result.get(timeout=60) == [i + 1 for i in range(10)]
    finally:
        capp.close()
        broker.cleanup()


# ---------------------------------------------------------------- Celery's worker, our client
def test_workhorse_reads_a_celery_workers_results(tmp_path, monkeypatch):
    require_service("Redis", 6379)
    pytest.importorskip("celery")
    broker = make_broker("redis", tmp_path)
    try:
        with celery_worker(tmp_path, broker, REDIS_RESULTS, "-c", "1", "-P", "solo"):
            basic = basic_client(monkeypatch, broker, REDIS_RESULTS, tmp_path)
            ok = basic.app.send_task("celery_tasks.add", (20, 22), queue=broker.queue)
            bad = basic.app.send_task("celery_tasks.fail", ("celery says no",),
                                      queue=broker.queue)
            assert ok.get(timeout=60) == 42
            with pytest.raises(ValueError) as raised:
                bad.get(timeout=30)
            assert raised.value.args == ("celery says no",) and "ValueError" in bad.traceback
    finally:
        from tests.apps import basic
        basic.app.close()
        broker.cleanup()


def test_a_celery_client_finds_the_same_result_from_either_worker(tmp_path, start_worker):
    """The same Celery client call, run by a Celery worker and by a workhorse worker (both
    with result_extended): the stored results have the same fields and values, but for
    ids, times and the worker's name."""
    require_service("Redis", 6379)
    celery = pytest.importorskip("celery")
    theirs, ours = make_broker("redis", tmp_path), make_broker("redis", tmp_path)
    client = celery.Celery("compare", broker=theirs.url, backend=REDIS_RESULTS)
    store = redis.Redis.from_url(REDIS_RESULTS)
    try:
        with celery_worker(tmp_path, theirs, REDIS_RESULTS, "-c", "1", "-P", "solo",
                           WH_CELERY_EXTENDED="1"):
            start_worker(ours, result_backend=REDIS_RESULTS, result_extended=True)
            stored = {}
            for broker in (theirs, ours):
                result = client.send_task("tests.apps.basic.add", (2, 3), queue=broker.queue)
                assert result.get(timeout=30) == 5
                stored[broker.queue] = json.loads(store.get(f"celery-task-meta-{result.id}"))
        celery_meta, workhorse_meta = stored[theirs.queue], stored[ours.queue]
        assert set(workhorse_meta) == set(celery_meta)
        for meta, broker in ((celery_meta, theirs), (workhorse_meta, ours)):
            assert meta.pop("queue") == broker.queue
            assert datetime.fromisoformat(meta.pop("date_done")).utcoffset() is not None
            assert meta.pop("task_id") and meta.pop("worker")
        assert workhorse_meta == celery_meta
    finally:
        client.close()
        store.close()
        theirs.cleanup()
        ours.cleanup()


# ---------------------------------------------------------------- Redis specifics
def test_waiting_on_redis_does_not_poll(tmp_path, start_worker, monkeypatch):
    """Reads of the result's key are counted with MONITOR (the server's command totals
    would count every other client of a shared Redis too)."""
    import threading
    require_service("Redis", 6379)
    broker = make_broker("sqlite", tmp_path)
    basic = basic_client(monkeypatch, broker, REDIS_RESULTS, tmp_path)
    start_worker(broker, result_backend=REDIS_RESULTS)
    server = redis.Redis.from_url(REDIS_RESULTS)
    commands: list[str] = []
    done = threading.Event()

    def watch() -> None:
        with server.monitor() as monitor:
            for seen in monitor.listen():
                commands.append(seen["command"])
                if done.is_set() and "monitor-stop" in seen["command"]:
                    return
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    wait_until(lambda: server.echo("monitor-ready") and any(
        "monitor-ready" in c for c in commands), 10, "MONITOR to start")
    result = basic.record.delay(2.0)
    assert result.get(timeout=20, interval=0.05) == result.id
    done.set()
    server.echo("monitor-stop")
    watcher.join(10)
    reads = [c for c in commands if c.split()[0].upper() in ("GET", "MGET") and result.id in c]
    assert 1 <= len(reads) <= 2, reads      # one GET, then the publish; no polling loop
    basic.app.close()


@pytest.fixture
def outage(tmp_path, private_redis, monkeypatch):
    """The test app on a SQLite broker with its results in a Redis the test can stop."""
    broker = make_broker("sqlite", tmp_path)
    monkeypatch.setenv("WORKHORSE_BROKER_URL", broker.url)
    monkeypatch.setenv("WORKHORSE_RESULT_BACKEND", private_redis.url())
    monkeypatch.setenv("WORKHORSE_QUEUES", broker.queue)
    monkeypatch.setenv("WORKHORSE_STATE_DIR", str(tmp_path / "state"))
    from tests.apps import basic
    basic.app.configure()
    yield broker, basic
    basic.app.close()


def test_a_redis_outage_mid_run_delays_results_and_loses_none(tmp_path, start_worker, outage,
                                                              private_redis):
    """The result store goes away for a moment while tasks finish: results arrive late."""
    broker, basic = outage
    worker = start_worker(broker, result_backend=private_redis.url(), concurrency=2)
    results = [basic.record.delay(0.1) for _ in range(20)]
    wait_until(lambda: len(runs(tmp_path)) >= 4, 20, "some tasks to run")
    private_redis.kill()
    wait_until(lambda: "result store: storing" in worker.log(), 20,
               "a store that fails and is retried")
    private_redis.start()
    assert [r.get(timeout=60) for r in results] == [r.id for r in results]
    assert broker.queue_size() == 0


def test_the_supervisor_retries_its_own_result_writes_from_its_loop(tmp_path, start_worker,
                                                                     outage, private_redis):
    """A REVOKED the supervisor writes while the store is down: the message is held, the
    loop keeps answering signals, and the result and the ack follow once the store is back."""
    broker, basic = outage
    worker = start_worker(broker, result_backend=private_redis.url(), concurrency=1,
                          result_backend_max_sleep_between_retries_ms=300)
    private_redis.kill()
    expired = basic.record.apply_async(countdown=0.3, expires=0.1)
    worker.wait_for_log(r"storing its revoked result failed .* the message held", 20)
    worker.signal(signal.SIGUSR1)
    worker.wait_for_log(r"state: .* storing=1", 5)     # the loop is not asleep
    private_redis.start()
    wait_until(lambda: expired.state == REVOKED, 30, "REVOKED once the store is back")
    assert runs(tmp_path) == []
    assert worker.stop() == 0
    assert broker.queue_size() == 0                    # acked, not released


def test_a_store_that_cannot_say_whether_an_idempotent_task_may_run_does_not_count(
        tmp_path, start_worker, outage, private_redis):
    """The claim cannot be made while the store is down: the task has not started, so it
    is held and tried again, not requeued as a delivery (max_deliveries=1 would then
    dead-letter it)."""
    broker, basic = outage
    worker = start_worker(broker, result_backend=private_redis.url(), concurrency=1,
                          max_deliveries=1, visibility_timeout=2,
                          result_backend_max_retries=1)
    private_redis.kill()
    result = basic.once.delay()
    worker.wait_for_log("could not tell whether it may run", 30)
    private_redis.start()
    assert result.get(timeout=60) == result.id
    assert starts(tmp_path, result.id) == 1
    assert broker.queue_size(broker.queue + ".dead") == 0


def test_a_result_stored_while_the_subscription_is_on_its_way_is_seen(monkeypatch):
    """Fault: Redis takes a waiting client's SUBSCRIBE only after that client's GET and
    after the worker has stored and published the result (two connections: nothing orders
    them). The client must read only once Redis has confirmed the subscription, or it waits
    for a publish that already went."""
    import uuid

    from redis.client import PubSub

    from workhorse.backends.redis import RedisBackend
    require_service("Redis", 6379)
    backend = RedisBackend(REDIS_RESULTS)
    late: list[tuple[PubSub, tuple]] = []
    subscribe, get_message = PubSub.subscribe, PubSub.get_message

    def arrives_late(self: PubSub, *channels: object, **kwargs: object) -> None:
        late.append((self, channels))

    def get_message_late(self: PubSub, *args: object, **kwargs: object) -> object:
        while late:
            pubsub, channels = late.pop()
            subscribe(pubsub, *channels)
        return get_message(self, *args, **kwargs)
    monkeypatch.setattr(PubSub, "subscribe", arrives_late)
    monkeypatch.setattr(PubSub, "get_message", get_message_late)
    read = backend._get

    def read_then_store(task_id: str) -> str | None:
        value = read(task_id)
        if value is None:
            backend.mark_as_done(task_id, 42)       # the worker, right after the read
        return value
    monkeypatch.setattr(backend, "_get", read_then_store)
    try:
        meta = backend.wait_for(str(uuid.uuid4()), timeout=5)
        assert (meta["status"], meta["result"]) == (SUCCESS, 42)
    finally:
        backend.close()
