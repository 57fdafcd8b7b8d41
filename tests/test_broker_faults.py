"""Broker faults never stall the supervisor's loop or take the worker down.

Tier 2/3: the real daemon against private brokers this test controls: Redis and RabbitMQ
behind a loopback proxy that can go silent (tests/proxy.py), a private Redis started late,
SQLite with its write lock held by another process. Never the shared servers themselves.
"""
from __future__ import annotations

import re
import signal
import socket
import time
import types
from pathlib import Path

import psutil
import pytest

from tests.conftest import (
    AMQP_URL,
    BrokerEnv,
    RedisServer,
    Worker,
    make_broker,
    require_service,
    runs,
    wait_until,
    worker_env,
)
from tests.proxy import SilentBroker
from workhorse import App

pytestmark = pytest.mark.timeout(120)

STAMP = re.compile(r"^\[(\d+-\d+-\d+ [\d:]+),(\d+) ")


def stamped(log: str, pattern: str) -> list[float]:
    """Wall-clock times of the log lines matching ``pattern``."""
    times = []
    for line in log.splitlines():
        match = STAMP.match(line)
        if match and re.search(pattern, line):
            whole = time.mktime(time.strptime(match.group(1), "%Y-%m-%d %H:%M:%S"))
            times.append(whole + int(match.group(2)) / 1000)
    return times


