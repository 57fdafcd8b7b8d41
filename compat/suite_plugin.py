"""A pytest plugin that points Celery's integration suite at a worker run as a subprocess.

Loaded with ``-p suite_plugin`` before the suite's conftest is imported, it replaces
``celery.contrib.pytest.celery_session_worker`` (which that conftest imports by name) with a
fixture that starts a worker as a subprocess on the suite's broker and backend, waits until
it consumes, and stops it with SIGTERM after the session. Nothing in the suite's files
changes. The environment chooses the worker:

- ``SUITE_WORKER=workhorse``: ``python -m workhorse worker -A suite_app:app``;
- ``SUITE_WORKER=celery``: ``python -m celery -A suite_app:app worker -P prefork`` (the
  baseline: the same harness, Celery's worker);
- unset: the suite's own fixture (a Celery worker in a thread of the test process).

``SUITE_CONCURRENCY`` (default 1, as the suite's own fixture) sets the pool size and
``SUITE_WORKER_LOG`` where the worker's output goes.
"""
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import celery.contrib.pytest
from celery.utils.nodenames import anon_nodename


def _command(worker: str, concurrency: str) -> tuple[list[str], bytes]:
    """The worker's command line and the line it logs once it consumes. Either is named as
    the suite's own in-process worker would be (``anon_nodename()``: gen<pid>@<host>, the
    pid this test process's), which the inspect tests look their replies up by."""
    broker, backend = os.environ["TEST_BROKER"], os.environ["TEST_BACKEND"]
    name = anon_nodename()
    if worker == "workhorse":
        return ([sys.executable, "-m", "workhorse", "worker", "-A", "suite_app:app",
                 "-Q", "celery", "-c", concurrency, "-l", "INFO", "-n", name,
                 "--broker-url", broker, "--result-backend", backend, "--result-extended"],
                b"ready: consuming")
    if worker == "celery":
        return ([sys.executable, "-m", "celery", "-A", "suite_app:app", "worker",
                 "-P", "prefork", "-c", concurrency, "-Q", "celery", "-l", "INFO", "-n", name,
                 "--without-gossip", "--without-mingle", "--without-heartbeat"],
                b" ready.")
    raise SystemExit(f"SUITE_WORKER must be 'workhorse' or 'celery', not {worker!r}")


def _start(worker: str, log_path: Path) -> subprocess.Popen[bytes]:
    command, ready = _command(worker, os.environ.get("SUITE_CONCURRENCY", "1"))
    env = dict(os.environ, WORKHORSE_STATE_DIR=str(log_path.with_suffix(".state")))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + 60
    while ready not in log_path.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError(f"the {worker} worker did not start; its log: {log_path}")
        time.sleep(0.2)
    return proc


@pytest.fixture(scope="session")
def celery_session_worker(celery_session_app) -> Iterator[None]:  # type: ignore[no-untyped-def]
    worker = os.environ["SUITE_WORKER"]
    log_path = Path(os.environ.get("SUITE_WORKER_LOG", f"{worker}-worker.log")).resolve()
    proc = _start(worker, log_path)
    try:
        yield None
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        timer = threading.Timer(30, lambda: os.killpg(proc.pid, signal.SIGKILL))
        timer.start()
        proc.wait()
        timer.cancel()


if os.environ.get("SUITE_WORKER"):
    celery.contrib.pytest.celery_session_worker = celery_session_worker
