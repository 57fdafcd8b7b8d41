"""Logs, pidfile and health: the formats and files (pure), then a real worker writing
JSON to a log file that is rotated under it, one under a journal stream, one refusing a
taken pidfile, and ``workhorse health`` following a supervisor that stops turning."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from workhorse import logs
from workhorse.daemon import hostfiles

from .conftest import ROOT, Worker, wait_until, worker_env

pytestmark = pytest.mark.timeout(120)


def _record(message: str, level: int = logging.ERROR, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("inner\nline")
        except ValueError:
            exc_info = sys.exc_info()
    return logging.LogRecord("workhorse.child", level, __file__, 1, message, (), exc_info)


# ---------------------------------------------------------------- formats (pure)
def test_json_lines_carry_the_traceback_in_one_record():
    line = logs.JSONFormatter().format(_record("Task t[1] raised", exc=True))
    assert "\n" not in line
    found = json.loads(line)
    assert found["level"] == "ERROR" and found["logger"] == "workhorse.child"
    assert found["message"] == "Task t[1] raised" and found["pid"] == os.getpid()
    assert "ValueError: inner\nline" in found["traceback"]
    assert found["time"][:4].isdigit() and "T" in found["time"]


def test_journal_lines_start_with_the_priority_and_keep_a_record_on_one_line():
    journal = logs.JournalFormatter(logging.Formatter(logs.TEXT_FORMAT))
    line = journal.format(_record("two\nlines", exc=True))
    assert line.startswith("<3>[") and "\n" not in line
    assert "two\\nlines" in line and "Traceback (most recent call last):\\n" in line
    assert journal.format(_record("hi", logging.INFO)).startswith("<6>")
    assert journal.format(_record("hm", logging.WARNING)).startswith("<4>")
    assert journal.format(_record("x", logging.CRITICAL)).startswith("<2>")
    assert journal.format(_record("d", logging.DEBUG)).startswith("<7>")


def test_the_journal_stream_is_recognised_by_device_and_inode(tmp_path, monkeypatch):
    with open(tmp_path / "stream", "w") as stream, open(tmp_path / "other", "w") as other:
        stat = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{stat.st_dev}:{stat.st_ino}")
        assert logs.under_journald(stream) and not logs.under_journald(other)
        monkeypatch.setenv("JOURNAL_STREAM", "garbage")
        assert not logs.under_journald(stream)


def test_a_log_file_moved_away_is_opened_again(tmp_path, monkeypatch):
    path = tmp_path / "logs" / "worker.log"
    handler = logs.ReopeningFileHandler(path)
    handler.setFormatter(logging.Formatter("%(message)s"))
    try:
        handler.emit(_record("first"))
        path.rename(tmp_path / "worker.log.1")              # logrotate
        monkeypatch.setattr(logs, "REOPEN_CHECK", 0.0)
        handler.emit(_record("second"))
        assert path.read_text() == "second\n"
        assert (tmp_path / "worker.log.1").read_text() == "first\n"
        path.rename(tmp_path / "worker.log.2")
        handler.reopen()                                    # SIGUSR2
        handler.emit(_record("third"))
        assert path.read_text() == "third\n"
    finally:
        handler.close()


# ---------------------------------------------------------------- host files (pure)
def test_health_is_fresh_running_and_consuming(tmp_path):
    path = tmp_path / "h.json"
    assert "no health file" in hostfiles.check_health(path)
    hostfiles.write_health(path, phase="running", broker_thread=True, connected=True,
                           broker="broker x connected")
    assert hostfiles.check_health(path) is None
    hostfiles.write_health(path, phase="running", broker_thread=True, connected=False,
                           broker="broker x not connected")
    assert "not consuming: broker x not connected" in hostfiles.check_health(path)
    hostfiles.write_health(path, phase="warm shutdown", broker_thread=True, connected=True)
    assert "not running tasks: warm shutdown" in hostfiles.check_health(path)
    hostfiles.write_health(path, phase="running", broker_thread=False, connected=True,
                           broker="b")
    assert "broker thread does not turn" in hostfiles.check_health(path)
    path.write_text(json.dumps({"pid": os.getpid(), "written": time.time() - 60}))
    assert "stuck or gone" in hostfiles.check_health(path)
    path.write_text("{not json")
    assert "cannot read" in hostfiles.check_health(path)


def test_a_pidfile_held_by_a_live_workhorse_is_refused_and_a_stale_one_taken(tmp_path):
    path = tmp_path / "run" / "w.pid"
    hostfiles.write_pidfile(path)
    assert path.read_text() == f"{os.getpid()}\n"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                               "workhorse"])
    try:
        path.write_text(f"{holder.pid}\n")
        with pytest.raises(hostfiles.PidfileTaken, match=f"names pid {holder.pid}"):
            hostfiles.write_pidfile(path)
    finally:
        holder.kill()
        holder.wait(10)
    hostfiles.write_pidfile(path)            # its holder is gone: stale, taken
    hostfiles.remove_pidfile(path)
    assert not path.exists()


# ---------------------------------------------------------------- a real worker
@pytest.mark.parametrize("broker", ["sqlite"], indirect=True)
def test_json_log_file_rotated_under_a_running_worker(broker, start_worker, client, tmp_path):
    logfile = tmp_path / "log" / "worker.log"
    worker = start_worker(broker, ready=False, log_format="json", logfile=logfile,
                          concurrency=1)
    wait_until(lambda: logfile.exists() and "ready: consuming" in logfile.read_text(), 30,
               "the worker to log that it is ready")
    failed = client.send_task("tests.apps.basic.fail", ("boom",))
    with pytest.raises(Exception, match="boom"):
        failed.get(timeout=30)
    records = [json.loads(line) for line in logfile.read_text().splitlines()]
    [raised] = [r for r in records if failed.id in r["message"] and "raised" in r["message"]]
    assert raised["level"] == "ERROR" and raised["process"].startswith("child")
    assert "Traceback" in raised["message"] or "Traceback" in raised.get("traceback", "")

    logfile.rename(logfile.with_name("worker.log.1"))
    worker.signal(signal.SIGUSR2)
    wait_until(lambda: logfile.exists() and "log file opened again" in logfile.read_text(),
               20, "the supervisor to open the log file again")
    # A child forked after the reopen writes to the new file too (it opens it itself: the
    # supervisor's new descriptor is not one children keep).
    [old_child] = worker.children()
    os.kill(old_child, signal.SIGKILL)
    wait_until(lambda: (lambda pids: len(pids) == 1 and pids[0] != old_child)(
        worker.children()), 20, "the child's replacement")
    after = client.send_task("tests.apps.basic.add", (1, 2))
    assert after.get(timeout=30) == 3
    wait_until(lambda: after.id in logfile.read_text(), 20, "the new child's record there")
    assert after.id not in logfile.with_name("worker.log.1").read_text()
    assert worker.log() == ""                                   # nothing went to stderr


@pytest.mark.parametrize("broker", ["sqlite"], indirect=True)
def test_under_a_journal_stream_records_carry_priorities_and_stay_one_line(
        broker, client, tmp_path):
    wrapper = ["sh", "-c", 'JOURNAL_STREAM=$(stat -L -c "%d:%i" /proc/self/fd/2) exec "$@"',
               "sh"]
    worker = Worker(tmp_path, worker_env(broker, tmp_path), ["-A", "tests.apps.basic"],
                    wrapper=wrapper)
    try:
        worker.wait_ready()
        failed = client.send_task("tests.apps.basic.fail", ("boom",))
        with pytest.raises(Exception, match="boom"):
            failed.get(timeout=30)
        wait_until(lambda: failed.id in worker.log(), 20, "the failure logged")
        lines = worker.log().splitlines()
        assert all(line[:3] in ("<2>", "<3>", "<4>", "<6>", "<7>") for line in lines), lines
        [raised] = [line for line in lines if failed.id in line and "raised" in line]
        assert raised.startswith("<3>") and "Traceback (most recent call last):\\n" in raised
        assert any(line.startswith("<6>") and "ready: consuming" in line for line in lines)
    finally:
        worker.kill()


def _health(broker, tmp_path, *args: str) -> subprocess.CompletedProcess:
    """``workhorse health`` for the worker named HEALTHY (its health file is per name)."""
    return subprocess.run([sys.executable, "-m", "workhorse", "health", *args],
                          env=worker_env(broker, tmp_path, hostname=HEALTHY), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


HEALTHY = "healthy@test"


@pytest.mark.parametrize("broker", ["redis"], indirect=True)
def test_health_and_pidfile_follow_the_supervisor(broker, start_worker, tmp_path):
    pidfile = tmp_path / "worker.pid"
    worker = start_worker(broker, pidfile=pidfile, hostname=HEALTHY)
    assert pidfile.read_text() == f"{worker.pid}\n"
    second = start_worker(broker, ready=False, pidfile=pidfile)
    assert second.wait_exit(30) == 2
    assert f"names pid {worker.pid}" in second.log()

    wait_until(lambda: _health(broker, tmp_path).returncode == 0, 20, "healthy")
    worker.signal(signal.SIGSTOP)                        # the loop stops turning
    try:
        stuck = wait_until(lambda: (lambda r: r if r.returncode == 1 else None)(
            _health(broker, tmp_path, "--max-age", "3")), 20, "unhealthy")
        assert "stuck or gone" in stuck.stderr
    finally:
        worker.signal(signal.SIGCONT)
    wait_until(lambda: _health(broker, tmp_path, "--max-age", "3").returncode == 0, 20,
               "healthy again")
    assert worker.stop() == 0
    assert not pidfile.exists()
    gone = _health(broker, tmp_path)
    assert gone.returncode == 1 and "no health file" in gone.stderr
