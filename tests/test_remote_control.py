"""Remote control: Celery's broadcast mailbox answered by the supervisor. The replies'
formats (pure), then a real worker on each broker asked through Celery's client and
through ``workhorse inspect``."""
from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import replace
from types import SimpleNamespace

import pytest
from kombu import Producer

from workhorse.control import client as control_client
from workhorse.control.inspect import COMMANDS, TaskInfo, WorkerView

from workhorse.daemon.supervisor import REVOKES_READ_WAIT

from .conftest import ROOT, wait_until, worker_env
from .test_delivery import holds

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------- replies (pure)
def _task(task_id: str, **fields) -> TaskInfo:
    return TaskInfo(**{"id": task_id, "name": "tasks.add", "args": "(1, 2)", "kwargs": "{}",
                       "queue": "q", "redelivered": False, "priority": 0,
                       "acknowledged": False, **fields})


VIEW = WorkerView(
    hostname="w@h", pid=10, uptime=5.5, tasks=["tasks.b", "tasks.a"], queues=["q"],
    active=[_task("a1", time_start=100.0, worker_pid=11)], reserved=[_task("r1")],
    scheduled=[_task("s1", eta="2026-01-01T00:00:00+00:00")], totals={"tasks.add": 3},
    concurrency=2, child_pids=[11, 12], time_limits=(5.0, 10.0), prefetch_count=8,
    broker="redis://h/0", settings={"broker_url": "redis://u:***@h/0"})


def test_replies_have_celerys_shapes():
    assert COMMANDS["ping"](VIEW) == {"ok": "pong"}
    assert COMMANDS["registered"](VIEW) == ["tasks.a", "tasks.b"]
    active = COMMANDS["active"](VIEW)
    assert active == [{"id": "a1", "name": "tasks.add", "args": "(1, 2)", "kwargs": "{}",
                       "type": "tasks.add", "hostname": "w@h", "time_start": 100.0,
                       "acknowledged": False,
                       "delivery_info": {"exchange": "", "routing_key": "q", "priority": 0,
                                         "redelivered": False},
                       "worker_pid": 11}]
    assert [r["id"] for r in COMMANDS["reserved"](VIEW)] == ["r1"]
    scheduled = COMMANDS["scheduled"](VIEW)
    assert scheduled[0]["eta"] == "2026-01-01T00:00:00+00:00"
    assert scheduled[0]["request"]["id"] == "s1"
    assert {k: v[0] for k, v in COMMANDS["query_task"](VIEW, ids=["a1", "s1", "r1", "x"]
                                                      ).items()} == {
        "a1": "active", "s1": "scheduled", "r1": "reserved"}
    assert list(COMMANDS["query_task"](VIEW, ids="r1")) == ["r1"]
    assert [q["name"] for q in COMMANDS["active_queues"](VIEW)] == ["q"]
    stats = COMMANDS["stats"](VIEW)
    assert stats["total"] == {"tasks.add": 3} and stats["pool"]["processes"] == [11, 12]
    assert stats["pool"]["max-concurrency"] == 2 and stats["pool"]["timeouts"] == [5.0, 10.0]
    assert stats["prefetch_count"] == 8 and stats["rusage"]["utime"] >= 0
    assert "***" in COMMANDS["conf"](VIEW)["broker_url"]
    assert "w@h" in COMMANDS["report"](VIEW)["ok"]


