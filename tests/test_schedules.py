"""Tier 1 and 3: schedule entries from config files, what a worker sends after missed due
times (an injected clock), and the fences on SQLite and Redis (the broker's, and the
result store's that RabbitMQ uses)."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from kombu import Connection, Producer

from tests.conftest import ROOT, REDIS_URL, require_service
from workhorse.backends.sqlite import SQLiteBackend
from workhorse.broker.connection import open_connection
from workhorse.config import ConfigError, load_settings
from workhorse.schedules.entries import from_table
from workhorse.schedules.fence import BrokerFence, StoreFence
from workhorse.schedules.plan import plan
from workhorse.schedules.timing import Cron, Every
from workhorse.transport.fenced import Record, Ticket

pytestmark = pytest.mark.timeout(60)

BERLIN = ZoneInfo("Europe/Berlin")


def at(text: str) -> datetime:
    return datetime.fromisoformat(text)


# ---------------------------------------------------------------- config
def load(tmp_path: Path, text: str, name: str = "workhorse.toml",
         drop_ins: dict[str, str] | None = None):
    path = tmp_path / name
    path.write_text(text)
    for file, body in (drop_ins or {}).items():
        (tmp_path / "workhorse.d").mkdir(exist_ok=True)
        (tmp_path / "workhorse.d" / file).write_text(body)
    return load_settings(config_file=path, env={})


def test_toml_entries_and_a_drop_in_that_replaces_one(tmp_path):
    settings = load(tmp_path, """
[worker]
concurrency = 2

[[schedule]]
name = "nightly-report"
task = "reports.nightly"
cron = "30 2 * * *"
tz = "Europe/Berlin"
args = [1, 2]
kwargs = {to = "ops"}
queue = "reports"
priority = 5
expires = "1h"
catchup = "latest"
misfire_grace = "1h"

