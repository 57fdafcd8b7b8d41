"""workhorse vs Celery prefork: tasks per second on the same broker, in one run.

    python benchmarks/throughput.py --broker redis --tasks 2000 --repeat 3

Both workers get the same pre-filled queue of protocol v2 messages, concurrency, prefetch
multiplier and ack mode (acks_late, results disabled), and are timed from the first
finished task to the last. Also reported: the supervisor's (Celery: the main process's)
CPU time per task. The machine is shared and noisy: medians of --repeat runs are printed,
and the ratio of medians.
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
from dataclasses import dataclass
from pathlib import Path

import psutil
from kombu import Connection, Producer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import workhorse  # noqa: E402,F401 - registers sqlite://
from workhorse.protocol import build_message  # noqa: E402
from workhorse.queues import ensure_queue  # noqa: E402

BROKERS = {
    "sqlite": None,   # a file in the run's temp dir
    "redis": "redis://127.0.0.1:6379/3",
    "amqp": "amqp://guest:guest@127.0.0.1:5672//",
}
TASK_SETS = {"noop": ("bench.noop", []), "sleep": ("bench.sleep", [0.01])}


@dataclass
class Run:
    seconds: float
    tasks: int
    main_cpu: float

    @property
    def rate(self) -> float:
        return (self.tasks - 1) / self.seconds


def fill(url: str, queue: str, task: str, args: list, count: int) -> None:
    with Connection(url) as conn:
        ensure_queue(conn, queue)
        producer = Producer(conn)
        for _ in range(count):
            msg = build_message(task, str(uuid.uuid4()), args, {}, ignore_result=True)
            producer.publish(msg.body, exchange="", routing_key=queue, serializer="json",
                             headers=msg.headers, correlation_id=msg.properties["correlation_id"],
                             delivery_mode=2)


def drop(url: str, queue: str) -> None:
    with Connection(url) as conn:
        try:
            ensure_queue(conn, queue)(conn.default_channel).delete()
        except Exception:  # noqa: BLE001 - cleanup is best effort
            pass


def command(kind: str, queue: str, concurrency: int) -> list[str]:
    if kind == "workhorse":
        return [sys.executable, "-m", "workhorse", "worker", "-A", "benchmarks.bench_tasks:app",
                "-c", str(concurrency), "-Q", queue, "-l", "WARNING"]
    return [sys.executable, "-m", "celery", "-A", "benchmarks.bench_tasks:celery_app", "worker",
            "-c", str(concurrency), "-Q", queue, "-l", "WARNING", "-P", "prefork",
            "--without-gossip", "--without-mingle", "--without-heartbeat"]


def measure(kind: str, url: str, task_set: str, count: int, concurrency: int,
            workdir: Path) -> Run:
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    task, args = TASK_SETS[task_set]
    counter = workdir / f"{queue}.count"
    counter.touch()
    fill(url, queue, task, args, count)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WORKHORSE_", "CELERY_"))}
    env.update(PYTHONPATH=str(ROOT), BENCH_COUNTER=str(counter),
               WORKHORSE_BROKER_URL=url, WORKHORSE_RESULT_BACKEND="disabled",
               WORKHORSE_STATE_DIR=str(workdir / "state"), WORKHORSE_PREFETCH_MULTIPLIER="4",
               WORKHORSE_ACKS_LATE="true",
               CELERY_BROKER_URL=url)   # bench_tasks.py configures Celery the same way
    log = open(workdir / f"{queue}.{kind}.log", "wb")
    proc = subprocess.Popen(command(kind, queue, concurrency), cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    main = psutil.Process(proc.pid)
    try:
        deadline = time.monotonic() + 600
        first = None
        while counter.stat().st_size < count:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"{kind} did not finish; see {log.name}")
            if first is None and counter.stat().st_size >= 1:
                first = time.monotonic()
                cpu_start = sum(main.cpu_times()[:2])
            time.sleep(0.001)
        last = time.monotonic()
        cpu = sum(main.cpu_times()[:2]) - cpu_start
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
        drop(url, queue)
    assert first is not None
    return Run(last - first, count, cpu)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", choices=sorted(BROKERS), action="append")
    parser.add_argument("--set", choices=sorted(TASK_SETS), action="append", dest="sets")
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    brokers = args.broker or ["sqlite", "redis", "amqp"]
    sets = args.sets or ["noop", "sleep"]
    print(f"{args.tasks} tasks, concurrency {args.concurrency}, prefetch multiplier 4, "
          f"acks_late, results disabled; median of {args.repeat}")
    print(f"{'broker':7} {'set':6} {'workhorse/s':>12} {'celery/s':>10} {'ratio':>6} "
          f"{'wh sup CPU/task':>16} {'celery main CPU/task':>21}")
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for broker in brokers:
            url = BROKERS[broker] or f"sqlite:///{workdir / 'broker.sqlite3'}"
            for task_set in sets:
                count = args.tasks if task_set == "noop" else max(200, args.tasks // 5)
                results: dict[str, list[Run]] = {"workhorse": [], "celery": []}
                for _ in range(args.repeat):
                    for kind in ("workhorse", "celery"):   # interleaved: same noise for both
                        try:
                            results[kind].append(measure(kind, url, task_set, count,
                                                         args.concurrency, workdir))
                        except RuntimeError as exc:
                            print(f"  {kind} on {broker}: {exc}", file=sys.stderr)
                row = {k: (statistics.median(r.rate for r in v) if v else None,
                           statistics.median(r.main_cpu / r.tasks * 1e6 for r in v) if v else None)
                       for k, v in results.items()}
                wh, ce = row["workhorse"], row["celery"]
                ratio = f"{wh[0] / ce[0]:.2f}" if wh[0] and ce[0] else "n/a"
                fmt = lambda x, spec: format(x, spec) if x is not None else "n/a"  # noqa: E731
                print(f"{broker:7} {task_set:6} {fmt(wh[0], '12.0f')} {fmt(ce[0], '10.0f')} "
                      f"{ratio:>6} {fmt(wh[1], '13.0f') + ' µs':>16} "
                      f"{fmt(ce[1], '18.0f') + ' µs':>21}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
