"""How fast the supervisor acts: on a signal, on a time limit, and at an ETA.

    python benchmarks/latency.py

Signal: SIGUSR1 is sent to an idle worker; the latency is the time from os.kill() to the
timestamp of the state dump the handler logs. Time limits: tasks with a 0.3 s hard limit
sleep for 5 s; the overrun is the time from the task's start plus 0.3 s to the logged
kill. ETA: tasks scheduled 1-2 s ahead; the lateness is from the ETA to the task's own
start. Log timestamps have millisecond resolution. Medians, 95th percentiles and maxima.
"""
from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kombu import Connection, Producer  # noqa: E402

import workhorse  # noqa: E402,F401
from workhorse.protocol import build_message  # noqa: E402
from workhorse.broker.queues import ensure_queue  # noqa: E402

STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def stamps(log: Path, marker: str) -> list[float]:
    out = []
    for line in log.read_text().splitlines():
        match = STAMP.match(line)
        if match and marker in line:
            out.append(datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp())
    return out


def wait(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out")
        time.sleep(0.002)


def summary(values_ms: list[float]) -> str:
    values = sorted(values_ms)
    p95 = values[min(len(values) - 1, int(round(0.95 * (len(values) - 1))))]
    return (f"median {statistics.median(values):6.1f} ms  p95 {p95:6.1f} ms  "
            f"max {values[-1]:6.1f} ms")


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        url = f"sqlite:///{work / 'broker.sqlite3'}"
        queue = "latency"
        log = work / "worker.log"
        starts = work / "starts"
        env = {k: v for k, v in os.environ.items() if not k.startswith("WORKHORSE_")}
        env.update(PYTHONPATH=str(ROOT), WORKHORSE_BROKER_URL=url,
                   WORKHORSE_RESULT_BACKEND="disabled", WORKHORSE_STATE_DIR=str(work),
                   BENCH_STARTS=str(starts), BENCH_COUNTER=str(work / "count"))
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "workhorse", "worker", "-A", "benchmarks.bench_tasks:app",
                 "-c", "1", "-Q", queue], cwd=ROOT, env=env, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait(lambda: "ready: consuming" in log.read_text())
            signal_ms = []
            for i in range(30):
                time.sleep(0.05)     # let the loop go idle: the case the target is about
                sent = time.time()
                os.kill(proc.pid, signal.SIGUSR1)
                wait(lambda seen=i: len(stamps(log, "state: phase=")) > seen)
                signal_ms.append((stamps(log, "state: phase=")[-1] - sent) * 1000)
            limit, runs = 0.3, 10
            with Connection(url) as conn:
                ensure_queue(conn, queue)
                producer = Producer(conn)
                for _ in range(runs):
                    msg = build_message("bench.hold", str(uuid.uuid4()), [5], time_limit=limit,
                                        ignore_result=True)
                    producer.publish(msg.body, exchange="", routing_key=queue,
                                     serializer="json", headers=msg.headers)
            wait(lambda: len(stamps(log, "s) exceeded; killing")) >= runs, 60)
            began = [float(x) for x in starts.read_text().split()]
            kills = stamps(log, "s) exceeded; killing")
            overrun_ms = [(k - (b + limit)) * 1000 for b, k in zip(began, kills, strict=False)]
            starts.unlink()
            etas = [datetime.now(UTC) + timedelta(seconds=1 + i / 10) for i in range(runs)]
            with Connection(url) as conn:
                producer = Producer(conn)
                for eta in etas:
                    msg = build_message("bench.hold", str(uuid.uuid4()), [0], eta=eta,
                                        ignore_result=True)
                    producer.publish(msg.body, exchange="", routing_key=queue,
                                     serializer="json", headers=msg.headers)
            wait(lambda: starts.exists() and len(starts.read_text().split()) >= runs, 60)
            began = sorted(float(x) for x in starts.read_text().split())
            late_ms = [(b - e.timestamp()) * 1000 for b, e in zip(began, etas, strict=False)]
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    print(f"signal to handler (idle supervisor, {len(signal_ms)} signals): {summary(signal_ms)}")
    print(f"hard limit overrun past {limit} s ({len(overrun_ms)} tasks):        "
          f"{summary(overrun_ms)}")
    print(f"start past its ETA ({len(late_ms)} tasks, 0.1 s apart):              "
          f"{summary(late_ms)}")
    print("(log timestamps are truncated to the millisecond, and a task notes its start a "
          "little after the supervisor's clock starts: values are good to about ±1 ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
