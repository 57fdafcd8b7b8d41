"""Result round-trip latency: send one task, wait for its result, repeat.

    python benchmarks/roundtrip.py --calls 300 --repeat 3

workhorse's client and worker against Celery's client and worker, on the same broker with
the same Redis result store, concurrency 2; p50 and p99 of the time from send to result.
Runs are interleaved (workhorse, Celery, workhorse, …) so both see the same noise; the
medians over --repeat runs are printed with the ratio Celery/workhorse (above 1: workhorse
is faster).
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.throughput import command  # noqa: E402

RESULTS = "redis://127.0.0.1:6379/4"
BROKERS = {"redis": "redis://127.0.0.1:6379/3", "amqp": "amqp://guest:guest@127.0.0.1:5672//"}


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def client(kind: str, broker: str, queue: str) -> tuple[Callable[[], Any], Callable[[], None]]:
    """A function sending bench.add(1, 2) to ``queue`` through ``kind``'s client, and a closer."""
    if kind == "workhorse":
        from workhorse import App
        app = App("rt-client", broker_url=broker, result_backend=RESULTS)
        return lambda: app.send_task("bench.add", (1, 2), queue=queue), app.close
    from celery import Celery
    capp = Celery("rt-client", broker=broker, backend=RESULTS)
    return lambda: capp.send_task("bench.add", (1, 2), queue=queue), capp.close


def run(kind: str, broker: str, calls: int, workdir: Path) -> list[float]:
    """Milliseconds from send to result, for ``calls`` sequential calls."""
    queue = f"rt-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WORKHORSE_", "CELERY_"))}
    env.update(PYTHONPATH=str(ROOT), WORKHORSE_BROKER_URL=broker,
               WORKHORSE_RESULT_BACKEND=RESULTS, WORKHORSE_STATE_DIR=str(workdir / "state"),
               CELERY_BROKER_URL=broker, BENCH_RESULTS=RESULTS)
    log = open(workdir / f"{queue}.log", "wb")
    proc = subprocess.Popen(command(kind, queue, 2), cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    send, close = client(kind, broker, queue)
    try:
        send().get(timeout=60)                     # warm up: worker ready, connections open
        latencies = []
        for _ in range(calls):
            start = time.perf_counter()
            assert send().get(timeout=30) == 3
            latencies.append((time.perf_counter() - start) * 1000)
        return latencies
    finally:
        close()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--broker", choices=sorted(BROKERS), action="append")
    args = parser.parse_args()
    print(f"{args.calls} sequential calls, concurrency 2, Redis result store; "
          f"medians of {args.repeat} interleaved runs")
    print(f"{'broker':7} {'wh p50':>8} {'celery p50':>11} {'ratio':>6} "
          f"{'wh p99':>8} {'celery p99':>11} {'ratio':>6}   (ms; ratio = celery / workhorse)")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.broker or ["redis", "amqp"]:
            p50: dict[str, list[float]] = {"workhorse": [], "celery": []}
            p99: dict[str, list[float]] = {"workhorse": [], "celery": []}
            for _ in range(args.repeat):
                for kind in ("workhorse", "celery"):
                    lat = run(kind, BROKERS[name], args.calls, Path(tmp))
                    p50[kind].append(percentile(lat, 0.5))
                    p99[kind].append(percentile(lat, 0.99))
            m50 = {k: statistics.median(v) for k, v in p50.items()}
            m99 = {k: statistics.median(v) for k, v in p99.items()}
            print(f"{name:7} {m50['workhorse']:8.2f} {m50['celery']:11.2f} "
                  f"{m50['celery'] / m50['workhorse']:6.2f} {m99['workhorse']:8.2f} "
                  f"{m99['celery']:11.2f} {m99['celery'] / m99['workhorse']:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
