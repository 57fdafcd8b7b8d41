"""How late time limits, signals and watchdog pings are while the broker hangs.

    python benchmarks/frozen_broker.py --broker redis --broker amqp --broker sqlite

For each broker a worker (concurrency 1, soft 3 s / hard 4 s limits, watchdog every 0.5 s
through a notify socket of this script's) starts a task that sleeps 30 s, catching
SoftTimeLimitExceeded. One second in, the broker goes silent: Redis and RabbitMQ behind a
loopback proxy that stops forwarding (connections stay open, nothing answers), SQLite
behind another process holding its write lock. The hard kill requeues the task
(acks_on_timeout = false), which publishes a copy.

Printed: when the soft limit was raised and the child hard-killed (should be 3.0 and 4.0 s
after the start), how late the later of two SIGUSR1 (2 s and 6 s in) was answered ("-": not
within the 15 s watched), and the longest gap between watchdog pings while the broker was
silent (about 0.5 s when nothing waits on it).
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.proxy import FreezableProxy  # noqa: E402

PORTS = {"redis": 6379, "amqp": 5672}
STAMP = re.compile(r"^\[(\d+-\d+-\d+ [\d:]+,\d+) ")


def _seconds(line: str) -> float:
    match = STAMP.match(line)
    assert match, line
    stamp = time.strptime(match.group(1).split(",")[0], "%Y-%m-%d %H:%M:%S")
    return time.mktime(stamp) + int(match.group(1).split(",")[1]) / 1000


def _first(log: str, pattern: str) -> float | None:
    for line in log.splitlines():
        if re.search(pattern, line):
            return _seconds(line)
    return None


def _running(pid: int) -> bool:
    """Has the worker's child started the task (its process title says so)?"""
    import psutil
    try:
        return any("running tests.apps.basic.outlive_soft" in " ".join(c.cmdline())
                   for c in psutil.Process(pid).children())
    except psutil.Error:
        return False


def run(kind: str, directory: Path) -> dict[str, float | None]:
    import subprocess

    from workhorse import App
    queue = f"frozen-{os.getpid()}-{kind}"
    proxy = None
    if kind == "sqlite":
        url = f"sqlite:///{directory / 'broker.sqlite3'}"
    else:
        proxy = FreezableProxy(PORTS[kind])
        url = proxy.url("redis", "/5") if kind == "redis" else proxy.url("amqp", "//")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(directory / "notify.sock"))
    notify.settimeout(0.05)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKHORSE_")}
    env.update(PYTHONPATH=str(ROOT), WORKHORSE_BROKER_URL=url, WORKHORSE_QUEUES=queue,
               WORKHORSE_RESULT_BACKEND=f"sqlite:///{directory / 'results.sqlite3'}",
               WORKHORSE_STATE_DIR=str(directory), WORKHORSE_CONCURRENCY="1",
               WORKHORSE_SOFT_TIME_LIMIT="3", WORKHORSE_TIME_LIMIT="4",
               WORKHORSE_ACKS_ON_TIMEOUT="false",    # the hard kill requeues: a publish
               NOTIFY_SOCKET=str(directory / "notify.sock"), WATCHDOG_USEC="1000000")
    log_path = directory / "worker.log"
    with open(log_path, "wb") as log_file:
        worker = subprocess.Popen(
            [sys.executable, "-m", "workhorse", "worker", "-A", "tests.apps.basic"],
            cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT,
            start_new_session=True)
    pings: list[float] = []
    try:
        deadline = time.monotonic() + 30
        while "ready: consuming" not in log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        client = App("client", broker_url=url, queues=[queue],
                     result_backend=env["WORKHORSE_RESULT_BACKEND"])
        client.send_task("tests.apps.basic.outlive_soft", args=[30])
        while not _running(worker.pid) and time.monotonic() < deadline + 10:
            time.sleep(0.005)
        started = time.time()
        locker = None
        time.sleep(1.0)
        if proxy is not None:
            proxy.freeze()
        else:
            locker = sqlite3.connect(directory / "broker.sqlite3", isolation_level=None)
            locker.execute("BEGIN EXCLUSIVE")
        frozen_at = time.time()
        sent_usr1: list[float] = []
        while time.time() < started + 15:
            if len(sent_usr1) < 2 and time.time() >= started + (2, 6)[len(sent_usr1)]:
                sent_usr1.append(time.time())
                os.kill(worker.pid, signal.SIGUSR1)
            try:
                if b"WATCHDOG=1" in notify.recv(4096):
                    pings.append(time.time())
            except TimeoutError:
                pass
        log = log_path.read_text()
        soft = _first(log, r"soft time limit")
        hard = _first(log, r"hard time limit")
        answers = [_seconds(line) for line in log.splitlines() if "state: phase=" in line]
        marks = [frozen_at, *(p for p in pings if p >= frozen_at), started + 15]
        gaps = [b - a for a, b in zip(marks, marks[1:], strict=False)]
        return {
            "soft limit at": None if soft is None else soft - started,
            "hard kill at": None if hard is None else hard - started,
            "SIGUSR1 late by": (max(a - s for a, s in zip(answers, sent_usr1, strict=False))
                                if len(answers) == len(sent_usr1) else None),
            "longest watchdog gap": max(gaps) if gaps else None,
        }
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        notify.close()
        if proxy is not None:
            proxy.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--broker", choices=["redis", "amqp", "sqlite"], action="append")
    args = parser.parse_args()
    print(f"{'broker':8} {'soft limit at':>14} {'hard kill at':>13} {'SIGUSR1 late by':>16} "
          f"{'longest watchdog gap':>21}   (seconds; ideal 3.0, 4.0, 0.0, 0.5)")
    for kind in args.broker or ["redis", "amqp", "sqlite"]:
        with tempfile.TemporaryDirectory() as directory:
            figures = run(kind, Path(directory))
        cells = ["-" if v is None else f"{v:.2f}" for v in figures.values()]
        print(f"{kind:8} {cells[0]:>14} {cells[1]:>13} {cells[2]:>16} {cells[3]:>21}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