class Notify:
    """A notify socket of the test's own: what the worker tells systemd."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.05)
        self.messages: list[tuple[float, str]] = []

    def read(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                self.messages.append((time.time(), self.sock.recv(4096).decode()))
            except TimeoutError:
                pass

    def pings(self) -> list[float]:
        return [t for t, text in self.messages if "WATCHDOG=1" in text]

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("kind", ["sqlite", "redis", "amqp"])
def test_time_limits_signals_and_the_watchdog_are_on_time_while_the_broker_hangs(
        kind, tmp_path):
    if kind != "sqlite":
        require_service(kind, SilentBroker.PORTS[kind])
    silent = SilentBroker(kind, tmp_path)
    url, freeze, cleanup = silent.url, silent.freeze, silent.close
    broker = BrokerEnv(kind, url, f"frozen-{tmp_path.name[-8:]}")
    notify = Notify(tmp_path / "notify.sock")
    env = worker_env(broker, tmp_path, concurrency=1, soft_time_limit=3, time_limit=4,
                     acks_on_timeout=False)      # the hard kill publishes a counted copy
    env.update(NOTIFY_SOCKET=notify.path, WATCHDOG_USEC="1000000")
    worker = Worker(tmp_path, env, ["-A", "tests.apps.basic"])
    try:
        worker.wait_for_log(r"ready: consuming", 30)
        client = App("client", broker_url=url, queues=[broker.queue],
                     result_backend=env["WORKHORSE_RESULT_BACKEND"])
        client.send_task("tests.apps.basic.outlive_soft", args=[60])
        wait_until(lambda: any("running tests.apps.basic.outlive_soft" in " ".join(c.cmdline())
                               for c in psutil.Process(worker.pid).children()),
                   30, "the task to start")
        started = time.time()
        freeze()
        frozen = time.time()
        notify.read(max(0.0, started + 2 - time.time()))
        usr1 = time.time()
        worker.signal(signal.SIGUSR1)
        notify.read(started + 7 - time.time())
        log = worker.log()
        (soft,) = stamped(log, r"soft time limit")[:1] or [None]
        (hard,) = stamped(log, r"hard time limit .* exceeded; killing")[:1] or [None]
        answers = stamped(log, r"state: phase=")
        assert soft is not None and soft - started < 3.0 + 1.0, log[-3000:]
        assert hard is not None and hard - started < 4.0 + 1.0, log[-3000:]
        assert answers and answers[0] - usr1 < 1.0, log[-3000:]
        marks = [frozen, *(p for p in notify.pings() if p > frozen), time.time()]
        assert max(b - a for a, b in zip(marks, marks[1:], strict=False)) < 2.0
    finally:
        worker.kill()
        notify.close()
        cleanup()


def test_children_forked_while_the_broker_thread_is_busy_never_hang(tmp_path, client_redis):
    """Every task is run by a fresh child (max_tasks_per_child=1), forked while the broker
    thread takes, acks and logs at debug level: a fork that caught a lock held by that
    thread would leave a child that never says hello, and tasks would stop."""
    broker, app = client_redis
    worker = Worker(tmp_path, worker_env(broker, tmp_path, concurrency=2, max_tasks_per_child=1,
                                         loglevel="DEBUG"), ["-A", "tests.apps.basic"])
    try:
        worker.wait_ready()
        results = [app.send_task("tests.apps.basic.add", args=[i, i]) for i in range(150)]
        assert [r.get(timeout=60) for r in results] == [2 * i for i in range(150)]
        assert worker.proc.poll() is None
    finally:
        worker.kill()


@pytest.mark.timeout(300)
def test_a_take_sent_from_the_loop_thread_that_gets_no_answer_is_given_up_and_costs_nothing(
        tmp_path):
    """Redis: the loop thread sends its acks and takes itself and reads the answer when it
    comes. The broker goes silent while tasks stream through: the take in flight is given
    up after SENT_TAKE_TIMEOUT (its acks made again by the broker thread), the loop answers
    at once meanwhile, and once the broker answers again every task has run exactly once
    (what the take given up leased comes back when its lease runs out)."""
    require_service("redis", SilentBroker.PORTS["redis"])
    silent = SilentBroker("redis", tmp_path)
    broker = BrokerEnv("redis", silent.url, f"sent-{tmp_path.name[-8:]}")
    worker = Worker(tmp_path, worker_env(broker, tmp_path, concurrency=2, visibility_timeout=4),
                    ["-A", "tests.apps.basic"])
    client = App("client", broker_url=silent.direct_url, queues=[broker.queue])
    given_up = "a take sent from the loop thread failed"
    try:
        worker.wait_ready()
        ids = [client.send_task("tests.apps.basic.record").id for _ in range(2000)]
        for ran in (60, 600, 1200):
            wait_until(lambda ran=ran: len(runs(tmp_path)) >= ran, 30, f"{ran} tasks to run")
            silent.freeze()
            # (Now and then the broker thread is inside a call of its own when the broker
            # goes silent: it then holds the connection, and every take goes to it. Thawed,
            # the freeze is tried again, later in the stream.)
            deadline = time.monotonic() + 4
            while given_up not in worker.log() and time.monotonic() < deadline:
                time.sleep(0.05)
            if given_up in worker.log():
                break
            silent.proxy.thaw()
        assert given_up in worker.log(), worker.log()[-3000:]
        usr1 = time.time()
        worker.signal(signal.SIGUSR1)
        answered = worker.wait_for_log(r"state: phase=", 5)
        assert stamped(answered, r"state: phase=")[-1] - usr1 < 1.0
        silent.proxy.thaw()
        wait_until(lambda: len(runs(tmp_path)) >= 2000, 90, "every task to run")
        started = sorted(task_id for name, task_id, _ in runs(tmp_path) if name == "record")
        assert started == sorted(ids)       # each once: none lost, none run twice
        assert worker.proc.poll() is None
    finally:
        worker.kill()
        client.close()
        silent.close()
        BrokerEnv("redis", silent.direct_url, broker.queue).cleanup()


@pytest.fixture
def client_redis(tmp_path):
    broker = make_broker("redis", tmp_path)
    env = worker_env(broker, tmp_path)
    app = App("client", broker_url=broker.url, queues=[broker.queue],
              result_backend=env["WORKHORSE_RESULT_BACKEND"])
    yield broker, app
    broker.cleanup()


def test_a_broker_unreachable_at_start_is_waited_for_with_back_off(tmp_path):
    require_service("Redis", 6379)
    server = RedisServer(tmp_path / "redis")
    server.kill()                                  # its port, with nothing on it yet
    broker = BrokerEnv("redis", server.url(), "late")
    notify = Notify(tmp_path / "notify.sock")
    env = worker_env(broker, tmp_path)
    env.update(NOTIFY_SOCKET=notify.path, WATCHDOG_USEC="1000000")
    worker = Worker(tmp_path, env, ["-A", "tests.apps.basic"])
    try:
        worker.wait_for_log(r"unreachable \(.*\); next try in [\d.]+ s", 30, count=3)
        notify.read(1.0)
        texts = " ".join(text for _, text in notify.messages)
        assert "READY=1" in texts and "waiting for the broker" in texts
        assert len(notify.pings()) >= 1           # a broker that is down is no hang
        assert "Traceback" not in worker.log()
        server.start()
        worker.wait_for_log(r"ready: consuming late", 60)
        client = App("client", broker_url=broker.url, queues=["late"],
                     result_backend=env["WORKHORSE_RESULT_BACKEND"])
        assert client.send_task("tests.apps.basic.add", args=[2, 3]).get(timeout=30) == 5
    finally:
        worker.kill()
        notify.close()
        server.kill()


def test_a_refused_login_is_said_as_such_and_retried(tmp_path):
    require_service("RabbitMQ", 5672)
    url = AMQP_URL.replace("guest:guest", "guest:wrong-password")
    broker = BrokerEnv("amqp", url, "refused")
    worker = Worker(tmp_path, worker_env(broker, tmp_path), ["-A", "tests.apps.basic"])
    try:
        log = worker.wait_for_log(r"authentication refused .*; next try in", 60)
        assert "wrong-password" not in log and "unreachable" not in log
        assert worker.proc.poll() is None
    finally:
        worker.kill()


@pytest.mark.parametrize("setting", [{"broker_connection_retry_on_startup": False},
                                     {"broker_connection_max_retries": 2}])
def test_giving_up_on_the_broker_exits_1_with_one_line_and_no_traceback(setting, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]                 # nothing listens there
    broker = BrokerEnv("redis", f"redis://127.0.0.1:{port}/0", "nowhere")
    worker = Worker(tmp_path, worker_env(broker, tmp_path, **setting),
                    ["-A", "tests.apps.basic"])
    try:
        assert worker.wait_exit(60) == 1
        log = worker.log()
        assert "giving up after" in log and "Traceback" not in log
    finally:
        worker.kill()


def test_the_watchdog_is_withheld_only_from_a_broker_thread_that_hangs():
    from workhorse.broker.link import STALL_LIMIT, BrokerLink
    link = BrokerLink.__new__(BrokerLink)
    link.thread = types.SimpleNamespace(is_alive=lambda: True, progress=time.monotonic())
    assert link.healthy()
    link.thread.progress = time.monotonic() - STALL_LIMIT - 1
    assert not link.healthy()
    link.thread = types.SimpleNamespace(is_alive=lambda: False, progress=time.monotonic())
    assert not link.healthy()


