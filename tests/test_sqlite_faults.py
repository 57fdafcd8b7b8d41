"""Broker and result-store faults: a full disk, a read-only file, a broker file deleted or
replaced under its path (SQLite), a RabbitMQ that blocks publishers. Each is a fault the
worker rides out and a producer is told about, never a crash or a hang."""
from __future__ import annotations

import logging
import re
import shutil
import os
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kombu import Connection
from kombu.exceptions import OperationalError

import workhorse  # noqa: F401 - registers the sqlite:// transport
from workhorse import App
from workhorse import sqlitedb
from workhorse.backends import RetryPolicy
from workhorse.backends.sqlite import ResultStoreFileError, SQLiteBackend
from workhorse.transport import store as store_module
from workhorse.transport.store import BrokerFileError, Store

from .conftest import IN_CI, BrokerEnv, Worker, make_broker, runs, wait_until, worker_env
from .test_sqlite_wal import cycle as _cycle

#: A payload that needs pages of its own: it cannot fit in what a capped file has.
BIG = "x" * 50_000


class FullDisk:
    """Every SQLite file opened while this is installed can be made "full": its page count
    capped where it stands (SQLite then fails writes with SQLITE_FULL, as on a full disk)."""

    def __init__(self) -> None:
        self.connections: list[sqlite3.Connection] = []
        self.full = False

    def connect(self, real):  # type: ignore[no-untyped-def]
        def connect(*args, **kwargs):  # type: ignore[no-untyped-def]
            conn = real(*args, **kwargs)
            self.connections.append(conn)
            if self.full:
                self._cap(conn)
            return conn
        return connect

    def fill(self) -> None:
        self.full = True
        for conn in self.connections:
            self._cap(conn)

    def free(self) -> None:
        self.full = False
        for conn in self.connections:
            try:
                conn.execute("PRAGMA max_page_count = 1073741823")
            except sqlite3.ProgrammingError:   # closed meanwhile
                pass

    @staticmethod
    def _cap(conn: sqlite3.Connection) -> None:
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count = {pages}")


@pytest.fixture
def full_disk(monkeypatch: pytest.MonkeyPatch) -> FullDisk:
    disk = FullDisk()
    monkeypatch.setattr(sqlitedb, "connect", disk.connect(sqlitedb.connect))
    return disk


@pytest.fixture
def troubles(monkeypatch: pytest.MonkeyPatch) -> sqlitedb.Troubles:
    """This test's own record of the files' troubles, ending at the first write after one."""
    troubles = sqlitedb.Troubles()
    troubles.SETTLE = 0.0
    monkeypatch.setattr(sqlitedb, "troubles", troubles)
    return troubles


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "broker.sqlite3"


