"""workhorse vs Celery prefork: tasks per second on the same broker, in one run.

    python benchmarks/throughput.py --broker redis --tasks 2000 --repeat 3
    python benchmarks/throughput.py --metrics     # also workhorse with metrics, scraped
    python benchmarks/throughput.py --acks-early  # both at-most-once

Both workers get the same pre-filled queue of protocol v2 messages, concurrency, prefetch
multiplier and ack mode (acks_late unless --acks-early, results disabled), and are timed
from the first finished task to the last. Also reported: the supervisor's (Celery: the
main process's) CPU time per task, and the pool processes' together. The machine is
shared and noisy: medians of --repeat runs are printed, and the ratio of medians. With
``--metrics``, workhorse runs a second time with its Prometheus endpoint on, scraped every
second, interleaved with the others: the cost of counting (and of a scraper) is the ratio
of those two.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
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
    children_cpu: float = 0.0

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
    """Delete the run's queue. On Redis the whole benchmark database goes: a worker killed
    at the end of a run leaves the leases of what it held in kombu's shared ``unacked``
    keys, and every later run's sweep would spend its time putting them back."""
    if url == BROKERS["redis"]:
        import redis
        redis.Redis.from_url(url).flushdb()
        return
    with Connection(url) as conn:
        try:
            ensure_queue(conn, queue)(conn.default_channel).delete()
        except Exception:  # noqa: BLE001 - cleanup is best effort
            pass


def command(kind: str, queue: str, concurrency: int) -> list[str]:
    if kind.startswith("workhorse"):
        return [sys.executable, "-m", "workhorse", "worker", "-A", "benchmarks.bench_tasks:app",
                "-c", str(concurrency), "-Q", queue, "-l", "WARNING"]
    return [sys.executable, "-m", "celery", "-A", "benchmarks.bench_tasks:celery_app", "worker",
            "-c", str(concurrency), "-Q", queue, "-l", "WARNING", "-P", "prefork",
            "--without-gossip", "--without-mingle", "--without-heartbeat"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int, stop: threading.Event) -> None:
    """As Prometheus would, only more often: every second."""
    while not stop.wait(1.0):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                r.read()
        except OSError:
            pass        # not listening yet


def measure(kind: str, url: str, task_set: str, count: int, concurrency: int,
            workdir: Path, acks_late: bool = True) -> Run:
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    task, args = TASK_SETS[task_set]
    counter = workdir / f"{queue}.count"
    counter.touch()
    fill(url, queue, task, args, count)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WORKHORSE_", "CELERY_"))}
    env.update(PYTHONPATH=str(ROOT), BENCH_COUNTER=str(counter),
               WORKHORSE_BROKER_URL=url, WORKHORSE_RESULT_BACKEND="disabled",
               WORKHORSE_STATE_DIR=str(workdir / "state"), WORKHORSE_PREFETCH_MULTIPLIER="4",
               WORKHORSE_ACKS_LATE=str(acks_late).lower(),
               BENCH_ACKS_LATE=str(acks_late).lower(),
               CELERY_BROKER_URL=url)   # bench_tasks.py configures Celery the same way
    stop_scraping = threading.Event()
    if kind == "workhorse+metrics":
        port = free_port()
        env["WORKHORSE_METRICS_PORT"] = str(port)
        threading.Thread(target=scrape, args=(port, stop_scraping), daemon=True).start()
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
                children_start = children_cpu(main)
            time.sleep(0.001)
        last = time.monotonic()
        cpu = sum(main.cpu_times()[:2]) - cpu_start
        children = children_cpu(main) - children_start
    finally:
        stop_scraping.set()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
        drop(url, queue)
    assert first is not None
    return Run(last - first, count, cpu, children)


def children_cpu(main: psutil.Process) -> float:
    """CPU seconds of the pool's processes (the sentinel's are next to nothing)."""
    total = 0.0
    for child in main.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", choices=sorted(BROKERS), action="append")
    parser.add_argument("--set", choices=sorted(TASK_SETS), action="append", dest="sets")
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--metrics", action="store_true",
                        help="also run workhorse with metrics on, scraped every second")
    parser.add_argument("--acks-early", action="store_true",
                        help="acks_late = false for both (at-most-once)")
    args = parser.parse_args()
    kinds = ("workhorse", "workhorse+metrics", "celery") if args.metrics else (
        "workhorse", "celery")
    brokers = args.broker or ["sqlite", "redis", "amqp"]
    sets = args.sets or ["noop", "sleep"]
    print(f"{args.tasks} tasks, concurrency {args.concurrency}, prefetch multiplier 4, "
          f"acks_late = {str(not args.acks_early).lower()}, results disabled; "
          f"median of {args.repeat}")
    print(f"{'broker':7} {'set':6} {'workhorse/s':>12} {'celery/s':>10} {'ratio':>6} "
          f"{'wh sup CPU/task':>16} {'celery main CPU/task':>21} "
          f"{'wh child CPU/task':>18} {'celery child CPU/task':>22}"
          + (f" {'wh+metrics/s':>13} {'metrics/plain':>14} {'sup CPU/task':>13}"
             if args.metrics else ""))
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for broker in brokers:
            url = BROKERS[broker] or f"sqlite:///{workdir / 'broker.sqlite3'}"
            for task_set in sets:
                count = args.tasks if task_set == "noop" else max(200, args.tasks // 5)
                results: dict[str, list[Run]] = {kind: [] for kind in kinds}
                for _ in range(args.repeat):
                    for kind in kinds:   # interleaved: the same noise for each
                        try:
                            results[kind].append(measure(kind, url, task_set, count,
                                                         args.concurrency, workdir,
                                                         acks_late=not args.acks_early))
                        except RuntimeError as exc:
                            print(f"  {kind} on {broker}: {exc}", file=sys.stderr)
                row = {k: (statistics.median(r.rate for r in v) if v else None,
                           statistics.median(r.main_cpu / r.tasks * 1e6 for r in v) if v else None,
                           statistics.median(r.children_cpu / r.tasks * 1e6 for r in v)
                           if v else None)
                       for k, v in results.items()}
                wh, ce = row["workhorse"], row["celery"]
                ratio = f"{wh[0] / ce[0]:.2f}" if wh[0] and ce[0] else "n/a"
                fmt = lambda x, spec: format(x, spec) if x is not None else "n/a"  # noqa: E731
                extra = ""
                if args.metrics:
                    wm = row["workhorse+metrics"]
                    cost = f"{wm[0] / wh[0]:.3f}" if wm[0] and wh[0] else "n/a"
                    extra = (f" {fmt(wm[0], '13.0f')} {cost:>14} "
                             f"{fmt(wm[1], '10.0f') + ' µs':>13}")
                print(f"{broker:7} {task_set:6} {fmt(wh[0], '12.0f')} {fmt(ce[0], '10.0f')} "
                      f"{ratio:>6} {fmt(wh[1], '13.0f') + ' µs':>16} "
                      f"{fmt(ce[1], '18.0f') + ' µs':>21} {fmt(wh[2], '15.0f') + ' µs':>18} "
                      f"{fmt(ce[2], '19.0f') + ' µs':>22}" + extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
