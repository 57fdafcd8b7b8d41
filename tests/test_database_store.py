"""The database result store (``db+postgresql://``): a Celery 5.7 client and workhorse share
Celery's tables. PostgreSQL on 127.0.0.1:5432 (user postgres); each test module run gets a
database of its own, dropped after."""
from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from workhorse.backends import Claim, backend_from_url
from workhorse.states import FAILURE, SUCCESS

from .conftest import (REDIS_URL, check_celery_results, make_broker, require_service, runs,
                       wait_until)

POSTGRES = os.environ.get("WH_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432")

pytestmark = pytest.mark.broker("postgresql")


@pytest.fixture(scope="module")
def database() -> Iterator[str]:
    """``db+postgresql://…/<a new database>``."""
    require_service("PostgreSQL", 5432)
    import sqlalchemy as sa
    name = f"wh_test_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(f"{POSTGRES}/postgres", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    yield f"db+{POSTGRES}/{name}"
    with admin.connect() as conn:
        conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
    admin.dispose()


@pytest.fixture
def store(database):
    backend = backend_from_url(database, expires=3600, extended=True)
    yield backend
    backend.close()


@pytest.fixture
def celery_app(database):
    celery = pytest.importorskip("celery")
    app = celery.Celery("dbstore", broker="memory://", backend=database)
    app.conf.result_extended = True
    yield app
    app.close()


def test_celery_reads_what_workhorse_stores(store, celery_app):
    store.mark_as_started("s1", {"hostname": "w1"})
    assert celery_app.AsyncResult("s1").state == "STARTED"
    store.mark_as_done("s1", {"total": [1, 2]}, {"task": "proj.add", "args": [1, 2],
                                                 "kwargs": {"z": 3}, "hostname": "w1",
                                                 "retries": 0})
    result = celery_app.AsyncResult("s1")
    assert (result.state, result.result) == ("SUCCESS", {"total": [1, 2]})
    assert (result.name, result.args, result.kwargs) == ("proj.add", [1, 2], {"z": 3})
    assert isinstance(result.date_done, datetime)
    store.mark_as_failure("f1", KeyError("missing"), "Traceback: here")
    failed = celery_app.AsyncResult("f1")
    with pytest.raises(KeyError, match="missing"):
        failed.get(timeout=5)
    assert failed.traceback == "Traceback: here"


def test_workhorse_reads_what_celery_stores_json_and_pickle(store, celery_app):
    backend = celery_app.backend
    backend.store_result("c1", {"x": 1}, "SUCCESS")
    backend.store_result("c2", ValueError("bad", 2), "FAILURE", traceback="tb")
    assert store.get_task_meta("c1")["result"] == {"x": 1}
    assert store.get_task_meta("c2")["result"]["exc_type"] == "ValueError"
    celery_app.conf.result_serializer = "pickle"
    celery_app.conf.result_accept_content = ["json", "pickle"]
    pickled = type(backend)(app=celery_app, url=celery_app.conf.result_backend[3:])
    pickled.store_result("p1", {"when": datetime(2026, 1, 1), "ids": {1, 2}}, "SUCCESS")
    pickled.store_result("p2", ValueError("pickled"), "FAILURE")
    assert store.get_task_meta("p1")["result"] == {"when": datetime(2026, 1, 1), "ids": {1, 2}}
    error = store.get_task_meta("p2")["result"]
    assert type(error) is ValueError and error.args == ("pickled",)


def test_a_pickled_row_that_would_run_code_is_refused(store, tmp_path):
    import sqlalchemy as sa

    class Evil:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    store.mark_as_done("e1", 1)
    with store.engine.begin() as conn:
        conn.execute(sa.text("UPDATE celery_taskmeta SET result = :r WHERE task_id = 'e1'"),
                     {"r": pickle.dumps(Evil(), protocol=4)})
    with pytest.raises(pickle.UnpicklingError, match=r"system, which is neither"):
        store.get_task_meta("e1")
    assert not (tmp_path / "ran").exists()