[[schedule]]
name = "tick"
task = "t.tick"
every = "90s"
""", drop_ins={"10-tick.toml": '[schedule.tick]\ntask = "t.tock"\nevery = "2m"\n'})
    nightly, tick = settings.schedule
    assert (nightly.name, nightly.task, nightly.args, dict(nightly.kwargs)) == (
        "nightly-report", "reports.nightly", (1, 2), {"to": "ops"})
    assert (nightly.queue, nightly.priority, nightly.expires, nightly.catchup,
            nightly.misfire_grace) == ("reports", 5, 3600.0, "latest", 3600.0)
    assert nightly.tz == BERLIN
    assert (tick.task, tick.timing.seconds) == ("t.tock", 120.0)


def test_ini_entries_take_json_arguments(tmp_path):
    settings = load(tmp_path, "[worker]\nconcurrency = 1\n\n[schedule.cleanup]\n"
                              "task = jobs.cleanup\ncron = @hourly\nargs = [3]\n"
                              'kwargs = {"deep": true}\n', name="workhorse.ini")
    (entry,) = settings.schedule
    assert (entry.name, entry.args, dict(entry.kwargs)) == ("cleanup", (3,), {"deep": True})


@pytest.mark.parametrize("body, says", [
    ('task = "t"\ncron = "61 * * * *"', "schedule 'bad': cron: "),
    ('task = "t"\ncron = "* * *"', "schedule 'bad': cron: "),
    ('task = "t"\nevery = "soon"', "schedule 'bad': every: "),
    ('task = "t"', "schedule 'bad': cron: give either cron or every"),
    ('task = "t"\ncron = "@daily"\nevery = "1h"', "give either cron or every"),
    ('task = "t"\ncron = "@daily"\ntz = "Mars/Olympus"', "schedule 'bad': tz: unknown time zone"),
    ('task = "t"\ncron = "@daily"\ncatchup = "some"', "schedule 'bad': catchup: expected one of"),
    ('task = "t"\ncron = "@daily"\nmisfire_grace = "-1h"', "schedule 'bad': misfire_grace: "),
    ('task = "t"\ncron = "@daily"\npriority = 300', "schedule 'bad': priority: "),
    ('task = "t"\ncron = "@daily"\nargs = {a = 1}', "schedule 'bad': args: expected an array"),
    ('task = "t"\ncron = "@daily"\nqueues = "q"', "schedule 'bad': queues: unknown key; did "
                                                  "you mean 'queue'?"),
    ('cron = "@daily"', "schedule 'bad': task: "),
    ('task = "t"\ncron = "@daily"\nanchor = "2026-01-01T00:00:00Z"',
     "schedule 'bad': anchor: only an every schedule"),
])
def test_a_bad_entry_is_one_line_naming_the_entry_and_the_field(tmp_path, body, says):
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, f'[[schedule]]\nname = "bad"\n{body}\n')
    message = str(caught.value)
    assert says in message and "\n" not in message, message
    assert str(tmp_path / "workhorse.toml") in message


def test_the_worker_refuses_a_bad_entry_with_exit_2(tmp_path):
    config = tmp_path / "workhorse.toml"
    config.write_text('[[schedule]]\nname = "bad"\ntask = "t"\ncron = "0 25 * * *"\n')
    done = subprocess.run([sys.executable, "-m", "workhorse", "worker", "-A",
                           "tests.apps.basic", "--config", str(config)], cwd=ROOT,
                          capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
                               "WORKHORSE_STATE_DIR": str(tmp_path / "state")})
    assert done.returncode == 2, done.stderr
    assert "schedule 'bad': cron: " in done.stderr and "hour" in done.stderr


# ---------------------------------------------------------------- schedules next
def next_times(tmp_path: Path, after: str, count: int = 2, tz: str = "Europe/Berlin",
               cron: str = "30 2 * * *") -> list[str]:
    config = tmp_path / "workhorse.toml"
    config.write_text(f'[[schedule]]\nname = "nightly"\ntask = "none.such"\ncron = "{cron}"\n'
                      f'tz = "{tz}"\n')
    done = subprocess.run([sys.executable, "-m", "workhorse", "schedules", "next", "nightly",
                           "--after", after, "--count", str(count), "--config", str(config)],
                          cwd=ROOT, capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
                               # no broker anywhere: it is never asked
                               "WORKHORSE_BROKER_URL": "amqp://nobody@127.0.0.1:1//"})
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_schedules_next_across_berlins_changes_needs_no_broker(tmp_path):
    assert next_times(tmp_path, "2027-03-27T12:00+01:00") == [
        "2027-03-28T03:30:00+02:00", "2027-03-29T02:30:00+02:00"]
    assert next_times(tmp_path, "2026-10-24T12:00+02:00") == [
        "2026-10-25T02:30:00+02:00", "2026-10-26T02:30:00+01:00"]


def test_schedules_next_refuses_a_time_without_offset_and_an_unknown_name(tmp_path):
    config = tmp_path / "workhorse.toml"
    config.write_text('[[schedule]]\nname = "a"\ntask = "t"\ncron = "@daily"\n')
    for args, says in ((["a", "--after", "2027-03-27T12:00"], "with its offset"),
                       (["b"], "no schedule named 'b' (schedules: a)")):
        done = subprocess.run([sys.executable, "-m", "workhorse", "schedules", "next", *args,
                               "--config", str(config)], cwd=ROOT, capture_output=True,
                              text=True, timeout=30, env={"PATH": "/usr/bin:/bin",
                                                          "PYTHONPATH": str(ROOT)})
        assert done.returncode == 2 and says in done.stderr, done.stderr


# ---------------------------------------------------------------- catch-up (injected clock)
HOURLY = Cron("0 * * * *", ZoneInfo("UTC"))


@pytest.mark.parametrize("catchup, grace, sent, skipped", [
    # Back 30 min after the last of three missed hours: nothing is on time.
    ("none", 4 * 3600, [], 3),
    ("latest", 4 * 3600, ["12:00"], 2),
    ("all", 4 * 3600, ["10:00", "11:00", "12:00"], 0),
    # ... and with one hour of grace, 10:00 and 11:00 are beyond it whatever the policy.
    ("none", 3600, [], 3),
    ("latest", 3600, ["12:00"], 2),
    ("all", 3600, ["12:00"], 2),
])
def test_each_catchup_policy_after_a_three_hour_outage(catchup, grace, sent, skipped):
    found = plan(HOURLY, catchup, grace, at("2026-05-01T09:00+00:00"),
                 at("2026-05-01T12:30+00:00"))
    assert [n.strftime("%H:%M") for n in found.send] == sent
    assert len(found.skipped) + found.skipped_beyond_grace == skipped


@pytest.mark.parametrize("catchup, sent", [
    ("none", ["12:00"]), ("latest", ["12:00"]), ("all", ["10:00", "11:00", "12:00"])])
def test_the_due_time_of_now_is_sent_whatever_the_policy(catchup, sent):
    found = plan(HOURLY, catchup, 4 * 3600, at("2026-05-01T09:00+00:00"),
                 at("2026-05-01T12:00:03+00:00"))
    assert [n.strftime("%H:%M") for n in found.send] == sent


def test_catchup_all_never_bursts_beyond_the_grace():
    every = Every(1.0, ZoneInfo("UTC"))
    now = at("2026-05-01T12:00:00.5+00:00")
    found = plan(every, "all", 30, now - timedelta(days=7), now)
    assert len(found.send) == 30 and found.send == sorted(found.send)
    assert found.skipped_beyond_grace > 0


def test_catchup_across_berlins_spring_gap():
    """Down from 01:00 to 04:00 local on the night the clocks jump: the 02:30 due time
    (read as 03:30+02:00) was missed; `latest` sends it, 90 min late."""
    daily = Cron("30 2 * * *", BERLIN)
    found = plan(daily, "latest", 2 * 3600, at("2027-03-28T01:00+01:00"),
                 at("2027-03-28T05:00+02:00"))
    assert [n.isoformat() for n in found.send] == ["2027-03-28T03:30:00+02:00"]


# ---------------------------------------------------------------- fences
def ticket(nominal: float, by: str = "w1", name: str = "s") -> Ticket:
    """As a worker makes it: the task id is the same on every worker (it is derived from
    the due time), so only the rest of the record tells one worker's try from another's."""
    return Ticket(name, Record(nominal, f"id-{name}-{nominal}", by, time.time()))


def published(connection: Connection, queue: str) -> callable:
    def publish() -> None:
        Producer(connection).publish({"n": 1}, exchange="", routing_key=queue,
                                     serializer="json", retry=False)
    return publish


@pytest.fixture(params=["sqlite", "redis"])
def broker_url(request, tmp_path):
    if request.param == "redis":
        require_service("Redis", 6379)
        return REDIS_URL
    return f"sqlite:///{tmp_path / 'broker.sqlite3'}"


def connect(url: str) -> Connection:
    """A connection as the worker makes it (workhorse's own Redis transport)."""
    return open_connection(load_settings(env={"WORKHORSE_BROKER_URL": url}))


def test_a_broker_fence_sends_each_due_time_once_however_many_try(broker_url):
    """Ten workers at once on one due time: one message. A frozen worker that wakes to
    send a due time already passed (a later one was sent) sends nothing."""
    name, queue = f"s-{uuid.uuid4().hex[:8]}", f"q-{uuid.uuid4().hex[:8]}"
    results: list[object] = []

    def worker(i: int) -> None:
        with connect(broker_url) as connection:
            connection.SimpleQueue(queue)       # declared
            fence = BrokerFence(connection.default_channel)
            results.append(fence.send(ticket(100.0, f"w{i}", name),
                                      published(connection, queue), None))
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert results.count(None) == 1 and len(results) == 10
    with connect(broker_url) as connection:
        fence = BrokerFence(connection.default_channel)
        first = ticket(101.0, "w1", name)
        assert fence.send(first, published(connection, queue), None) is None
        holder = fence.send(ticket(100.0, "frozen", name), published(connection, queue), None)
        assert holder is not None and holder.nominal == 101.0
        # Another worker on the same due time (the same task id): refused.
        assert fence.send(ticket(101.0, "w2", name), published(connection, queue),
                          None) == first.record
        # A put tried again after a lost reply (the same ticket): done, nothing more put.
        assert fence.send(first, published(connection, queue), None) is None
        assert fence.records([name])[name] == first.record
        simple = connection.SimpleQueue(queue)
        assert simple.qsize() == 2
        simple.clear()


def test_the_result_store_fence_moves_back_when_the_publish_fails(tmp_path):
    backend = SQLiteBackend(f"sqlite:///{tmp_path / 'results.sqlite3'}")
    fence = StoreFence(backend)
    sent: list[str] = []

    def fails() -> None:
        raise ConnectionError("broker gone")
    with pytest.raises(ConnectionError):
        fence.send(ticket(100.0), fails, None)
    assert fence.records(["s"])["s"].nominal == 0.0        # back: 100 may be sent again
    assert fence.send(ticket(100.0, "w2"), lambda: sent.append("w2"), None) is None
    assert fence.send(ticket(100.0, "w3"), lambda: sent.append("w3"), None).by == "w2"
    record = fence.records(["s"])["s"]
    assert (sent, record.state, record.by) == (["w2"], "sent", "w2")


def test_the_redis_result_store_fence(tmp_path):
    require_service("Redis", 6379)
    from workhorse.backends.redis import RedisBackend
    fence = StoreFence(RedisBackend(REDIS_URL))
    name = f"s-{uuid.uuid4().hex[:8]}"
    sent: list[str] = []
    assert fence.send(ticket(100.0, "w1", name), lambda: sent.append("w1"), None) is None
    assert fence.send(ticket(100.0, "w2", name), lambda: sent.append("w2"), None).by == "w1"
    assert fence.records([name])[name].state == "sent"
    assert sent == ["w1"]


def test_the_same_due_time_has_the_same_task_id_on_every_worker():
    from workhorse.daemon.schedules import task_id_for
    nominal = datetime(2026, 5, 1, 12, tzinfo=UTC)
    assert task_id_for("s", nominal) == task_id_for("s", nominal.astimezone(BERLIN))
    assert task_id_for("s", nominal) != task_id_for("s", nominal + timedelta(seconds=1))
    assert from_table({"name": "n", "task": "t", "every": 5}, "x").timing.seconds == 5.0


@pytest.mark.parametrize("store", ["sqlite", "redis"])
def test_a_due_time_whose_worker_died_before_the_confirm_is_sent_by_another(tmp_path, store):
    """RabbitMQ's fence, in the result store: a worker moved it and was killed before the
    broker confirmed the publish. Its pending note is taken over after SENDING_STALE and
    the due time published once, by one of the others, under the same task id."""
    from workhorse.schedules.fence import SENDING_STALE
    if store == "redis":
        require_service("Redis", 6379)
        from workhorse.backends.redis import RedisBackend
        backend = RedisBackend(REDIS_URL)
    else:
        backend = SQLiteBackend(f"sqlite:///{tmp_path / 'results.sqlite3'}")
    name = f"s-{uuid.uuid4().hex[:8]}"
    now = [1000.0]
    late, w2, w3 = (StoreFence(backend, clock=lambda: now[0]) for _ in range(3))
    # What StoreFence.send's first step leaves when SIGKILL comes right after it: the fence
    # moved, the note made, no message, nothing rolled back.
    killed = Ticket(name, Record(100.0, f"id-{name}-100", "dead", now[0], "sending"))
    assert backend.move_fence(killed) == (True, None)
    assert late.send(ticket(100.0, "late", name), lambda: None, None) is not None
    assert w2.orphans(name) == []                   # it may still be on its way
    now[0] += SENDING_STALE + 1
    (orphan,) = w2.orphans(name)
    assert (orphan.nominal, orphan.by) == (100.0, "dead")
    sent: list[str] = []
    assert w2.resend(name, orphan, "w2", lambda: sent.append("w2"))
    assert not w3.resend(name, orphan, "w3", lambda: sent.append("w3"))   # taken already
    assert sent == ["w2"] and w3.orphans(name) == []
    assert fence_record(w3, name) == (100.0, killed.record.task_id, "w2", "sent")


def fence_record(fence: StoreFence, name: str) -> tuple:
    record = fence.records([name])[name]
    return record.nominal, record.task_id, record.by, record.state
