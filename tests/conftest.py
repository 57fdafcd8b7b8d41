"""Shared fixtures: brokers (SQLite always; Redis and RabbitMQ when up, mandatory in CI) and
a real worker daemon run as a subprocess in its own session."""
from __future__ import annotations

import contextlib
import gc
import multiprocessing
import multiprocessing.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() == "true"
REDIS_URL = os.environ.get("WH_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
AMQP_URL = os.environ.get("WH_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")


def _reachable(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def require_service(name: str, port: int) -> None:
    """Skip when a broker is absent locally; in CI (CI=true) its absence is a failure."""
    if _reachable(port):
        return
    message = f"{name} is not reachable on 127.0.0.1:{port}"
    if IN_CI:
        pytest.fail(f"{message}, and CI=true makes broker tests mandatory")
    pytest.skip(f"{message}; start it to run this test")


def wait_until(condition: Callable[[], object], timeout: float, what: str,
               interval: float = 0.02) -> object:
    """Poll ``condition`` until it is truthy; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def process_gone(pid: int) -> bool:
    """No process ``pid``, or only its zombie. (Asked in one call: a process that exits
    between "does it exist" and "what state is it in" is gone, not an error.)"""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def check_celery_results(app) -> None:  # type: ignore[no-untyped-def]
    """A Celery client ``app`` gets a workhorse worker's result, and its failure as the
    exception the task raised (whatever result store they share)."""
    assert app.send_task("tests.apps.basic.add", (2, 40)).get(timeout=20) == 42
    failing = app.send_task("tests.apps.basic.fail", ("bad input",))
    with pytest.raises(ValueError) as raised:
        failing.get(timeout=20)
    assert raised.value.args == ("bad input", 42)


class BrokerEnv:
    """One broker for one test: a URL, a unique queue, and clean-up."""

    def __init__(self, kind: str, url: str, queue: str) -> None:
        #: sqlite, redis, amqp, or quorum (RabbitMQ, its queues quorum queues)
        self.kind = kind
        self.url = url
        self.queue = queue
        self.extra_queues: list[str] = []

    @property
    def rabbitmq(self) -> bool:
        return self.kind in ("amqp", "quorum")

    @property
    def queue_type(self) -> str:
        return "quorum" if self.kind == "quorum" else "classic"

    def connection(self):
        from kombu import Connection
        return Connection(self.url)

    def queue_size(self, name: str | None = None) -> int:
        """Messages ready in a queue (not the ones held unacknowledged by a consumer)."""
        from workhorse.broker.queues import ensure_queue
        with self.connection() as conn:
            queue = ensure_queue(conn, name or self.queue, self.queue_type)(conn.default_channel)
            return queue.queue_declare(passive=self.rabbitmq).message_count

    def drain(self, name: str, limit: int = 1000) -> list:
        """Take (and ack) every message in a queue: [(headers, body bytes)].

        (py-amqp hands over utf-8 bodies already decoded to str; the bytes are the same.)"""
        from amqp.exceptions import InternalError

        from workhorse.broker.queues import ensure_queue
        out = []
        with self.connection() as conn:
            q = ensure_queue(conn, name, self.queue_type)(conn.default_channel)
            for _ in range(limit):
                try:
                    message = q.get(no_ack=False, accept=["application/json"])
                except InternalError as exc:
                    # A quorum queue declared a moment ago may not have started its
                    # replicas yet ('noproc'): as good as empty, for callers that wait
                    if "noproc" not in str(exc):
                        raise
                    break
                if message is None:
                    break
                body = message.body
                out.append((dict(message.headers),
                            body.encode() if isinstance(body, str) else body))
                message.ack()
        return out

    def cleanup(self) -> None:
        from workhorse.broker.queues import task_queue
        try:
            with self.connection() as conn:
                for name in (self.queue, self.queue + ".dead", *self.extra_queues):
                    q = task_queue(name)(conn.default_channel)
                    try:
                        q.delete()
                    except Exception:  # noqa: BLE001 - cleanup is best effort
                        pass
                    try:
                        q.exchange.delete()
                    except Exception:  # noqa: BLE001 - cleanup is best effort
                        pass
        except Exception:  # noqa: BLE001 - cleanup is best effort
            pass


class RedisServer:
    """A Redis of the test's own on a free port (append-only, fsync always), to stop and
    start again: a broker or result store outage without touching the shared server."""

    def __init__(self, directory: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.directory = directory
        directory.mkdir(exist_ok=True)
        self.proc: subprocess.Popen | None = None
        self.start()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> None:
        import redis
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
             "--dir", str(self.directory), "--appendonly", "yes", "--appendfsync", "always",
             "--save", ""], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)

        def pings() -> bool:
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False
        wait_until(pings, 10, f"redis on port {self.port}")
        client.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    require_service("Redis", 6379)     # the same redis-server binary
    server = RedisServer(tmp_path / "redis-data")
    yield server
    server.kill()


def make_broker(kind: str, tmp_path: Path) -> BrokerEnv:
    queue = f"t-{uuid.uuid4().hex[:10]}"
    if kind == "sqlite":
        return BrokerEnv(kind, f"sqlite:///{tmp_path / 'broker.sqlite3'}", queue)
    if kind == "redis":
        require_service("Redis", 6379)
        return BrokerEnv(kind, REDIS_URL, queue)
    if kind in ("amqp", "quorum"):
        require_service("RabbitMQ", 5672)
        return BrokerEnv(kind, AMQP_URL, queue)
    raise ValueError(kind)


def broker_fixture(*kinds: str):  # type: ignore[no-untyped-def]
    """The ``broker`` fixture over ``kinds``: a test module that must also run on RabbitMQ's
    quorum queues defines ``broker = broker_fixture(*BROKERS, "quorum")``."""
    @pytest.fixture(params=kinds)
    def broker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BrokerEnv]:
        env = make_broker(request.param, tmp_path)
        yield env
        env.cleanup()
    return broker


BROKERS = ("sqlite", "redis", "amqp")
broker = broker_fixture(*BROKERS)


#: Every worker the running test started: a failed test's report shows the end of their logs.
STARTED: list[Worker] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for worker in STARTED:
            with contextlib.suppress(OSError):
                report.sections.append((f"worker {worker.pid} log (last 6000 characters)",
                                        worker.log()[-6000:]))
    if call.when == "teardown":
        STARTED.clear()


class Worker:
    """``workhorse worker`` as a subprocess, in its own session so it is cleaned up whole."""

    def __init__(self, tmp_path: Path, env: dict[str, str], args: list[str],
                 wrapper: list[str] | None = None) -> None:
        """``wrapper``: a command that runs the worker's (setpriv, to drop capabilities)."""
        self.log_path = tmp_path / f"worker-{uuid.uuid4().hex[:6]}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [*(wrapper or []), sys.executable, "-m", "workhorse", "worker", *args], cwd=ROOT,
            env=env,
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.proc.pid
        STARTED.append(self)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, pattern: str, timeout: float = 20, count: int = 1) -> str:
        regex = re.compile(pattern)

        def found() -> bool:
            if self.proc.poll() is not None and len(regex.findall(self.log())) < count:
                pytest.fail(f"worker exited ({self.proc.returncode}) before logging "
                            f"{pattern!r}:\n{self.log()[-4000:]}")
            return len(regex.findall(self.log())) >= count
        wait_until(found, timeout, f"log line {pattern!r} x{count}")
        return self.log()

    def wait_ready(self, timeout: float = 30) -> None:
        self.wait_for_log(r"ready: consuming", timeout)

    def children(self) -> list[int]:
        """The pool's children: not the sentinel, nor orphans the supervisor adopted."""
        import psutil
        try:
            supervisor = psutil.Process(self.pid)
            own = supervisor.cmdline()
            pids = []
            for p in supervisor.children():
                with contextlib.suppress(psutil.Error):
                    cmdline = p.cmdline()
                    # Titled once set up; until then, a copy of the supervisor.
                    if cmdline == own or " ".join(cmdline).startswith("workhorse: child"):
                        pids.append(p.pid)
            return pids
        except psutil.Error:
            return []

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def wait_exit(self, timeout: float = 30) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"worker did not exit within {timeout} s:\n{self.log()[-4000:]}")

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
        return self.wait_exit(timeout)

    def kill(self) -> None:
        """Remove the worker and everything in its session, whatever state it is in."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
        self._log.close()


@contextlib.contextmanager
def celery_worker(tmp_path: Path, broker: BrokerEnv, results_url: str, *args: str,
                  **env: str) -> Iterator[Path]:
    """A real Celery worker (``tests.apps.celery_tasks``) on ``broker``'s queue, storing in
    ``results_url``, ready; yields its log's path. ``args``: more worker options."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("WORKHORSE_")}
    environment.update(PYTHONPATH=str(ROOT), WH_CELERY_BROKER=broker.url,
                       WH_CELERY_BACKEND=results_url, WH_CELERY_QUEUE=broker.queue,
                       WH_TEST_RUNLOG=str(tmp_path / "runs.log"), **env)
    log_path = tmp_path / f"celery-{uuid.uuid4().hex[:6]}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.apps.celery_tasks", "worker",
             "-Q", broker.queue, "--without-gossip", "--without-mingle", "--without-heartbeat",
             "-l", "INFO", "-n", f"celery-{broker.queue}@%h", *args],
            cwd=ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        wait_until(lambda: b" ready." in log_path.read_bytes() or proc.poll() is not None, 60,
                   "the Celery worker")
        assert proc.poll() is None, log_path.read_text(errors="replace")
        yield log_path
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def basic_client(monkeypatch: pytest.MonkeyPatch, broker: BrokerEnv, results_url: str,
                 tmp_path: Path):
    """The test app (tests.apps.basic) as a client of ``broker`` storing in ``results_url``;
    the caller closes it (``basic.app.close()``)."""
    monkeypatch.setenv("WORKHORSE_BROKER_URL", broker.url)
    monkeypatch.setenv("WORKHORSE_RESULT_BACKEND", results_url)
    monkeypatch.setenv("WORKHORSE_QUEUES", broker.queue)
    monkeypatch.setenv("WORKHORSE_STATE_DIR", str(tmp_path / "state"))
    from tests.apps import basic
    basic.app.configure()
    return basic