def test_a_transient_error_is_retried_and_a_lasting_one_raised(database, monkeypatch):
    """As Celery's own t/integration/test_database_backend.py does for its store: an
    OperationalError on the first attempt is retried; one on every attempt is raised
    after max_retries, a bad value is not retried at all."""
    import sqlalchemy as sa

    from workhorse.backends import RetryPolicy
    from workhorse.exceptions import ResultEncodeError
    store = backend_from_url(database, retry=RetryPolicy(max_retries=2, base_sleep=0.001))
    calls = []
    real = type(store)._single

    def failing(self, fail_times: int):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) <= fail_times:
            raise sa.exc.OperationalError("simulated disconnect", {}, Exception())
        return real(self)

    monkeypatch.setattr(type(store), "_single", lambda self: failing(self, 1))
    store.mark_as_done("transient", {"foo": "bar"})
    assert len(calls) == 2
    assert store.get_task_meta("transient")["result"] == {"foo": "bar"}
    calls.clear()
    monkeypatch.setattr(type(store), "_single", lambda self: failing(self, 99))
    with pytest.raises(sa.exc.OperationalError):
        store.mark_as_done("lasting", 1)
    assert len(calls) == 3          # one attempt and two retries
    calls.clear()
    with pytest.raises(ResultEncodeError):
        store.mark_as_done("unencodable", object())
    assert calls == []
    store.close()


def _first_store(url: str, n: int, barrier) -> None:  # type: ignore[no-untyped-def]
    store = backend_from_url(url)
    barrier.wait(10)
    store.mark_as_done(f"first-{n}", n)


