"""Enqueue → start latency at low load, and an idle worker's CPU, workhorse against Celery.

    python benchmarks/pickup.py [--broker redis] [--tasks 200]

Each worker (concurrency 2, results disabled) is left idle for a while, its supervisor's
(Celery: main process's) CPU measured, then sent tasks one at a time, 20 ms apart, each
carrying its send time; the task notes how long after that it started. Medians and 99th
percentiles of those delays, per broker, in one run.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
from kombu import Connection, Producer

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import BROKERS, ROOT, command, drop

from workhorse.protocol import build_message
from workhorse.broker.queues import ensure_queue

IDLE_SECONDS = 10.0


def run(kind: str, url: str, tasks: int, workdir: Path) -> tuple[float, list[float]]:
    queue = f"pickup-{uuid.uuid4().hex[:8]}"
    starts = workdir / f"{queue}.starts"
    starts.touch()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WORKHORSE_", "CELERY_"))}
    env.update(PYTHONPATH=str(ROOT), BENCH_STARTS=str(starts), BENCH_COUNTER=os.devnull,
               WORKHORSE_BROKER_URL=url, WORKHORSE_RESULT_BACKEND="disabled",
               WORKHORSE_STATE_DIR=str(workdir / "state"), CELERY_BROKER_URL=url)
    with Connection(url) as conn:
        ensure_queue(conn, queue)
    log = open(workdir / f"{queue}.{kind}.log", "wb")
    proc = subprocess.Popen(command(kind, queue, 2), cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        main = psutil.Process(proc.pid)
        with Connection(url) as conn:
            producer = Producer(conn)

            def send() -> None:
                msg = build_message("bench.stamp", str(uuid.uuid4()), [time.time()], {},
                                    ignore_result=True)
                producer.publish(msg.body, exchange="", routing_key=queue, serializer="json",
                                 headers=msg.headers, delivery_mode=2,
                                 correlation_id=msg.properties["correlation_id"])
            send()                                   # up and consuming
            wait_for(lambda: len(starts.read_text().split()) >= 1, proc)
            cpu0 = sum(main.cpu_times()[:2])
            time.sleep(IDLE_SECONDS)
            idle = (sum(main.cpu_times()[:2]) - cpu0) / IDLE_SECONDS
            for _ in range(tasks):
                send()
                time.sleep(0.02)
            wait_for(lambda: len(starts.read_text().split()) >= tasks + 1, proc)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
        drop(url, queue)
    delays = [float(x) * 1000 for x in starts.read_text().split()[1:]]
    return idle, delays


def wait_for(condition, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("the worker did not run the tasks")
        time.sleep(0.01)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", choices=sorted(BROKERS), action="append")
    parser.add_argument("--tasks", type=int, default=200)
    args = parser.parse_args()
    print(f"{'broker':7} {'worker':9} {'p50':>8} {'p99':>8} {'idle CPU':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for broker in args.broker or ["sqlite", "redis", "amqp"]:
            url = BROKERS[broker] or f"sqlite:///{workdir / 'broker.sqlite3'}"
            for kind in ("workhorse", "celery"):
                idle, delays = run(kind, url, args.tasks, workdir)
                delays.sort()
                p99 = delays[min(len(delays) - 1, int(0.99 * len(delays)))]
                print(f"{broker:7} {kind:9} {statistics.median(delays):6.1f}ms "
                      f"{p99:6.1f}ms {idle * 100:8.2f}%", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