def test_replies_carry_what_celerys_worker_gives_where_workhorse_has_it():
    """As Celery 5.7's worker: arguments as values (read from a JSON body), registered
    tasks with their attributes and without Celery's builtins, the logical clock, the
    timer priority of a scheduled task, the software line of the report, the settings
    by Celery's names too."""
    body = json.dumps([[1, {"x": 2}], {"z": 3}, {}])
    tasks = {"tasks.a": SimpleNamespace(name="tasks.a", rate_limit="5/s", exchange=None),
             "tasks.b": SimpleNamespace(name="tasks.b", rate_limit=None),
             "celery.chunks": SimpleNamespace(name="celery.chunks")}
    view = replace(VIEW, tasks=sorted(tasks), task_objects=tasks, clock=41,
                   active=[_task("a1", body=body, content_type="application/json")],
                   scheduled=[_task("s1", body="not json", content_type="application/json",
                                    eta="2026-01-01T00:00:00.500000+00:00")],
                   settings={"broker_url": "redis://u:***@h/0", "concurrency": 2})
    [active] = COMMANDS["active"](view)
    assert (active["args"], active["kwargs"]) == ([1, {"x": 2}], {"z": 3})
    [scheduled] = COMMANDS["scheduled"](view)
    assert scheduled["priority"] == 6 and scheduled["request"]["args"] == "(1, 2)"
    assert COMMANDS["registered"](view) == ["tasks.a [rate_limit=5/s]", "tasks.b"]
    assert COMMANDS["registered"](view, taskinfoitems=["name"]) == [
        "tasks.a [name=tasks.a]", "tasks.b [name=tasks.b]"]
    assert "celery.chunks" in COMMANDS["registered"](view, builtins=True)
    assert COMMANDS["clock"](view) == {"clock": 41}
    assert COMMANDS["report"](view)["ok"].startswith("software -> ")
    conf = COMMANDS["conf"](view)
    assert conf["worker_concurrency"] == 2 and "***" in conf["broker_url"]
    v1 = _task("p1", body=json.dumps({"args": [7], "kwargs": {}}),
               content_type="application/json")
    assert v1.arguments() == ([7], {})


def test_command_line_arguments_are_checked():
    assert control_client.arguments("ping", []) == {}
    assert control_client.arguments("query_task", ["a", "b"]) == {"ids": ["a", "b"]}
    with pytest.raises(ValueError, match="no such command: 'pong'"):
        control_client.arguments("pong", [])
    with pytest.raises(ValueError, match="ping takes no arguments"):
        control_client.arguments("ping", ["x"])


