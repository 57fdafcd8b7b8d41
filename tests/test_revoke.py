"""Revokes: the revoked set and the control commands (pure), the shared store on each
result backend, then a real worker on each broker revoked through Celery's client and
``workhorse control``: a revoked task never runs, a terminated one is not run again, and a
worker started later knows what was revoked before it came."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid

import pytest

from workhorse.backends import backend_from_url
from workhorse.control import client as control_client
from workhorse.control import commands
from workhorse.control.commands import RevokeResult
from workhorse.control.revoked import Revoked
from workhorse.outcome import Action, Decision, Outcome, Policy, Store, decide

from .conftest import ROOT, process_gone, runs, wait_until, worker_env
from .test_remote_control import celery_app

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------- the revoked set (pure)
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_revoked_ids_match_until_they_expire_and_the_oldest_go_first():
    clock = Clock()
    revoked = Revoked(clock, maxlen=3, expires=10)
    assert not revoked and revoked.match("a", {}) is None
    entries = revoked.revoke_ids(["a", "b"])
    assert entries == {"id:a": 1010.0, "id:b": 1010.0}
    assert revoked.match("a", {}) == "revoked" and revoked.match("c", {}) is None
    clock.now = 1005
    revoked.revoke_ids(["c", "d"])                 # four ids, room for three: "a" goes
    assert revoked.ids() == ["b", "c", "d"]
    clock.now = 1011
    assert revoked.match("b", {}) is None and revoked.ids() == ["c", "d"]
    clock.now = 1016
    assert revoked.ids() == [] and revoked.match("c", {}) is None


def test_merged_entries_keep_the_later_expiry_and_skip_what_they_cannot_read():
    clock = Clock()
    revoked = Revoked(clock, expires=10)
    revoked.merge({"id:a": 1050.0, "id:gone": 999.0, "stamp:not json": 1050.0,
                   "stamp:[1]": 1050.0, "other": 1050.0})
    revoked.merge({"id:a": 1020.0})
    assert revoked.ids() == ["a"]
    clock.now = 1030
    assert revoked.match("a", {}) == "revoked"
    assert revoked.stamps() == {}


def _stamped(**stamps):
    return {"stamped_headers": list(stamps), "stamps": stamps}


def test_stamped_headers_match_a_value_or_any_value_of_a_list():
    revoked = Revoked(Clock(), expires=10)
    revoked.revoke_stamps({"monitoring_id": ["m1", 4242], "team": "ops"})
    assert revoked.match("x", _stamped(monitoring_id="m1")) == (
        "revoked by stamped header monitoring_id='m1'")
    assert revoked.match("x", _stamped(monitoring_id=4242))
    assert revoked.match("x", _stamped(monitoring_id=["zz", "m1"]))
    assert revoked.match("x", _stamped(team="ops"))
    assert revoked.match("x", _stamped(monitoring_id="m2")) is None
    assert revoked.match("x", _stamped(monitoring_id=None)) is None
    # Named, but not among the message's stamped headers; or no stamps at all.
    assert revoked.match("x", {"stamped_headers": [], "stamps": {"team": "ops"}}) is None
    assert revoked.match("x", {"stamps": "garbage", "stamped_headers": ["team"]}) is None
    assert revoked.stamps() == {"monitoring_id": ["m1", 4242], "team": ["ops"]}


# ---------------------------------------------------------------- settling (pure)
def test_a_revoked_task_is_acked_with_revoked_stored_and_never_requeued():
    acked_revoked = Decision(Action.ACK, Store.REVOKED)
    for policy in (Policy(), Policy(acks_late=False)):
        assert decide(Outcome.REVOKED, policy, started=False) == acked_revoked
    assert decide(Outcome.TERMINATED, Policy(), started=True, deliveries=3) == acked_revoked
    assert decide(Outcome.TERMINATED, Policy(acks_late=False), started=True) == Decision(
        Action.NONE, Store.REVOKED)


# ---------------------------------------------------------------- commands (pure)
class FakeWorker:
    hostname = "w@h"

    def __init__(self, held=(), terminated=(), states=None):
        self.result = RevokeResult(held=frozenset(held), terminated=list(terminated))
        self.states = states or {}
        self.shared, self.marked, self.revokes = {}, [], []
        self.size, self.limits, self.stopping = 2, {}, None

    def pool_size(self):
        return self.size

    def resize_pool(self, size, why):
        if not 1 <= size <= 1024:
            raise ValueError(f"the pool stays at {self.size} children")
        self.size = size

    def set_time_limits(self, task, soft, hard):
        if task != "known":
            return False
        self.limits[task] = (soft, hard)
        return True

    def warm_shutdown(self, why):
        self.stopping = why

    def steer(self, function):            # the worker is its own loop thread here
        return function(self)

    def revoke(self, entries, terminate, sig):
        self.revokes.append((entries, terminate, sig))
        return self.result

    def share_revoked(self, entries):
        self.shared.update(entries)

    def state_of(self, task_id):
        return self.states.get(task_id, "PENDING")

    def mark_revoked(self, task_id, reason):
        self.marked.append(task_id)


def test_revoke_marks_revoked_only_what_nobody_has_started():
    worker = FakeWorker(held={"here"}, states={"elsewhere": "STARTED", "progress": "PROGRESS",
                                               "done": "SUCCESS", "retrying": "RETRY"})
    reply = commands.revoke(worker, ["here", "elsewhere", "progress", "done", "retrying",
                                     "new"])
    assert reply["ok"].startswith("tasks {") and reply["ok"].endswith("} flagged as revoked")
    assert worker.marked == ["retrying", "new"]
    assert set(worker.shared) == {f"id:{i}" for i in ("here", "elsewhere", "progress", "done",
                                                      "retrying", "new")}
    [(entries, terminate, sig)] = worker.revokes
    assert entries == worker.shared and not terminate and sig == signal.SIGTERM


def test_revoke_with_terminate_says_what_it_terminated():
    worker = FakeWorker(held={"a"}, terminated=["a"])
    assert commands.revoke(worker, "a", terminate=True, signal="KILL") == {
        "ok": "terminate: a"}
    assert worker.revokes[0][1:] == (True, signal.SIGKILL)
    assert commands.revoke(FakeWorker(), "b", terminate=True) == {
        "ok": "terminate: tasks unknown"}


def test_revoke_by_stamped_headers_answers_as_celery_does():
    worker = FakeWorker()
    reply = commands.revoke_by_stamped_headers(worker, {"myheader": ["myvalue"]})
    assert reply == {"ok": "headers {'myheader': ['myvalue']} flagged as revoked, but not "
                           "terminated"}
    assert list(worker.shared) == ['stamp:["myheader", "myvalue"]']
    words = commands.revoke_by_stamped_headers(FakeWorker(), ["a=1", "b=2"], terminate=True)
    assert words == {"ok": "headers ['a=1', 'b=2'] were not terminated"}


@pytest.mark.parametrize("call, message", [
    (lambda w: commands.revoke(w, None), "task_id must be"),
    (lambda w: commands.revoke(w, [1, 2]), "task_id must be"),
    (lambda w: commands.revoke(w, "a", terminate=True, signal="NOPE"), "no such signal"),
    (lambda w: commands.revoke(w, "a", signal=9999), "no such signal"),
    (lambda w: commands.revoke_by_stamped_headers(w, ["novalue"]), "key=value"),
    (lambda w: commands.revoke_by_stamped_headers(w, {}), "headers must map"),
])
def test_malformed_revokes_are_refused_naming_what_is_wrong(call, message):
    worker = FakeWorker()
    with pytest.raises(ValueError, match=message):
        call(worker)
    assert worker.revokes == [] and worker.shared == {}


def test_pool_time_limit_and_shutdown_commands():
    worker = FakeWorker()
    assert commands.pool_grow(worker, n=3) == {"ok": "pool will grow"} and worker.size == 5
    assert commands.pool_shrink(worker) == {"ok": "pool will shrink"} and worker.size == 4
    with pytest.raises(ValueError, match="pool stays at 4"):
        commands.pool_shrink(worker, n=4)
    with pytest.raises(ValueError, match="at least 1"):
        commands.pool_grow(worker, n=0)
    assert commands.time_limit(worker, "known", soft=10, hard="20") == {
        "ok": "time limits set successfully"}
    assert worker.limits == {"known": (10.0, 20.0)}
    assert commands.time_limit(worker, "nope", 1, 2) == {"error": "unknown task nope"}
    with pytest.raises(ValueError, match="soft must be a number of seconds"):
        commands.time_limit(worker, "known", soft="soon")
    assert commands.shutdown(worker) == {"ok": "shutting down"}
    assert worker.stopping == "remote control: Got shutdown from remote"


def test_control_command_lines_are_checked_before_anything_is_sent():
    args = control_client.control_arguments
    assert args("revoke", ["a", "b"], terminate=True, signal="KILL") == {
        "task_id": ["a", "b"], "terminate": True, "signal": "KILL"}
    assert args("revoke_by_stamped_headers", ["k=v"]) == {
        "headers": {"k": ["v"]}, "terminate": False, "signal": None}
    assert args("pool_grow", []) == {"n": 1} and args("pool_shrink", ["2"]) == {"n": 2}
    assert args("time_limit", ["t", "5", "10"]) == {"task_name": "t", "soft": "5",
                                                    "hard": "10"}
    assert args("shutdown", []) == {}
    for command, values, kwargs, message in [
            ("revoke", [], {}, "needs the task ids"), ("nope", [], {}, "no such command"),
            ("revoke", ["a"], {"signal": "NOPE"}, "no such signal"),
            ("shutdown", [], {"terminate": True}, "go with revoke"),
            ("pool_grow", ["x"], {}, "whole number"), ("shutdown", ["x"], {}, "no arguments"),
            ("time_limit", ["t", "x"], {}, "soft must be")]:
        with pytest.raises(ValueError, match=message):
            args(command, values, **kwargs)


def test_signals_are_read_by_name_or_number():
    assert commands.signum(None) == signal.SIGTERM
    assert commands.signum("term") == commands.signum("SIGTERM") == signal.SIGTERM
    assert commands.signum("9") == commands.signum(9) == signal.SIGKILL


# ---------------------------------------------------------------- the shared store
@pytest.fixture(params=["sqlite", "redis"])
def store(request, tmp_path):
    if request.param == "sqlite":
        backend = backend_from_url(f"sqlite:///{tmp_path / 'results.sqlite3'}")
        yield backend
    else:
        from .conftest import REDIS_URL, require_service
        require_service("Redis", 6379)
        backend = backend_from_url(REDIS_URL.rsplit("/", 1)[0] + "/9")
        backend.client.delete("workhorse-revoked")
        yield backend
        backend.client.delete("workhorse-revoked")
    backend.close()


def test_the_store_keeps_revoked_entries_until_they_expire(store, monkeypatch):
    now = time.time()
    store.save_revoked({"id:a": now + 100, "id:b": now + 0.3, 'stamp:["h", 1]': now + 100})
    store.save_revoked({"id:a": now + 50})               # an earlier expiry: ignored
    loaded = store.load_revoked()
    assert set(loaded) == {"id:a", "id:b", 'stamp:["h", 1]'}
    assert loaded["id:a"] == pytest.approx(now + 100)
    wait_until(lambda: "id:b" not in store.load_revoked(), 5, "id:b to expire")
    module = sys.modules[type(store).__module__]
    monkeypatch.setattr(module, "REVOKES_MAX", 2)
    store.save_revoked({"id:c": now + 200, "id:d": now + 300})
    assert set(store.load_revoked()) == {"id:c", "id:d"}    # the soonest to expire went


# ---------------------------------------------------------------- a real worker
def control_cli(broker, tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "workhorse", "control", *args],
                          env=worker_env(broker, tmp_path), cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def _state(app, task_id):
    return app.AsyncResult(task_id).state


def test_revoked_waiting_tasks_never_run_and_a_terminated_one_is_not_run_again(
        broker, start_worker, client, tmp_path):
    hostname = f"rv-{uuid.uuid4().hex[:8]}@test"
    worker = start_worker(broker, hostname=hostname, concurrency=1, prefetch_multiplier=4)
    celery = celery_app(broker)
    try:
        running = celery.send_task("tests.apps.basic.sleeper", (60,))
        buffered = celery.send_task("tests.apps.basic.record", ())
        eta = celery.send_task("tests.apps.basic.record", (), countdown=3600)
        inspect = celery.control.inspect(destination=[hostname], timeout=10)
        wait_until(lambda: [t["id"] for t in (inspect.active() or {}).get(hostname, [])]
                   == [running.id], 20, "the sleeper to run")
        wait_until(lambda: (inspect.scheduled() or {}).get(hostname), 20, "the ETA task")
        wait_until(lambda: (inspect.reserved() or {}).get(hostname), 20, "the buffered task")
        pidfile = tmp_path / "grandchild.pid"
        grandchild = int(wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(),
                                    10, "the sleeper's grandchild"))

        replies = celery.control.revoke([buffered.id, eta.id], reply=True, timeout=5,
                                        destination=[hostname])
        assert "flagged as revoked" in replies[0][hostname]["ok"]
        for task in (buffered, eta):
            assert _state(client, task.id) == "REVOKED"     # settled before the reply
        assert sorted(inspect.revoked()[hostname]) == sorted([buffered.id, eta.id])
        assert (inspect.scheduled() or {}).get(hostname) == []

        replies = celery.control.revoke(running.id, terminate=True, signal="SIGTERM",
                                        reply=True, timeout=5, destination=[hostname])
        assert replies[0][hostname] == {"ok": f"terminate: {running.id}"}
        wait_until(lambda: _state(client, running.id) == "REVOKED", 20, "REVOKED stored")
        wait_until(lambda: process_gone(grandchild), 10, "the grandchild to be killed")
        # Everything is settled: nothing left on the queue, nothing held, nothing re-run.
        after = celery.send_task("tests.apps.basic.add", (2, 3))
        assert client.AsyncResult(after.id).get(timeout=30) == 5
        wait_until(lambda: broker.queue_size() == 0, 10, "an empty queue")
        assert [name for name, _, _ in runs(tmp_path)] == ["sleeper"]
        assert worker.proc.poll() is None
        worker.wait_for_log(r"revoked with terminate \(SIGTERM\)")
    finally:
        celery.close()


def test_a_worker_started_later_knows_what_was_revoked_before_it(
        broker, start_worker, client, tmp_path):
    early = start_worker(broker, hostname=f"early-{uuid.uuid4().hex[:8]}@test")
    celery = celery_app(broker)
    try:
        task_id, stamped_id = str(uuid.uuid4()), str(uuid.uuid4())
        replies = celery.control.revoke(task_id, reply=True, timeout=5)
        assert replies, "the early worker answered"
        celery.control.revoke_by_stamped_headers({"batch": ["b-13"]}, reply=True, timeout=5)
        early.stop()
        # The CLI keeps its revokes in the result store too: no worker needs to be online.
        offline = str(uuid.uuid4())
        cli = control_cli(broker, tmp_path, "revoke", offline, "--timeout", "0.5")
        assert cli.returncode == 0, cli.stderr
        assert "kept in the result store" in cli.stderr
        # Queued before the late worker starts: it must know the revokes before it takes
        # anything (it reads them from the store before it consumes).
        celery.send_task("tests.apps.basic.record", (), task_id=task_id)
        celery.send_task("tests.apps.basic.record", (), task_id=offline)
        celery.send_task("tests.apps.basic.record", (), task_id=stamped_id,
                         stamped_headers=["batch"], batch="b-13")
        kept = celery.send_task("tests.apps.basic.add", (1, 1))
        start_worker(broker, hostname=f"late-{uuid.uuid4().hex[:8]}@test")
        assert client.AsyncResult(kept.id).get(timeout=30) == 2
        for revoked in (task_id, offline, stamped_id):
            wait_until(lambda r=revoked: _state(client, r) == "REVOKED", 20,
                       f"{revoked} REVOKED")
        assert runs(tmp_path) == []
        wait_until(lambda: broker.queue_size() == 0, 10, "an empty queue")
    finally:
        celery.close()


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_workhorse_control_revokes_with_terminate_and_reports(broker, start_worker, client,
                                                              tmp_path):
    hostname = f"rv-{uuid.uuid4().hex[:8]}@test"
    start_worker(broker, hostname=hostname, concurrency=1)
    celery = celery_app(broker)
    try:
        running = celery.send_task("tests.apps.basic.sleeper", (60,))
        wait_until(lambda: runs(tmp_path), 20, "the sleeper to start")
        cli = control_cli(broker, tmp_path, "revoke", running.id, "--terminate", "--signal",
                          "KILL", "-d", hostname, "--json", "--timeout", "10")
        assert cli.returncode == 0, cli.stderr
        assert json.loads(cli.stdout) == {hostname: {"ok": f"terminate: {running.id}"}}
        wait_until(lambda: _state(client, running.id) == "REVOKED", 20, "REVOKED stored")
        bad = control_cli(broker, tmp_path, "revoke", "x", "--signal", "NOPE")
        assert bad.returncode == 2 and "no such signal: 'NOPE'" in bad.stderr
        nothing = control_cli(broker, tmp_path, "revoke")
        assert nothing.returncode == 2 and "task id" in nothing.stderr
    finally:
        celery.close()


@pytest.mark.parametrize("broker", ["sqlite"], indirect=True)
def test_a_stamped_signature_sent_by_workhorse_carries_its_stamps(broker, client):
    """A chord body or callback the worker sends keeps the stamps Celery's stamping put in
    its options, so revoke_by_stamped_headers still finds it."""
    from workhorse.canvas import Signature
    sig = Signature("tests.apps.basic.add", (1, 2), app=client,
                    options={"stamped_headers": ["monitoring_id"], "monitoring_id": "m-7",
                             "exchange": "ignored"})
    sig.apply_async(headers={"custom": 1})
    [(headers, _body)] = broker.drain(broker.queue)
    assert headers["stamped_headers"] == ["monitoring_id"]
    assert headers["stamps"] == {"monitoring_id": "m-7"} and headers["custom"] == 1
    revoked = Revoked()
    revoked.revoke_stamps({"monitoring_id": ["m-7"]})
    assert revoked.match("x", headers) == "revoked by stamped header monitoring_id='m-7'"