def worker_env(broker: BrokerEnv, tmp_path: Path, **settings: object) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKHORSE_")}
    env.update({
        "PYTHONPATH": str(ROOT),
        "WORKHORSE_QUEUE_TYPE": broker.queue_type,
        "WORKHORSE_BROKER_URL": broker.url,
        "WORKHORSE_RESULT_BACKEND": f"sqlite:///{tmp_path / 'results.sqlite3'}",
        "WORKHORSE_STATE_DIR": str(tmp_path / "state"),
        "WORKHORSE_QUEUES": broker.queue,
        "WORKHORSE_CONCURRENCY": "2",
        "WH_TEST_RUNLOG": str(tmp_path / "runs.log"),
        "WH_TEST_PIDFILE": str(tmp_path / "grandchild.pid"),
    })
    for key, value in settings.items():
        env[f"WORKHORSE_{key.upper()}"] = (str(value).lower() if isinstance(value, bool)
                                           else str(value))
    return env


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    started: list[Worker] = []

    def start(broker: BrokerEnv, app: str = "tests.apps.basic", ready: bool = True,
              **settings: object) -> Worker:
        # A name of its own, as each worker of a fleet has: on RabbitMQ a second worker
        # of the same name cannot answer remote control (its mailbox queue is exclusive).
        settings.setdefault("hostname", f"w-{uuid.uuid4().hex[:8]}@test")
        worker = Worker(tmp_path, worker_env(broker, tmp_path, **settings), ["-A", app])
        started.append(worker)
        if ready:
            worker.wait_ready()
            if settings.get("remote_control", True):
                # A broadcast reaches only the workers listening when it is sent: tests
                # that send one right away wait for the mailbox too.
                worker.wait_for_log(r"remote control: answering")
        return worker

    yield start
    for worker in started:
        worker.kill()