# ---------------------------------------------------------------- a real worker
def inspect_cli(broker, tmp_path, *args):
    env = worker_env(broker, tmp_path)
    return subprocess.run([sys.executable, "-m", "workhorse", "inspect", *args], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def celery_app(broker):
    celery = pytest.importorskip("celery")
    from workhorse.transport import register
    register()                          # sqlite:// URLs: workhorse's transport
    app = celery.Celery("inspector", broker=broker.url)
    app.conf.task_default_queue = broker.queue
    return app


def test_inspect_through_celerys_client_and_workhorses_cli(broker, start_worker, tmp_path):
    hostname = f"rc-{uuid.uuid4().hex[:8]}@test"
    start_worker(broker, hostname=hostname)
    app = celery_app(broker)
    gate = tmp_path / "gate"
    try:
        running = app.send_task("tests.apps.basic.gate", (str(gate), 1))
        waiting = app.send_task("tests.apps.basic.add", (1, 2), countdown=60)
        inspect = app.control.inspect(destination=[hostname], timeout=10)
        assert inspect.ping() == {hostname: {"ok": "pong"}}

        def active_ids():
            return [t["id"] for t in (inspect.active() or {}).get(hostname, [])]
        wait_until(lambda: active_ids() == [running.id], 20, "the gate task listed as active")
        [active] = inspect.active()[hostname]
        pids = inspect.stats()[hostname]["pool"]["processes"]
        assert active["name"] == "tests.apps.basic.gate" and active["worker_pid"] in pids
        assert active["time_start"] and active["args"] == [str(gate), 1]
        assert inspect.clock()[hostname]["clock"] > 0
        wait_until(lambda: (inspect.scheduled() or {}).get(hostname), 20, "the ETA task")
        assert [s["request"]["id"] for s in inspect.scheduled()[hostname]] == [waiting.id]
        found = inspect.query_task([running.id, waiting.id, "nobody"])[hostname]
        assert {k: v[0] for k, v in found.items()} == {running.id: "active",
                                                      waiting.id: "scheduled"}
        assert "tests.apps.basic.add" in inspect.registered()[hostname]
        assert [q["name"] for q in inspect.active_queues()[hostname]] == [broker.queue]

        cli = inspect_cli(broker, tmp_path, "query_task", running.id, "-d", hostname,
                          "--json", "--timeout", "10")
        assert cli.returncode == 0, cli.stderr
        assert json.loads(cli.stdout)[hostname][running.id][0] == "active"
        nobody = inspect_cli(broker, tmp_path, "ping", "-d", "nobody@nowhere", "--timeout",
                             "0.5")
        assert nobody.returncode == 1 and "no worker replied" in nobody.stderr
    finally:
        gate.touch()
        app.close()


def test_malformed_commands_are_logged_and_dropped(broker, start_worker, tmp_path):
    hostname = f"rc-{uuid.uuid4().hex[:8]}@test"
    worker = start_worker(broker, hostname=hostname)
    app = celery_app(broker)
    try:
        inspect = app.control.inspect(destination=[hostname], timeout=10)
        assert inspect.ping() == {hostname: {"ok": "pong"}}
        pidbox = control_client.mailbox().exchange       # as Celery's clients declare it
        with broker.connection() as connection:
            producer = Producer(connection.default_channel)
            for body in ("not a command", {"method": 42}, {"method": "ping",
                                                           "arguments": "not a mapping"},
                         {"method": "no_such_command", "arguments": {}}):
                producer.publish(body, exchange=pidbox, declare=[pidbox],
                                 serializer="json")
        worker.wait_for_log("dropped a malformed command", count=3)
        worker.wait_for_log("command 'no_such_command' failed: KeyError")
        assert inspect.ping() == {hostname: {"ok": "pong"}}
    finally:
        app.close()


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_remote_control_can_be_switched_off(broker, start_worker, tmp_path):
    hostname = f"rc-{uuid.uuid4().hex[:8]}@test"
    start_worker(broker, hostname=hostname, remote_control=False)
    app = celery_app(broker)
    try:
        assert app.control.inspect(destination=[hostname], timeout=1).ping() is None
    finally:
        app.close()


def test_children_are_forked_only_while_the_control_thread_is_parked():
    """The fork gate: False while the control thread holds its gate (connecting, replying),
    True while it waits for commands or is not running."""
    import threading

    from workhorse.broker.thread import parked
    gate = threading.Lock()
    holding, release = threading.Event(), threading.Event()

    def busy() -> None:
        with gate:
            holding.set()
            release.wait(10)
    thread = threading.Thread(target=busy)
    with parked(thread, gate) as free:
        assert free                              # not started: nothing to wait for
    thread.start()
    holding.wait(10)
    with parked(thread, gate) as free:
        assert not free
    release.set()
    thread.join(10)
    with parked(thread, gate) as free:
        assert free


@pytest.mark.parametrize("polled", [True, False], ids=["polled (SQLite)", "select (Redis, AMQP)"])
def test_a_polled_broker_is_read_with_the_fork_gate_held(polled):
    """SQLite's connection "waits" for commands by reading the file every 50 ms. A child
    forked while the control thread was inside SQLite inherited SQLite's process-wide locks
    held and hung in its first connect, the task it ran with it (test_signals' reload test
    failed so in two CI runs). Each read is made with the gate held; the thread parks only
    between reads. A connection that waits in select() is waited on parked."""
    from types import SimpleNamespace

    from workhorse.daemon.control import ControlThread
    thread = ControlThread(None, "gate@test", view=lambda: None,  # type: ignore[arg-type]
                           steerable=None, revokes_read=lambda _: None,  # type: ignore[arg-type]
                           where="test")
    held_while_reading: list[bool] = []

    def drain_events(timeout: float) -> None:
        held_while_reading.append(thread.gate.locked())
        if not polled:
            time.sleep(timeout)
        raise TimeoutError
    connection = SimpleNamespace(drain_events=drain_events, transport=SimpleNamespace(
        polling_interval=0.01 if polled else None))
    forked: list[bool] = []

    def fork_meanwhile() -> None:           # the loop thread's try, as it would fork
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not forked:
            if thread.gate.acquire(timeout=0.002):
                forked.append(True)
                thread.gate.release()
    other = threading.Thread(target=fork_meanwhile)
    thread.gate.acquire()                   # the control thread holds it but to wait
    other.start()
    try:
        thread._wait(connection, 0.3)
    finally:
        thread.gate.release()
        other.join(10)
    assert forked, "the thread never parked while it waited"
    if polled:
        assert len(held_while_reading) >= 5 and all(held_while_reading)
    else:
        assert held_while_reading == [False]


class _SlowGate:
    """A fork gate whose release takes ``delay``: the control thread descheduled each time
    it is about to wait for commands (a loaded machine)."""

    def __init__(self, delay: float) -> None:
        self._lock = threading.Lock()
        self.delay = delay

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        time.sleep(self.delay)
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def test_a_command_sent_as_soon_as_the_worker_is_ready_reaches_it(broker, client):
    """The worker says it is ready once remote control has read the revokes kept in the
    store. A command sent right then must arrive even if the control thread is descheduled
    before it waits: on Redis, whose mailbox is pub/sub, kombu subscribed only when it first
    waited, and such a command was lost (the two CI failures of stop 21)."""
    from workhorse.daemon.control import ControlThread
    commands: queue.SimpleQueue[str] = queue.SimpleQueue()
    revokes_read: queue.SimpleQueue[object] = queue.SimpleQueue()

    class Recording(ControlThread):
        def answer(self, method: str, arguments: dict) -> object:
            commands.put(method)
            return "noted"

    hostname = f"ready-{uuid.uuid4().hex[:8]}@test"
    thread = Recording(client, hostname, view=lambda: None, steerable=None,  # type: ignore[arg-type]
                       revokes_read=revokes_read.put, where=broker.kind)
    thread.gate = _SlowGate(0.5)        # type: ignore[assignment]
    thread.thread.start()
    try:
        def ready() -> bool:            # the loop's part: run what the thread posts
            thread.run_posted()
            return not revokes_read.empty()
        wait_until(ready, 30, "the revokes read (the worker's ready)")
        app = celery_app(broker)
        try:
            app.control.broadcast("ping", destination=[hostname])
        finally:
            app.close()
        assert commands.get(timeout=10) == "ping"
    finally:
        thread.stop(10)
        assert not thread.thread.is_alive()


def test_pool_time_limit_and_shutdown_through_celerys_client_and_workhorses_cli(
        broker, start_worker, client, tmp_path):
    from .test_revoke import control_cli
    hostname = f"rc-{uuid.uuid4().hex[:8]}@test"
    worker = start_worker(broker, hostname=hostname, concurrency=1)
    app = celery_app(broker)
    ask = {"reply": True, "timeout": 5, "destination": [hostname]}
    try:
        inspect = app.control.inspect(destination=[hostname], timeout=10)

        def pool() -> list[int]:
            return ((inspect.stats() or {}).get(hostname) or {}).get("pool", {}).get(
                "processes", [])
        assert app.control.pool_grow(2, **ask) == [{hostname: {"ok": "pool will grow"}}]
        wait_until(lambda: len(pool()) == 3, 20, "three children")
        assert app.control.pool_shrink(1, **ask) == [{hostname: {"ok": "pool will shrink"}}]
        wait_until(lambda: len(pool()) == 2, 20, "two children")
        assert inspect.stats()[hostname]["prefetch_count"] == 2 * 4
        [error] = app.control.pool_shrink(5, **ask)
        assert "the pool stays at 2 children" in error[hostname]["error"]

        assert app.control.time_limit("tests.apps.basic.sleeper", hard=1, **ask) == [
            {hostname: {"ok": "time limits set successfully"}}]
        limited = app.send_task("tests.apps.basic.sleeper", (30,))
        wait_until(lambda: client.AsyncResult(limited.id).state == "FAILURE", 20,
                   "the new hard limit to fail the task")
        assert "TimeLimitExceeded" in repr(client.AsyncResult(limited.id).result)
        assert app.control.time_limit("tests.apps.basic.nope", hard=1, **ask) == [
            {hostname: {"error": "unknown task tests.apps.basic.nope"}}]

        cli = control_cli(broker, tmp_path, "shutdown", "-d", hostname, "--json",
                          "--timeout", "10")
        assert cli.returncode == 0, cli.stderr
        assert json.loads(cli.stdout) == {hostname: {"ok": "shutting down"}}
        assert worker.wait_exit(30) == 0
        worker.wait_for_log("warm shutdown \\(remote control: Got shutdown from remote\\)")
    finally:
        app.close()


def test_add_and_cancel_consumer_through_celerys_client_and_workhorses_cli(
        broker, start_worker, client, tmp_path):
    from .test_revoke import control_cli
    hostname = f"rc-{uuid.uuid4().hex[:8]}@test"
    start_worker(broker, hostname=hostname)
    app = celery_app(broker)
    extra = f"{broker.queue}-extra"
    broker.extra_queues.append(extra)                 # deleted after the test
    ask = {"reply": True, "timeout": 10, "destination": [hostname]}
    try:
        inspect = app.control.inspect(destination=[hostname], timeout=10)
        assert app.control.add_consumer(extra, **ask) == [{hostname: {
            "ok": f"add consumer {extra}"}}]
        assert app.control.add_consumer(extra, **ask) == [{hostname: {
            "ok": f"already consuming from {extra!r}"}}]
        assert sorted(q["name"] for q in inspect.active_queues()[hostname]) == sorted(
            [broker.queue, extra])
        assert client.send_task("tests.apps.basic.add", (1, 2), queue=extra).get(
            timeout=30) == 3

        assert app.control.cancel_consumer(extra, **ask) == [{hostname: {
            "ok": f"no longer consuming from {extra}"}}]
        assert app.control.cancel_consumer(extra, **ask) == [{hostname: {
            "error": f"not consuming from {extra!r}"}}]
        left = client.send_task("tests.apps.basic.add", (3, 4), queue=extra)
        assert client.send_task("tests.apps.basic.add", (5, 6)).get(timeout=30) == 11
        assert broker.queue_size(extra) == 1          # waits, untouched, in its queue
        assert client.AsyncResult(left.id).state == "PENDING"

        cli = control_cli(broker, tmp_path, "add_consumer", extra, "-d", hostname, "--json",
                          "--timeout", "10")
        assert cli.returncode == 0, cli.stderr
        assert json.loads(cli.stdout) == {hostname: {"ok": f"add consumer {extra}"}}
        assert left.get(timeout=30) == 7
        bad = control_cli(broker, tmp_path, "add_consumer")
        assert bad.returncode == 2 and "one queue name" in bad.stderr
    finally:
        app.close()


@pytest.mark.parametrize("broker", ["amqp"], indirect=True)
def test_a_second_worker_of_the_same_name_says_so_and_still_runs_tasks(broker, start_worker,
                                                                       client):
    """RabbitMQ gives a mailbox queue to one worker of a name: the second cannot answer
    remote control. It says why and what to do, and does not wait for the revokes its
    mailbox would have read before consuming."""
    hostname = f"twin-{uuid.uuid4().hex[:8]}@test"
    start_worker(broker, hostname=hostname)
    twin = start_worker(broker, hostname=hostname, ready=False)
    twin.wait_for_log(f"another worker named {hostname} answers its mailbox already")
    twin.wait_ready()
    results = [client.send_task("tests.apps.basic.add", (n, n)) for n in range(20)]
    assert [r.get(timeout=30) for r in results] == [2 * n for n in range(20)]
    holds(lambda: "has not read the revoked tasks" not in twin.log(), REVOKES_READ_WAIT + 1,
          "the twin read the revokes kept in the store, without its mailbox")