def test_processes_storing_first_into_an_empty_database_all_store(fork_ctx):
    """Six processes make the tables at once (a worker's children at its first results):
    the one that loses the race to CREATE TABLE checks again instead of failing."""
    require_service("PostgreSQL", 5432)
    import sqlalchemy as sa
    name = f"wh_empty_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(f"{POSTGRES}/postgres", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    try:
        url = f"db+{POSTGRES}/{name}"
        barrier = fork_ctx.Barrier(6)
        processes = [fork_ctx.Process(target=_first_store, args=(url, n, barrier))
                     for n in range(6)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(60)
        assert [p.exitcode for p in processes] == [0] * 6
        store = backend_from_url(url)
        assert [store.get_task_meta(f"first-{n}")["result"] for n in range(6)] == list(range(6))
        store.close()
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        admin.dispose()


def test_a_success_is_never_written_over(store):
    store.mark_as_done("d1", "first")
    store.mark_as_failure("d1", ValueError("a repeated run"))
    assert store.get_task_meta("d1")["status"] == SUCCESS
    assert store.get_task_meta("d1")["result"] == "first"


def test_groups_forget_and_expiry_as_celery_has_them(store, celery_app):
    parts = [celery_app.AsyncResult(f"g-{n}") for n in range(3)]
    group = celery_app.GroupResult("grp1", parts)
    group.save()
    assert store.restore_group("grp1") == [["grp1", None], [[[f"g-{n}", None], None]
                                                           for n in range(3)]]
    store.save_group("grp2", [["grp2", None], [[["x", None], None]]])
    restored = celery_app.GroupResult.restore("grp2")
    assert [r.id for r in restored.results] == ["x"]
    store.mark_as_done("gone", 1)
    celery_app.AsyncResult("gone").forget()
    assert store.get_task_meta("gone")["status"] == "PENDING"
    # Expiry: rows whose date_done is older than result_expires go with the purge.
    import sqlalchemy as sa
    store.mark_as_done("old", 1)
    store.mark_as_done("new", 1)
    with store.engine.begin() as conn:
        conn.execute(sa.text("UPDATE celery_taskmeta SET date_done = :d WHERE task_id = 'old'"),
                     {"d": datetime.now(UTC) - timedelta(hours=2)})
    assert store.purge_expired() >= 1
    assert store.get_task_meta("old")["status"] == "PENDING"
    assert store.get_task_meta("new")["status"] == SUCCESS


def test_claims_and_a_counted_chord(store):
    assert store.claim("k", "a", 30) is Claim.CLAIMED
    assert store.claim("k", "b", 30) is Claim.HELD
    assert store.renew_claims({"k": "a", "other": "a"}, 30) == {"other"}
    store.finish_claim("k", "a")
    assert store.claim("k", "b", 30) is Claim.DONE
    store.set_chord_size("ch", 3)
    assert store.chord_part_return("ch", "p0", 0, SUCCESS, 10) is None
    assert store.chord_part_return("ch", "p0", 0, SUCCESS, 10) is None     # counted once
    assert store.chord_part_return("ch", "p2", 2, FAILURE, ValueError("x")) is None
    completion = store.chord_part_return("ch", "p1", 1, SUCCESS, 11)
    assert completion is not None and [p.task_id for p in completion.parts] == ["p0", "p1", "p2"]
    assert completion.parts[2].result["exc_type"] == "ValueError"
    # Another part reporting again while the claim is live gets nothing; the claimer does.
    assert store.chord_part_return("ch", "p0", 0, SUCCESS, 10) is None
    assert store.chord_part_return("ch", "p1", 1, SUCCESS, 11) is not None
    store.chord_finished("ch", completion.token)
    assert store.chord_part_return("ch", "p1", 1, SUCCESS, 11) is None


# ---------------------------------------------------------------- a worker and a Celery client
@pytest.fixture
def on_redis(database, tmp_path, start_worker):
    """A Celery client and a workhorse worker on Redis, results in the database."""
    require_service("Redis", 6379)
    celery = pytest.importorskip("celery")
    broker = make_broker("redis", tmp_path)
    app = celery.Celery("dbinterop", broker=broker.url, backend=database)
    app.conf.task_default_queue = broker.queue

    def worker():  # type: ignore[no-untyped-def]
        return start_worker(broker, result_backend=database, track_started=True)

    yield app, broker, worker
    app.close()
    broker.cleanup()


def test_a_celery_client_gets_results_failures_and_retries(on_redis):
    app, broker, worker = on_redis
    worker()
    check_celery_results(app)
    retried = app.send_task("tests.apps.basic.flaky", (2,), {"countdown": 1.5})
    wait_until(lambda: retried.state == "RETRY", 20, "the RETRY state stored")
    assert retried.get(timeout=30) == "ok after 2 retries"
    gone = app.send_task("tests.apps.basic.add", (1, 1))
    assert gone.get(timeout=20) == 2
    gone.forget()
    assert app.AsyncResult(gone.id).state == "PENDING"


def _chord(app, parts: int, seconds: float):  # type: ignore[no-untyped-def]
    from celery import chord
    header = [app.signature("tests.apps.basic.record", (seconds,)) for _ in range(parts)]
    return chord(header)(app.signature("tests.apps.basic.collect"))


def test_a_celery_clients_chord_completes_through_chord_unlock(on_redis, tmp_path):
    app, broker, worker = on_redis
    worker()
    result = _chord(app, 20, 0.0)
    ids = result.get(timeout=60)
    assert len(ids) == 20 and len(set(ids)) == 20
    assert [name for name, _, _ in runs(tmp_path)].count("collect") == 1


def test_a_chord_whose_worker_is_killed_mid_header_completes_once(on_redis, tmp_path):
    app, broker, worker = on_redis
    first = worker()
    result = _chord(app, 20, 0.2)
    wait_until(lambda: len(runs(tmp_path)) >= 4, 30, "the header's parts running")
    os.killpg(first.pid, signal.SIGKILL)
    first.proc.wait(10)
    worker()
    ids = result.get(timeout=90)
    assert len(set(ids)) == 20
    bodies = [name for name, _, _ in runs(tmp_path) if name == "collect"]
    assert bodies == ["collect"], runs(tmp_path)


def test_celery_backend_cleanup_runs_on_the_worker(on_redis, store):
    app, broker, worker = on_redis
    worker()
    import sqlalchemy as sa
    store.mark_as_done("stale", 1)
    with store.engine.begin() as conn:
        conn.execute(sa.text("UPDATE celery_taskmeta SET date_done = :d WHERE task_id = "
                             "'stale'"), {"d": datetime.now(UTC) - timedelta(days=2)})
    app.send_task("celery.backend_cleanup").get(timeout=20)
    assert store.get_task_meta("stale")["status"] == "PENDING"


def test_a_bad_url_and_a_missing_sqlalchemy_are_named(monkeypatch):
    from workhorse.config import ConfigError
    from workhorse.config.settings import _check_backend
    assert _check_backend("db+postgresql://u@h/db") is None
    assert "db+<SQLAlchemy URL>" in (_check_backend("db+nothing") or "")
    with pytest.raises(ConfigError, match="nosuchdialect"):
        backend_from_url("db+nosuchdialect://u@h/db")
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)
    with pytest.raises(ConfigError, match=r"pip install 'workhorse\[sql\]'"):
        backend_from_url("db+postgresql://u@h/db")


