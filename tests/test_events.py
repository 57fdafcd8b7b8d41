"""Celery's event stream: the events each outcome gives (pure), then a real worker watched
by the real tools: ``celery events --dump`` and Flower's HTTP API, and task events
switched on and off by remote control."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from workhorse.control.events import event, utcoffset
from workhorse.daemon.events import settled_event
from workhorse.outcome import Outcome, Policy, decide

from .conftest import ROOT, wait_until
from .test_remote_control import celery_app

pytestmark = pytest.mark.timeout(120)


@contextlib.contextmanager
def receiving(app) -> Iterator[list[dict]]:
    """Every event on ``app``'s broker, in a list that grows while the block runs."""
    seen: list[dict] = []
    connection = app.connection()
    receiver = app.events.Receiver(connection, handlers={"*": seen.append})
    listener = threading.Thread(target=receiver.capture, kwargs={"wakeup": False},
                                daemon=True)
    listener.start()
    try:
        yield seen
    finally:
        receiver.should_stop = True
        listener.join(10)
        connection.close()


# ---------------------------------------------------------------- events (pure)
def _settled(outcome, detail=None, done=None, policy=None):
    delivery = SimpleNamespace(done=done)
    decision = decide(outcome, policy or Policy(), started=True, deliveries=1)
    return settled_event(delivery, outcome, decision, detail)  # type: ignore[arg-type]


def test_each_outcome_gives_celerys_event():
    done = SimpleNamespace(result="42", runtime=0.25, traceback="Traceback ...")
    assert _settled(Outcome.SUCCEEDED, done=done) == (
        "task-succeeded", {"result": "42", "runtime": 0.25})
    assert _settled(Outcome.FAILED, "ValueError('x')", done=done) == (
        "task-failed", {"exception": "ValueError('x')", "traceback": "Traceback ..."})
    assert _settled(Outcome.TIME_LIMIT, "hard time limit (1 s) exceeded")[0] == "task-failed"
    assert _settled(Outcome.RETRY, "Retry in 5s")[0] == "task-retried"
    assert _settled(Outcome.CHILD_LOST, "killed") == ("task-rejected", {"requeue": True})
    assert _settled(Outcome.CHILD_LOST, "killed", policy=Policy(
        reject_on_worker_lost=False))[0] == "task-failed"
    assert _settled(Outcome.REJECTED) == ("task-rejected", {"requeue": False})
    assert _settled(Outcome.TERMINATED, "revoked with terminate (SIGKILL)") == (
        "task-revoked", {"terminated": True, "signum": "SIGKILL", "expired": False})
    assert _settled(Outcome.EXPIRED)[1]["expired"] is True
    assert _settled(Outcome.REVOKED)[0] == "task-revoked"
    for quiet in (Outcome.IGNORED, Outcome.ALREADY_DONE, Outcome.CLAIMED_ELSEWHERE,
                  Outcome.NOT_RUN, Outcome.MALFORMED, Outcome.UNKNOWN_TASK):
        assert _settled(quiet) is None, quiet


def test_an_event_has_the_fields_celerys_have():
    found = event("task-started", "w@h", 7, uuid="u")
    assert found["type"] == "task-started" and found["hostname"] == "w@h"
    assert found["clock"] == 7 and found["pid"] == os.getpid() and found["uuid"] == "u"
    assert abs(found["timestamp"] - time.time()) < 5
    assert found["utcoffset"] == utcoffset() and isinstance(found["utcoffset"], int)


# ---------------------------------------------------------------- the real tools
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _celery(broker, *args: str, out=None, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "celery", "-b", broker.url, *args],
                            cwd=ROOT, stdout=out or subprocess.DEVNULL,
                            stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                            start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(10)