@pytest.fixture
def always_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Look at the path before every statement (not at most once a second)."""
    monkeypatch.setattr(store_module, "IDENTITY_CHECK_INTERVAL", 0.0)


# -- what counts as a fault
def test_the_files_troubles_are_faults_and_the_statements_are_not(path):
    conn = sqlite3.connect(path)
    with pytest.raises(sqlite3.OperationalError) as statement:
        conn.execute("SELECT * FROM no_such_table")
    assert not sqlitedb.is_fault(statement.value)
    conn.execute("CREATE TABLE t (v)")
    conn.execute(f"PRAGMA max_page_count = {conn.execute('PRAGMA page_count').fetchone()[0]}")
    with pytest.raises(sqlite3.OperationalError) as full:
        conn.execute("INSERT INTO t VALUES (?)", (BIG,))
    assert sqlitedb.is_fault(full.value)
    assert sqlitedb.describe(path, full.value) == (
        f"{path}: database or disk is full (SQLITE_FULL); free space on its disk")


def test_kombu_counts_a_broker_file_fault_as_a_lost_connection(path):
    with Connection(f"sqlite:///{path}") as conn:
        assert issubclass(BrokerFileError, conn.connection_errors)
        assert issubclass(BrokerFileError, conn.recoverable_connection_errors)


# -- a full disk
def test_a_full_broker_file_raises_a_connection_error_naming_the_file(path, full_disk):
    store = Store(path)
    store.put("q", "{}")
    full_disk.fill()
    with pytest.raises(BrokerFileError, match=f"SQLite broker {path}: database or disk is full "
                                              r"\(SQLITE_FULL\); free space on its disk"):
        store.put("q", BIG)
    full_disk.free()
    store.put("q", BIG)
    assert len(store.browse("q")) == 2


@pytest.mark.timeout(30)
def test_send_task_to_a_full_broker_file_raises_at_once_naming_the_file(path, full_disk):
    app = App("full", broker_url=f"sqlite:///{path}", result_backend="disabled", queues=["q"])
    try:
        app.send_task("t", (1,))
        full_disk.fill()
        started = time.monotonic()
        with pytest.raises(OperationalError, match=f"SQLite broker {path}: database or disk "
                                                   "is full"):
            app.send_task("t", (BIG,))
        assert time.monotonic() - started < 5
        full_disk.free()
        app.send_task("t", (BIG,))
    finally:
        app.close()
    assert len(Store(path).browse("q")) == 2


def test_a_broker_file_that_cannot_be_opened_fails_the_connection(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    with pytest.raises(OperationalError, match="SQLite broker"):
        with Connection(f"sqlite:///{blocker / 'broker.sqlite3'}") as conn:
            conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0)


# -- a file deleted or replaced under its path
def _remove(path: Path, which: str) -> None:
    for suffix in ("", "-wal", "-shm") if which == "all files" else ("",):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


@pytest.mark.parametrize("which", ["main file", "all files"])
def test_a_broker_file_deleted_under_a_consumer_is_opened_anew(path, always_check, caplog, which):
    consumer = Store(path)
    consumer.put("q", '"old"')
    consumer.lease("q", 60)
    _remove(path, which)
    with caplog.at_level(logging.WARNING, logger="workhorse.broker"):
        assert consumer.lease("q", 60) is None       # notices, opens the new file
    assert f"SQLite broker {path} was deleted while open" in caplog.text
    Store(path).put("q", '"new"')                    # a producer, on the file at the path
    leased = consumer.lease("q", 60)
    assert leased is not None and leased[2] == '"new"'


def test_a_broker_file_replaced_under_a_consumer_is_opened_anew(path, tmp_path, always_check,
                                                                 caplog):
    consumer = Store(path)
    consumer.put("q", '"old"')
    replacement = Store(tmp_path / "other.sqlite3")
    replacement.put("q", '"replacement"')
    replacement.close()
    # A WAL file left at the path would be read as the replacement's: it goes too.
    os.replace(tmp_path / "other.sqlite3", path)
    _remove(Path(f"{path}-wal"), "main file")
    _remove(Path(f"{path}-shm"), "main file")
    with caplog.at_level(logging.WARNING, logger="workhorse.broker"):
        leased = consumer.lease("q", 60)
    assert leased is not None and leased[2] == '"replacement"'
    assert f"SQLite broker {path} was replaced while open" in caplog.text


def test_leases_from_a_deleted_broker_file_stay_held_and_settle_nothing(path, always_check):
    consumer = Store(path)
    consumer.put("q", '"old"')
    ident, token, _, _ = consumer.lease("q", 60)
    old = (ident, token)
    _remove(path, "all files")
    consumer.put("q", '"new"')                       # into the new file, same id
    # Nothing else can deliver it now: it stays ours, to run here...
    assert consumer.renew([old], 60) == {old}
    # ...and settling it touches nothing in the new file.
    assert consumer.ack(old) is False
    assert consumer.release([old], uncount=True) == 0
    assert consumer.forget(old) is False
    assert [payload for _, payload, _, _ in consumer.browse("q")] == ['"new"']


@pytest.mark.timeout(30)
def test_a_producer_puts_into_the_file_now_at_the_path(path):
    producer = Store(path)
    producer.put("q", '"before"')
    _remove(path, "all files")
    producer.put("q", '"after"')                     # looks at the path before every put
    assert [payload for _, payload, _, _ in Store(path).browse("q")] == ['"after"']


# -- the result store
def test_a_full_result_store_is_retried_with_back_off_then_named_once(tmp_path, full_disk, caplog,
                                                                      troubles):
    path = tmp_path / "results.sqlite3"
    backend = SQLiteBackend(f"sqlite:///{path}",
                            retry=RetryPolicy(max_retries=3, base_sleep=0.01, max_sleep=0.05))
    backend.store_result("small", 1, "SUCCESS")
    full_disk.fill()
    with caplog.at_level(logging.DEBUG, logger="workhorse"), \
            pytest.raises(ResultStoreFileError, match=f"SQLite result store {path}: database or "
                                                      "disk is full"):
        backend.store_result("big", BIG, "SUCCESS")
    retries = [r for r in caplog.records if r.name == "workhorse.results"]
    assert [r.levelno for r in retries] == [logging.DEBUG] * 3     # said once, below
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1 and said[0].startswith(
        f"SQLite result store {path}: database or disk is full (SQLITE_FULL); free space on "
        "its disk (")
    full_disk.free()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="workhorse.sqlite"):
        backend.store_result("big", BIG, "SUCCESS")
    assert backend.get_task_meta("big")["status"] == "SUCCESS"
    assert f"SQLite result store {path} is written again" in caplog.text


def test_a_result_store_opened_read_only_is_opened_again(tmp_path):
    path = tmp_path / "results.sqlite3"
    backend = SQLiteBackend(f"sqlite:///{path}",
                            retry=RetryPolicy(max_retries=2, base_sleep=0.01, max_sleep=0.01))
    backend.store_result("a", 1, "SUCCESS")
    backend.close()
    # As if opened while its files were read-only: the connection cannot write, ever.
    backend._conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)
    backend._pid = os.getpid()
    backend.store_result("b", 2, "SUCCESS")
    assert backend.get_task_meta("b")["result"] == 2



# -- the real daemon on SQLite
def _client(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> App:
    """The test app configured like the worker (``env``), for sending and reading results."""
    for key, value in env.items():
        if key.startswith(("WORKHORSE_", "WH_TEST_")):
            monkeypatch.setenv(key, value)
    from tests.apps import basic
    basic.app.configure()
    return basic.app


def _succeeded(app: App, ids: list[str]) -> int:
    return sum(app.AsyncResult(i).state == "SUCCESS" for i in ids)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", ["main file", "all files"])
def test_tasks_sent_after_the_broker_file_is_deleted_run(tmp_path, start_worker, monkeypatch,
                                                         which):
    broker = make_broker("sqlite", tmp_path)
    worker = start_worker(broker)
    app = _client(monkeypatch, worker_env(broker, tmp_path))
    try:
        first = app.send_task("tests.apps.basic.record")
        wait_until(lambda: _succeeded(app, [first.id]), 20, "a task before the delete")
        path = Path(broker.url.removeprefix("sqlite:///"))
        app.close()         # the producer comes back as a new one would: on a new connection
        _remove(path, which)
        ids = [_send_until_accepted(app, 10) for _ in range(5)]
        wait_until(lambda: _succeeded(app, ids) == 5, 15, "the tasks sent after the delete")
    finally:
        app.close()
    assert re.search(f"SQLite broker {path} was (deleted|replaced) while open", worker.log())
    assert worker.proc.poll() is None


def test_a_queue_that_cannot_be_declared_is_tried_again_then_raised_as_a_send_error(
        tmp_path, monkeypatch):
    """The queue's declaration, on a producer's first send to it, meets the file's
    trouble (here an I/O error, as a file deleted a moment ago gives): it is tried again as
    the publish is, and raised as kombu's OperationalError, as the publish's errors are."""
    from workhorse.transport import sqlite as transport
    broker = make_broker("sqlite", tmp_path)
    app = _client(monkeypatch, worker_env(broker, tmp_path))
    real_size, failures = transport.Channel._size, [1]

    def size(channel: transport.Channel, queue: str) -> int:
        if failures[0] > 0:
            failures[0] -= 1
            raise BrokerFileError(tmp_path, sqlite3.OperationalError("disk I/O error"))
        return real_size(channel, queue)
    monkeypatch.setattr(transport.Channel, "_size", size)
    try:
        app.send_task("tests.apps.basic.record")            # once in trouble: sent
        assert failures == [0] and broker.queue_size() == 1
        failures[0] = 1000
        with pytest.raises(OperationalError, match="disk I/O error"):
            app.send_task("tests.apps.basic.record", queue=broker.queue + "-other")
        failures[0] = 0
        app.send_task("tests.apps.basic.record", queue=broker.queue + "-other")
        assert broker.queue_size(broker.queue + "-other") == 1
    finally:
        app.close()


def _send_until_accepted(app: App, timeout: float) -> str:
    """Until the worker has left the deleted file (within a second), a new file at the path
    paired with the old one's -wal and -shm cannot be read: the producer is told, and
    sends again."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return app.send_task("tests.apps.basic.record").id
        except OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _mount_tmpfs(mount: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` of our own at ``mount``, to fill. Mounting needs root (or
    CAP_SYS_ADMIN): elsewhere the test is skipped, but in CI (CI=true) that is a failure."""
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        message = f"cannot mount a {size} tmpfs to fill ({done.stderr.strip()})"
        if IN_CI:
            pytest.fail(f"{message}, and CI=true makes the real full-disk tests mandatory: "
                        "run them as root")
        pytest.skip(f"{message}; run as root to test a real full disk")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MB tmpfs of our own to fill."""
    yield from _mount_tmpfs(tmp_path / "disk", "16M")


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs of our own to fill: smaller than SQLite's default write-ahead log
    grows to between checkpoints (1000 pages)."""
    yield from _mount_tmpfs(tmp_path / "disk", "4m")


def _fill(directory: Path) -> Path:
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:
            pass
        try:
            while True:
                f.write(b"\0")
        except OSError:
            pass
    return filler


@pytest.mark.timeout(60)
def test_a_broker_on_a_disk_full_to_the_last_byte_writes_on_in_the_space_its_files_have(
        tiny_disk):
    store = Store(tiny_disk / "broker.sqlite3")
    for _ in range(300):
        store.put("q", "x" * 1000)      # a backlog, then drained: pages the file keeps free
    while taken := store.lease_many(["q"], 60, 64):
        store.ack_many([(ident, token) for _, ident, token, _, _ in taken])
    _fill(tiny_disk)
    _cycle(store, 3000)                 # some 10 MB through the log, which does not grow
    assert store.size("q") == 0


@pytest.mark.timeout(60)
def test_a_broker_file_that_filled_its_disk_writes_at_once_when_room_for_its_log_returns(
        tiny_disk, troubles, caplog):
    """What the log holds past the end of the file needs room in the file before the log
    can start over: at most the log's checkpoint size, and the next transaction's. No more
    is needed however long the disk was full, or however much the log held before."""
    path = tiny_disk / "broker.sqlite3"
    ballast = tiny_disk / "ballast"
    ballast.write_bytes(b"\0" * (sqlitedb.WAL_CHECKPOINT_BYTES + 4 * len(BIG)))
    store = Store(path)
    with caplog.at_level(logging.INFO, logger="workhorse"):
        with pytest.raises(BrokerFileError, match="disk is full"):
            while True:
                store.put("q", BIG)     # a backlog that fills the disk itself
        for _ in range(20):             # each retry meets it again
            with pytest.raises(BrokerFileError, match="disk is full"):
                store.put("q", BIG)
        ballast.unlink()
        # The first write goes through (no reconnect, no retry), and the log needs no more
        # space for those after it: thousands of messages come and go. (A take rewrites
        # the rows it leases, payload and all: a few of 50 kB at a time, as a worker's
        # prefetch window takes them.)
        while taken := store.lease_many(["q"], 60, 4):
            store.ack_many([(ident, token) for _, ident, token, _, _ in taken])
        _cycle(store, 3000)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1 and said[0].startswith(
        f"SQLite broker {path}: database or disk is full (SQLITE_FULL); free space on its "
        "disk (0 bytes free on its file system; its write-ahead log holds")
    assert f"SQLite broker {path} is written again" in caplog.text
    assert not troubles.troubled(path)


@pytest.mark.timeout(150)
def test_a_full_disk_is_ridden_out_and_work_resumes_when_space_returns(
        tmp_path, small_disk, start_worker, monkeypatch):
    broker = BrokerEnv("sqlite", f"sqlite:///{small_disk / 'broker.sqlite3'}", "full")
    results = small_disk / "results.sqlite3"
    worker = start_worker(broker, result_backend=f"sqlite:///{results}", visibility_timeout=5)
    app = _client(monkeypatch, worker_env(broker, tmp_path, result_backend=f"sqlite:///{results}",
                                          visibility_timeout=5))
    try:
        ids = [app.send_task("tests.apps.basic.record", (0.1,)).id for _ in range(20)]
        wait_until(lambda: len(runs(tmp_path)) >= 2, 20, "the first tasks to start")
        filler = _fill(small_disk)
        path = small_disk / "broker.sqlite3"
        started = time.monotonic()
        with pytest.raises(OperationalError, match=f"SQLite broker {path}: database or disk "
                                                   "is full"):
            app.send_task("tests.apps.basic.record", (BIG,))
        assert time.monotonic() - started < 5      # a clear error, not a hang
        wait_until(lambda: worker.proc.poll() is not None
                   or time.monotonic() - started > 6, 10, "six seconds of full disk")
        assert worker.proc.poll() is None, worker.log()[-3000:]
        # The worker's writes go on in the space its files have, or fail; the trouble is
        # said once a file (the broker, the results in each child), not once a retry, nor
        # is every reconnect.
        assert worker.log().count("disk is full") <= 3, worker.log()[-3000:]
        assert worker.log().count("ready: consuming") == 1, worker.log()[-3000:]
        filler.unlink()
        wait_until(lambda: _succeeded(app, ids) == len(ids), 90, "every task, once space is back")
        after = app.send_task("tests.apps.basic.record")
        wait_until(lambda: _succeeded(app, [after.id]), 20, "a task sent after")
    finally:
        app.close()
    assert worker.proc.poll() is None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _wal_sizes(*paths: Path) -> dict[str, int]:
    return {path.name: _size(Path(f"{path}-wal")) for path in paths}


def _free(directory: Path) -> int:
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize


@pytest.mark.timeout(150)
def test_work_resumes_within_seconds_of_space_returning_and_a_full_disk_is_said_once(
        tmp_path, tiny_disk, start_worker, monkeypatch):
    """Issue 25: with less free space back than the write-ahead log had grown to, the
    worker reconnected, failed its first write, and was "lost" again, 167 times in 4
    minutes, leaving tasks never run."""
    broker = BrokerEnv("sqlite", f"sqlite:///{tiny_disk / 'broker.sqlite3'}", "tiny")
    path = tiny_disk / "broker.sqlite3"
    results = tiny_disk / "results.sqlite3"
    settings = {"result_backend": f"sqlite:///{results}"}
    worker = start_worker(broker, **settings)
    app = _client(monkeypatch, worker_env(broker, tmp_path, **settings))
    try:
        ids = [app.send_task("tests.apps.basic.record", (0.05,)).id for _ in range(100)]
        wait_until(lambda: len(runs(tmp_path)) >= 4, 20, "the first tasks to start")
        filler = _fill(tiny_disk)
        full_until = time.monotonic() + 10
        worker.wait_for_log("database or disk is full", 20)
        wait_until(lambda: worker.proc.poll() is not None or time.monotonic() >= full_until,
                   15, "ten seconds of full disk")
        assert worker.proc.poll() is None, worker.log()[-3000:]
        wals = _wal_sizes(path, results)
        filler.unlink()
        freed_at = time.monotonic()
        free = _free(tiny_disk)
        try:
            wait_until(lambda: _succeeded(app, ids) == len(ids), 30,
                       "every task, within 30 s of space returning")
        finally:
            log_text = worker.log()
            print(f"\nfull disk: {free} bytes free once the filler went; write-ahead logs "
                  f"then {wals}, at the end {_wal_sizes(path, results)} with {_free(tiny_disk)} "
                  f"bytes free; resumed in {time.monotonic() - freed_at:.1f} s; "
                  f"{_succeeded(app, ids)}/{len(ids)} succeeded; "
                  f"{len({i for _, i, _ in runs(tmp_path)} & set(ids))} ran; "
                  f"{log_text.count('broker connection lost')} 'connection lost' lines, "
                  f"{log_text.count('disk is full')} lines saying the disk is full")
    finally:
        app.close()
    # Once for the broker file, and once for the result file by each process that writes
    # it (two children here); then each says once that it writes again.
    said = [line for line in log_text.splitlines() if "disk is full" in line]
    assert len(said) <= 3, "\n".join(said[:20])
    assert all("Calls that need it fail and are retried" in line for line in said)
    written = [line for line in log_text.splitlines() if "is written again, after" in line]
    assert len(written) == len(said), "\n".join(written)
    assert worker.proc.poll() is None


def _without_root_file_access() -> list[str]:
    """As root the worker drops the capabilities that let it write read-only files."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("as root, read-only files need setpriv to run the worker without "
                    "CAP_DAC_OVERRIDE")
    return [setpriv, "--bounding-set", "-dac_override,-dac_read_search"]


@pytest.mark.timeout(180)
def test_read_only_broker_and_result_files_lose_nothing(tmp_path, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    broker = BrokerEnv("sqlite", f"sqlite:///{data / 'broker.sqlite3'}", "ro")
    results = data / "results.sqlite3"
    # One task per child: each child opens the result store anew, read-only once it is.
    env = worker_env(broker, tmp_path, result_backend=f"sqlite:///{results}",
                     max_tasks_per_child=1)
    worker = Worker(tmp_path, env, ["-A", "tests.apps.basic"], wrapper=_without_root_file_access())
    app = _client(monkeypatch, env)
    try:
        worker.wait_ready()
        first = app.send_task("tests.apps.basic.record")
        wait_until(lambda: _succeeded(app, [first.id]), 20, "a result, so its files exist")
        # Both children busy when the files turn read-only: every result fails to store.
        ids = [app.send_task("tests.apps.basic.record", (1.0,)).id for _ in range(2)]
        ids += [app.send_task("tests.apps.basic.record").id for _ in range(6)]
        files = sorted(data.glob("*.sqlite3*"))
        for file in files:
            file.chmod(0o444)
        data.chmod(0o555)
        dead = Store(data / "broker.sqlite3")
        try:
            # Five seconds read-only: a tight loop (stored nothing, requeued, redelivered at
            # once) uses up max_deliveries and dead-letters long before; retries back off.
            read_only_until = time.monotonic() + 5
            wait_until(lambda: dead.browse("ro.dead") or time.monotonic() > read_only_until,
                       30, "five seconds of read-only files")
            assert f"SQLite result store {results}: attempt to write a readonly" in worker.log()
            assert worker.proc.poll() is None
        finally:
            data.chmod(0o755)
            for file in files:
                file.chmod(0o644)
        wait_until(lambda: _succeeded(app, ids) == len(ids), 120,
                   "every task, once the files are writable again")
        assert dead.browse("ro.dead") == []
        assert worker.proc.poll() is None
    finally:
        worker.kill()
        app.close()