def test_the_worker_names_a_missing_driver_and_does_not_start(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKHORSE_")}
    env.update(WORKHORSE_RESULT_BACKEND="db+nosuchdialect://u@h/db",
               WORKHORSE_BROKER_URL=f"sqlite:///{tmp_path / 'broker.sqlite3'}",
               WORKHORSE_STATE_DIR=str(tmp_path / "state"))
    done = subprocess.run([sys.executable, "-m", "workhorse", "worker", "-A",
                           "workhorse.examples.tasks"], env=env, capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "configuration error: result_backend 'db+nosuchdialect://u@h/db'" in done.stderr


REDIS = REDIS_URL      # named for the tier detection: this module talks to Redis too


# ---------------------------------------------------------------- the database's faults
def _drain_with(on_redis, tmp_path, count: int, fault) -> list:  # type: ignore[no-untyped-def]
    """``count`` record tasks through a worker while ``fault()`` is called until they are
    all done; every one SUCCESS, each run once."""
    app, broker, worker = on_redis
    worker()
    results = [app.send_task("tests.apps.basic.record") for _ in range(count)]
    wait_until(lambda: fault() or all(r.state == "SUCCESS" for r in results), 120,
               "every result stored through the fault")
    ran = [task_id for name, task_id, _ in runs(tmp_path) if name == "record"]
    assert sorted(ran) == sorted(r.id for r in results), "each task runs once"
    return results


def test_connections_lost_again_and_again_lose_no_result(on_redis, database, tmp_path):
    """Every connection to the database is ended from the server's side every 50 ms while
    200 tasks run: each store is retried on a new connection."""
    import sqlalchemy as sa
    name = database.rsplit("/", 1)[1]
    admin = sa.create_engine(f"{POSTGRES}/postgres", isolation_level="AUTOCOMMIT")
    ended = []

    def end_connections() -> None:
        with admin.connect() as conn:
            ended.append(conn.execute(sa.text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = :db AND pid <> pg_backend_pid()"), {"db": name}).scalar())
        time.sleep(0.05)

    try:
        _drain_with(on_redis, tmp_path, 200, end_connections)
    finally:
        admin.dispose()
    assert sum(ended) > 0, "the fault was injected"


def test_a_database_that_hangs_delays_results_and_the_supervisor_goes_on(
        database, tmp_path, start_worker):
    """The database behind a proxy that stops forwarding (a hung server): the children
    wait in their stores, the supervisor's loop does not (its health file stays fresh),
    not even for a store of its own (an expired task's REVOKED) or a running idempotent
    task's claim renewals; thawed, every result is stored and nothing ran twice."""
    require_service("Redis", 6379)
    celery = pytest.importorskip("celery")
    from tests.proxy import FreezableProxy

    from workhorse.daemon.hostfiles import health_path
    proxy = FreezableProxy(5432)
    hung = database.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    broker = make_broker("redis", tmp_path)
    app = celery.Celery("dbhang", broker=broker.url, backend=database)
    app.conf.task_default_queue = broker.queue
    try:
        # Claims renewed every 0.5 s: the supervisor renews a running idempotent task's.
        worker = start_worker(broker, result_backend=hung, hostname="hang@test",
                              visibility_timeout=2)
        first = app.send_task("tests.apps.basic.add", (1, 1))
        assert first.get(timeout=20) == 2
        claimed = app.send_task("tests.apps.basic.once", (8,))
        wait_until(lambda: any(name == "once" for name, _, _ in runs(tmp_path)), 20,
                   "the idempotent task running")
        proxy.freeze()
        # Expired on arrival: its REVOKED is the supervisor's own store, made off its loop.
        expired = app.send_task("tests.apps.basic.add", (1, 2),
                                expires=datetime.now(UTC) - timedelta(seconds=5))
        results = [app.send_task("tests.apps.basic.record") for _ in range(20)]
        wait_until(lambda: len(runs(tmp_path)) >= 2, 20, "tasks run into the hung store")
        worker.wait_for_log("expired", timeout=20)
        health = health_path(tmp_path / "state", "hang@test")
        frozen_at, written = time.monotonic(), set()
        while time.monotonic() - frozen_at < 6:
            found = json.loads(health.read_text())
            assert time.time() - found["written"] < 4, "the supervisor's loop stalled"
            written.add(found["written"])
            time.sleep(0.5)
        assert len(written) >= 2, "the health file was rewritten while the store hung"
        assert all(r.state == "PENDING" for r in results), [r.state for r in results]
        proxy.thaw()
        wait_until(lambda: all(r.state == "SUCCESS" for r in results), 60,
                   "the results stored once the database answers")
        wait_until(lambda: expired.state == "REVOKED", 30, "the expired task's REVOKED")
        assert claimed.get(timeout=30) == claimed.id
        ran = [task_id for name, task_id, _ in runs(tmp_path) if name == "record"]
        assert sorted(ran) == sorted(r.id for r in results)
        assert [name for name, _, _ in runs(tmp_path)].count("once") == 1
        assert worker.proc.poll() is None
    finally:
        proxy.close()
        app.close()
        broker.cleanup()