@pytest.mark.parametrize("broker", ["redis", "amqp"], indirect=True)
def test_celery_events_dump_sees_the_worker_and_its_tasks(broker, start_worker, client,
                                                          tmp_path):
    hostname = f"ev-{uuid.uuid4().hex[:8]}@test"
    dump = tmp_path / "dump.log"
    with open(dump, "w") as out:
        watcher = _celery(broker, "events", "--dump", out=out)
    app = celery_app(broker)
    try:
        # Bound once it shows an event of ours; only then is the worker started, so its
        # worker-online cannot go out before anyone listens.
        with app.connection() as connection:
            probe = app.events.Dispatcher(connection, hostname="probe@test")

            def listening() -> bool:
                assert watcher.poll() is None, dump.read_text()
                probe.send("worker-heartbeat")      # seen by the next look, once bound
                return "probe@test" in dump.read_text()
            wait_until(listening, 30, "celery events to listen", interval=0.2)
            probe.close()
        worker = start_worker(broker, hostname=hostname, send_events=True)
        ok = client.send_task("tests.apps.basic.add", (2, 3))
        bad = client.send_task("tests.apps.basic.fail", ("boom",))
        assert ok.get(timeout=30) == 5
        with pytest.raises(Exception, match="boom"):
            bad.get(timeout=30)

        def seen(*words: str) -> bool:
            return any(all(w in line for w in words) for line in dump.read_text().splitlines())
        wait_until(lambda: seen(hostname, "started:", "sw_ident=py-workhorse"), 20,
                   "worker-online")
        wait_until(lambda: seen(hostname, "heartbeat:", "freq=2.0"), 20, "a heartbeat")
        wait_until(lambda: seen(hostname, "task received:", ok.id, "args=(2, 3)"), 20,
                   "task-received")
        wait_until(lambda: seen(hostname, "task started:", ok.id), 20, "task-started")
        wait_until(lambda: seen(hostname, "task succeeded:", ok.id, "result=5", "runtime="),
                   20, "task-succeeded")
        wait_until(lambda: seen(hostname, "task failed:", bad.id, "boom"), 20, "task-failed")
        worker.stop()
        wait_until(lambda: seen(hostname, "shutdown:"), 20, "worker-offline")
    finally:
        app.close()
        _stop(watcher)


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_task_events_follow_enable_and_disable_events(broker, start_worker, client):
    hostname = f"ev-{uuid.uuid4().hex[:8]}@test"
    start_worker(broker, hostname=hostname)                 # task events off by default
    app = celery_app(broker)
    ask = {"reply": True, "timeout": 5, "destination": [hostname]}
    with contextlib.closing(app), receiving(app) as seen:

        def kinds() -> set[str]:
            return {e["type"] for e in list(seen) if e.get("hostname") == hostname}

        def heartbeats() -> int:
            return sum(1 for e in list(seen) if e["type"] == "worker-heartbeat")

        def assert_no_task_events(n: int) -> None:
            """A task runs; a heartbeat sent after it has come, and no task event before it."""
            assert client.send_task("tests.apps.basic.add", (n, n)).get(timeout=30) == 2 * n
            before = heartbeats()
            wait_until(lambda: heartbeats() > before, 20, "the next heartbeat")
            assert not {k for k in kinds() if k.startswith("task-")}
        wait_until(lambda: "worker-heartbeat" in kinds(), 20, "a heartbeat")
        assert_no_task_events(1)
        assert app.control.enable_events(**ask) == [{hostname: {"ok": "task events enabled"}}]
        assert app.control.enable_events(**ask) == [{hostname: {
            "ok": "task events already enabled"}}]
        loud = client.send_task("tests.apps.basic.add", (2, 2))
        assert loud.get(timeout=30) == 4
        wait_until(lambda: {"task-received", "task-started", "task-succeeded"} <= kinds(), 20,
                   "the task's events")
        assert app.control.disable_events(**ask) == [{hostname: {"ok": "task events disabled"}}]
        seen.clear()
        assert app.control.heartbeat(**ask) == [{hostname: {"ok": "heartbeat sent"}}]
        wait_until(lambda: "worker-heartbeat" in kinds(), 20, "the heartbeat asked for")
        assert_no_task_events(3)


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_flower_lists_the_worker_and_its_tasks(broker, start_worker, client, tmp_path):
    pytest.importorskip("flower")
    hostname = f"fl-{uuid.uuid4().hex[:8]}@test"
    start_worker(broker, hostname=hostname, send_events=True)
    port = _free_port()
    log = tmp_path / "flower.log"
    with open(log, "w") as out:
        flower = _celery(broker, "flower", f"--port={port}", "--address=127.0.0.1",
                         out=out, env={"FLOWER_UNAUTHENTICATED_API": "true"})

    def api(path: str):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
                return json.loads(r.read())
        except OSError:
            return None
    try:
        wait_until(lambda: api("/api/workers") is not None or flower.poll() is not None,
                   60, "Flower to listen")
        assert flower.poll() is None, log.read_text()
        workers = wait_until(lambda: (api("/api/workers?refresh=1") or {}).get(hostname),
                             30, "Flower to list the worker")
        assert workers["stats"]["pool"]["implementation"] == "workhorse.prefork"
        assert "tests.apps.basic.add" in workers["registered"]
        # The list above comes from inspect; task events reach Flower only once its event
        # receiver listens (a Redis subscription): it has when it has seen a heartbeat.
        wait_until(lambda: (api("/api/workers?status=1") or {}).get(hostname), 30,
                   "Flower to receive the worker's events")
        ok = client.send_task("tests.apps.basic.add", (20, 22))
        bad = client.send_task("tests.apps.basic.fail", ("no luck",))
        assert ok.get(timeout=30) == 42

        def states():
            tasks = api("/api/tasks") or {}
            return {task_id: tasks.get(task_id, {}).get("state") for task_id in (ok.id, bad.id)}
        wait_until(lambda: states() == {ok.id: "SUCCESS", bad.id: "FAILURE"}, 30,
                   "Flower to show the tasks' states")
        task = api(f"/api/task/info/{ok.id}")
        assert task["name"] == "tests.apps.basic.add" and task["worker"] == hostname
        assert task["result"] == "42" and task["args"] == "(20, 22)"
    finally:
        _stop(flower)


@pytest.mark.parametrize("broker", ["sqlite"], indirect=True)
def test_a_monitor_on_the_sqlite_broker_sees_events_through_workhorses_transport(
        broker, start_worker, client):
    hostname = f"ev-{uuid.uuid4().hex[:8]}@test"
    app = celery_app(broker)                  # registers workhorse's sqlite:// transport
    with contextlib.closing(app), receiving(app) as seen:
        with app.connection() as probing:
            probe = app.events.Dispatcher(probing, hostname="probe@test")

            def listening() -> bool:              # bound once it sees a probe of ours
                probe.send("worker-heartbeat")
                return any(e.get("hostname") == "probe@test" for e in list(seen))
            wait_until(listening, 20, "the receiver to listen", interval=0.2)
            probe.close()
        start_worker(broker, hostname=hostname, send_events=True)
        done = client.send_task("tests.apps.basic.add", (4, 4))
        assert done.get(timeout=30) == 8
        wait_until(lambda: any(e.get("uuid") == done.id and e["type"] == "task-succeeded"
                               for e in list(seen)), 20, "task-succeeded on SQLite")
        mine = [e["type"] for e in list(seen) if e.get("hostname") == hostname]
        assert mine[0] == "worker-online", mine     # before any task's event