@pytest.fixture
def client(broker: BrokerEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The test app configured like the worker, for sending and reading results here."""
    for key, value in worker_env(broker, tmp_path).items():
        if key.startswith(("WORKHORSE_", "WH_TEST_")):
            monkeypatch.setenv(key, value)
    from tests.apps import basic
    basic.app.configure()
    yield basic.app
    basic.app.close()


class CleanFork:
    """multiprocessing's fork context for a test, minus what earlier tests left behind.

    A forked copy inherits the test process's garbage and the after-fork hooks its
    libraries registered. A Celery ``AsyncResult`` collected there unsubscribes from Redis,
    and kombu's pools close their AMQP connections in their hooks: both talk on the
    parent's sockets and wait for ever (the hangs seen in CI). So garbage is collected and
    frozen and the hooks set aside while the test forks. Its processes are daemons, and any
    still alive at the end are killed: a hung copy fails its test, never the whole run."""

    def __init__(self) -> None:
        self.ctx = multiprocessing.get_context("fork")
        self.processes: list = []

    def Process(self, *args: object, **kwargs: object):
        process = self.ctx.Process(*args, daemon=True, **kwargs)  # type: ignore[misc]
        self.processes.append(process)
        return process

    def __getattr__(self, name: str) -> object:   # Queue, Barrier, ...
        return getattr(self.ctx, name)


@pytest.fixture
def fork_ctx() -> Iterator[CleanFork]:
    gc.collect()
    gc.freeze()
    hooks = dict(multiprocessing.util._afterfork_registry)    # type: ignore[attr-defined]
    multiprocessing.util._afterfork_registry.clear()           # type: ignore[attr-defined]
    clean = CleanFork()
    try:
        yield clean
    finally:
        for process in clean.processes:
            if process.pid is not None and process.is_alive():
                process.kill()
                process.join(10)
        multiprocessing.util._afterfork_registry.update(hooks)     # type: ignore[attr-defined]
        gc.unfreeze()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A process a test left running must not keep the run from ending (multiprocessing
    joins its children at exit): name it and kill it."""
    import psutil
    left = []
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if not any(helper in " ".join(process.cmdline())
                       for helper in ("resource_tracker", "forkserver")):
                left.append(process)
    for process in left:
        with contextlib.suppress(psutil.Error):
            print(f"\nconftest: killing pid {process.pid} a test left running: "
                  f"{' '.join(process.cmdline())[:200]}", file=sys.stderr)
            process.kill()
    psutil.wait_procs(left, timeout=10)


def runs(tmp_path: Path) -> list[tuple[str, str, int]]:
    """The starts recorded by the test tasks: (task, id, pid)."""
    path = tmp_path / "runs.log"
    if not path.exists():
        return []
    return [(a, b, int(c)) for a, b, c in (line.split() for line in path.read_text().splitlines())]


# ---------------------------------------------------------------- tiers, by marker
#: What in a test module's source says it starts the real daemon, or talks to a broker
#: (a module may say it instead: ``TIER = "daemon"``, or ``TIER = "pure"`` for one that
#: only names them).
_DAEMON = re.compile(r"start_worker|\bWorker\(|\"-m\", \"workhorse\"|compat\.celery_suite")
_SERVER = re.compile(r"require_service|REDIS_URL|AMQP_URL|private_redis|sentinel_set|"
                     r"Cluster\(|Connection\(f?[\"']sqlite|\bStore\(|sqlite:////|BrokerEnv\(")
_SOURCES: dict[str, str] = {}


def tiers(item: pytest.Item) -> set[str]:
    """The tiers a test is in: ``pure`` (logic against fakes: no daemon, no broker),
    ``daemon`` (the real daemon as a subprocess), ``broker`` (a real broker: the embedded
    SQLite file, or a Redis or RabbitMQ server), ``chaos``."""
    module = getattr(item, "module", None)
    path = getattr(module, "__file__", None) or ""
    if path not in _SOURCES:
        _SOURCES[path] = Path(path).read_text() if path else ""
    source = _SOURCES[path]
    if getattr(module, "TIER", None) == "pure":     # it only names workers and brokers
        return {"pure"}
    found = set()
    if getattr(module, "TIER", None) == "daemon" or _DAEMON.search(source):
        found.add("daemon")
    fixtures = getattr(item, "fixturenames", ())
    if ("broker" in fixtures or "backlog" in fixtures or item.get_closest_marker("broker")
            or _SERVER.search(source)):
        found.add("broker")
    if item.get_closest_marker("chaos"):
        found.add("chaos")
    return found or {"pure"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test gets its tiers as markers: ``pytest -m pure`` runs the fast logic tests,
    ``-m daemon``, ``-m broker``, ``-m chaos`` the others (``-m "not chaos"``...)."""
    for item in items:
        for tier in tiers(item) - {"broker", "chaos"}:
            item.add_marker(getattr(pytest.mark, tier))
        if "broker" in tiers(item) and not item.get_closest_marker("broker"):
            item.add_marker(pytest.mark.broker("any"))
