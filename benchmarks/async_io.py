"""I/O-bound tasks on Redis: workhorse's ``async def`` tasks against Celery (prefork and
gevent), Dramatiq's async actors and arq, in one run; then many long waits on two
workhorse children.

    python benchmarks/async_io.py --tasks 10000 --repeat 3
    python benchmarks/async_io.py --only workhorse,arq --skip-long
    python benchmarks/async_io.py --only workhorse --long-tasks 5000   # just the long waits

1. Each task waits 100 ms, with 1,000 waits allowed in flight at once on each system and
   2 worker processes where the system has processes:

   - workhorse: ``await asyncio.sleep(0.1)``; concurrency 2, async_concurrency 500.
   - Celery prefork: ``time.sleep(0.1)``, ``-P prefork -c 2``: one wait per process, so 2
     in flight; it is given --tasks/50 tasks to keep its run short (its rate is compared).
   - Celery gevent: ``time.sleep(0.1)`` under the monkeypatching gevent pool,
     ``-P gevent -c 1000`` (one process).
   - Dramatiq: an ``async def`` actor with the AsyncIO middleware, ``--processes 2
     --threads 500``. Dramatiq runs each process's coroutines on one event loop thread,
     but a worker thread hands each to it and blocks until it ends (``actor.py``: an
     ``async def`` actor's fn is ``async_to_sync(fn)``; ``asyncio.py``,
     ``EventLoopThread.run_coroutine``: ``future.result(timeout=...)`` in a loop on the
     worker thread), so the threads bound what is in flight: 2 × 500.
   - arq: ``await asyncio.sleep(0.1)``; one process, ``max_jobs=1000``, results not kept.
     arq is not in the bench extra: it pins redis-py below 6, which would downgrade what
     workhorse runs on. Install it beside, ``pip install --no-deps arq click`` (measured
     so, on redis-py 8).

   workhorse and Celery get the same pre-filled queue (Celery's protocol v2, written with
   kombu by ``throughput.fill``), prefetch multiplier 4 and late acks, results disabled;
   Dramatiq and arq their own messages (``actor.send``, ``enqueue_job``), also written
   before the worker starts. Celery's and Dramatiq's Redis connection pools are raised to
   1,100 connections: at their defaults (kombu's 10, redis-py 8's 100) acks fail with
   MaxConnectionsError at 1,000 in flight (``async_peers.max_connections``).

2. --long-tasks (default 5,000) tasks of ``await asyncio.sleep(1)`` on workhorse with
   concurrency 2 and async_concurrency 1,000, pre-filled before the worker starts.

Every task appends a record when it starts and one when its wait ends, each with its
wall-clock time, to a file (``async_peers.record``; ``O_APPEND``, so the file is also the
order of events across processes). A run is timed from the first start to the last end
(tasks/s = tasks / that span); the peak in flight is the largest number of starts not yet
ended, in the file's order. Also printed: the CPU of the worker's whole process tree over
that span, per task; and its memory after the drain, before it is killed: the USS
(``memory_full_info().uss``, what would be freed if the process went) summed over every
process of the worker (main and all below it: workhorse's sentinel, Dramatiq's master
too), and the RSS sum for reference (it counts shared pages once per process). Part 2
prints the supervisor's (the main process's) and its children's CPU seconds, over the
span and since launch.

The machine is shared and noisy: the runs of part 1 are interleaved, and medians of
--repeat are printed, with each peer's ratio (workhorse's tasks/s over its). A peer that is
not installed is skipped with a line saying so. Each worker runs in its own process group
and is killed with it at the end of its run (on an error or Ctrl-C too); every wait has a
deadline, after which the run fails naming the system. The broker is Redis database 0,
shared: each run uses a queue (and Dramatiq namespace, arq job ids) named with a fresh
hex tag, and afterwards deletes the keys that carry it and its entries in kombu's shared
``unacked`` bookkeeping (``throughput.drop`` would flush the whole database).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.async_peers import RECORD_SIZE  # noqa: E402
from benchmarks.throughput import fill, kill  # noqa: E402

URL = "redis://127.0.0.1:6379/0"
#: Waits in flight on each system (where it can), and its worker processes (where it has
#: them).
IN_FLIGHT = 1000
PROCESSES = 2
#: Celery prefork gets this share of the tasks (its 2 waits at a time would take long).
PREFORK_SHARE = 50
#: A run's deadline: this long to start, plus this many times its ideal drain.
STARTUP_ALLOWANCE = 60.0
DRAIN_ALLOWANCE = 10.0


@dataclass(frozen=True)
class System:
    name: str
    #: What bounds the waits in flight, for the table.
    bound: str
    #: How many can be in flight (for the deadline).
    limit: int
    #: The modules it needs.
    needs: tuple[str, ...]
    #: It is given tasks // share of the tasks.
    share: int = 1


SYSTEMS = {s.name: s for s in (
    System("workhorse", f"{PROCESSES} × {IN_FLIGHT // PROCESSES} async", IN_FLIGHT,
           ("workhorse",)),
    System("celery-prefork", f"{PROCESSES} (a process each)", PROCESSES, ("celery",),
           share=PREFORK_SHARE),
    System("celery-gevent", f"{IN_FLIGHT} greenlets", IN_FLIGHT, ("celery", "gevent")),
    System("dramatiq", f"{PROCESSES} × {IN_FLIGHT // PROCESSES} threads", IN_FLIGHT,
           ("dramatiq",)),
    System("arq", f"{IN_FLIGHT} (max_jobs)", IN_FLIGHT, ("arq",)),
)}


class RunFailed(RuntimeError):
    """A run that did not finish: the message names the system."""


@dataclass
class Run:
    tasks: int
    seconds: float          # first start to last end
    peak: int               # most waits in flight at once
    main_cpu: float         # over the span
    children_cpu: float     # over the span
    main_cpu_total: float   # since launch, at the end
    children_cpu_total: float
    uss: int                # summed over the worker's processes, after the drain
    rss: int
    processes: int

    @property
    def rate(self) -> float:
        return self.tasks / self.seconds

    @property
    def cpu_per_task(self) -> float:
        return (self.main_cpu + self.children_cpu) / self.tasks


# -- filling each system's queue ---------------------------------------------------------

def fill_celery(queue: str, tag: str, count: int, wait: float) -> None:
    fill(URL, queue, "aio.wait", [wait], count)


def fill_dramatiq(queue: str, tag: str, count: int, wait: float) -> None:
    from benchmarks.async_peers import dramatiq_broker
    broker = dramatiq_broker(URL, queue, namespace=f"aio-{tag}")
    try:
        actor = broker.get_actor("aio.wait")
        for _ in range(count):
            actor.send(wait)
    finally:
        broker.close()


def fill_arq(queue: str, tag: str, count: int, wait: float) -> None:
    from arq import create_pool
    from arq.connections import RedisSettings

    async def enqueue() -> None:
        pool = await create_pool(RedisSettings.from_dsn(URL), default_queue_name=queue)
        try:
            for first in range(0, count, 50):
                await asyncio.gather(*(pool.enqueue_job("aio.wait", wait, _job_id=f"{tag}-{n}")
                                       for n in range(first, min(count, first + 50))))
        finally:
            await pool.aclose()
    asyncio.run(enqueue())


FILLS: dict[str, Callable[[str, str, int, float], None]] = {
    "workhorse": fill_celery, "celery-prefork": fill_celery, "celery-gevent": fill_celery,
    "dramatiq": fill_dramatiq, "arq": fill_arq}


# -- starting each worker ------------------------------------------------------------------

def command(system: str, queue: str) -> list[str]:
    py = sys.executable
    if system == "workhorse":
        return [py, "-m", "workhorse", "worker", "-A", "benchmarks.async_tasks:app",
                "-l", "WARNING"]
    if system.startswith("celery-"):
        pool, concurrency = (("prefork", PROCESSES) if system == "celery-prefork"
                             else ("gevent", IN_FLIGHT))
        return [py, "-m", "celery", "-A", "benchmarks.async_peers:celery_app", "worker",
                "-P", pool, "-c", str(concurrency), "-Q", queue, "-l", "WARNING",
                "--without-gossip", "--without-mingle", "--without-heartbeat"]
    if system == "dramatiq":
        return [py, "-m", "dramatiq", "benchmarks.async_peers:dramatiq_broker",
                "--processes", str(PROCESSES), "--threads", str(IN_FLIGHT // PROCESSES),
                "--queues", queue]
    return [py, "-m", "benchmarks.async_peers", "arq"]


def environment(queue: str, tag: str, events: Path, workdir: Path,
                async_concurrency: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("WORKHORSE_", "CELERY_", "DRAMATIQ_", "BENCH_"))}
    env.update(
        PYTHONPATH=str(ROOT), BENCH_EVENTS=str(events), BENCH_QUEUE=queue,
        BENCH_BROKER_URL=URL, BENCH_NAMESPACE=f"aio-{tag}", BENCH_ARQ_MAX_JOBS=str(IN_FLIGHT),
        BENCH_MAX_CONNECTIONS=str(IN_FLIGHT + 100),
        WORKHORSE_BROKER_URL=URL, WORKHORSE_RESULT_BACKEND="disabled",
        WORKHORSE_QUEUES=queue, WORKHORSE_STATE_DIR=str(workdir / f"state-{tag}"),
        WORKHORSE_CONCURRENCY=str(PROCESSES),
        WORKHORSE_ASYNC_CONCURRENCY=str(async_concurrency),
        WORKHORSE_REMOTE_CONTROL="false", WORKHORSE_PREFETCH_MULTIPLIER="4",
        WORKHORSE_ACKS_LATE="true", WORKHORSE_HOSTNAME=f"aio-{tag}@{socket.gethostname()}")
    return env


# -- one run --------------------------------------------------------------------------------

def measure(system: System, count: int, wait: float, workdir: Path,
            async_concurrency: int = IN_FLIGHT // PROCESSES) -> Run:
    """Fill the queue, start the worker, wait until every task has ended, read its CPU and
    memory, kill it, clean up its keys."""
    tag = uuid.uuid4().hex[:12]
    queue = f"aio-{tag}"
    events = workdir / f"{queue}.events"
    events.touch()
    log_path = workdir / f"{queue}.{system.name}.log"
    proc: subprocess.Popen[bytes] | None = None
    try:
        FILLS[system.name](queue, tag, count, wait)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                command(system.name, queue), cwd=ROOT,
                env=environment(queue, tag, events, workdir, async_concurrency),
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        main = psutil.Process(proc.pid)
        limit = min(system.limit, PROCESSES * async_concurrency)
        timeout = STARTUP_ALLOWANCE + DRAIN_ALLOWANCE * math.ceil(count / limit) * wait
        deadline = time.monotonic() + timeout
        target = 2 * count * RECORD_SIZE
        at_start: tuple[float, float] | None = None
        while (size := events.stat().st_size) < target:
            if proc.poll() is not None:
                raise RunFailed(f"{system.name} exited with status {proc.returncode} after "
                                f"{size // RECORD_SIZE} of {2 * count} records"
                                + log_tail(log_path))
            if time.monotonic() > deadline:
                raise RunFailed(f"{system.name} did not finish {count} tasks within "
                                f"{timeout:.0f} s ({size // RECORD_SIZE} of {2 * count} "
                                "records)" + log_tail(log_path))
            if at_start is None and size:
                at_start = tree_cpu(main)
            time.sleep(0.005)
        at_end = tree_cpu(main)
        uss, rss, processes = tree_memory(main)
    finally:
        if proc is not None:
            stop(proc)
        cleanup(queue, tag)
    if at_start is None:        # it all ran between two looks
        at_start = (0.0, 0.0)
    first, last, peak, starts = read_events(events)
    if starts != count:
        print(f"  ({system.name}: {starts} starts for {count} tasks)", file=sys.stderr)
    return Run(count, last - first, peak, at_end[0] - at_start[0], at_end[1] - at_start[1],
               at_end[0], at_end[1], uss, rss, processes)


def log_tail(path: Path, lines: int = 15) -> str:
    tail = path.read_text(errors="replace").splitlines()[-lines:]
    return "; its log ends:\n" + "\n".join(tail) if tail else "; its log is empty"


def read_events(path: Path) -> tuple[float, float, int, int]:
    """The first start, the last end, the peak in flight (in the file's order) and the
    number of starts."""
    data = path.read_bytes()
    first, last = math.inf, -math.inf
    running = peak = starts = 0
    for offset in range(0, len(data) - RECORD_SIZE + 1, RECORD_SIZE):
        kind, stamp = data[offset:offset + 1], float(data[offset + 2:offset + RECORD_SIZE])
        if kind == b"S":
            starts += 1
            running += 1
            peak = max(peak, running)
            first = min(first, stamp)
        else:
            running -= 1
            last = max(last, stamp)
    return first, last, peak, starts


def _cpu(process: psutil.Process) -> float:
    return float(sum(process.cpu_times()[:2]))


def tree_cpu(main: psutil.Process) -> tuple[float, float]:
    """CPU seconds of the main process, and of every process below it."""
    below = 0.0
    for child in main.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            below += _cpu(child)
    return _cpu(main), below


def tree_memory(main: psutil.Process) -> tuple[int, int, int]:
    """USS and RSS summed over the main process and every process below it, and how many."""
    uss = rss = processes = 0
    for process in [main, *main.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            info = process.memory_full_info()
            uss += info.uss
            rss += info.rss
            processes += 1
    return uss, rss, processes


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Kill the worker's process group, then any process of its tree that left it."""
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    kill(proc)
    for process in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


def cleanup(queue: str, tag: str) -> None:
    """Delete the run's keys (each carries its tag: the queue, its bindings, Dramatiq's
    namespace, arq's job ids, the queue's dead letters), and the run's entries in kombu's
    shared unacked bookkeeping (left by a worker killed holding messages)."""
    client = redis.Redis.from_url(URL)
    try:
        keys = list(client.scan_iter(match=f"*{tag}*", count=1000))
        if keys:
            client.delete(*keys)
        ours = [delivery for delivery, entry in client.hscan_iter("unacked", count=1000)
                if queue.encode() in entry]
        if ours:
            pipe = client.pipeline()
            pipe.hdel("unacked", *ours)
            pipe.zrem("unacked_index", *ours)
            pipe.hdel("delivery_counts", *ours)
            pipe.hdel("lease_owners", *ours)
            pipe.execute()
    finally:
        client.close()


# -- the two parts --------------------------------------------------------------------------

def available(system: System) -> str | None:
    """Why the system cannot run here (None if it can)."""
    missing = [m for m in system.needs if importlib.util.find_spec(m) is None]
    return f"{', '.join(missing)} not installed" if missing else None


def peers(args: argparse.Namespace, workdir: Path) -> None:
    wait = 0.1
    print(f"Part 1: {args.tasks} tasks of {wait * 1000:.0f} ms each (Celery prefork: "
          f"{args.tasks // PREFORK_SHARE}), {IN_FLIGHT} waits in flight where the system "
          f"can, {PROCESSES} processes where it has them; Redis; median of {args.repeat} "
          "interleaved runs")
    systems = []
    for name in args.only or SYSTEMS:
        why = available(SYSTEMS[name])
        if why:
            print(f"  {name} skipped: {why}")
        else:
            systems.append(SYSTEMS[name])
    runs: dict[str, list[Run]] = {s.name: [] for s in systems}
    for _ in range(args.repeat):
        for system in systems:        # interleaved: the same noise for each
            try:
                runs[system.name].append(
                    measure(system, max(1, args.tasks // system.share), wait, workdir))
            except RunFailed as exc:
                print(f"  {exc}", file=sys.stderr)
    rates = {name: statistics.median(r.rate for r in rs) for name, rs in runs.items() if rs}
    ours = rates.get("workhorse")
    print(f"{'system':15} {'in flight at most':19} {'tasks':>6} {'tasks/s':>8} {'ratio':>6} "
          f"{'peak':>5} {'CPU/task':>9} {'USS sum':>9} {'RSS sum':>9} {'procs':>5}")
    for system in systems:
        rs = runs[system.name]
        if not rs:
            print(f"{system.name:15} {system.bound:19} {'failed':>15}")
            continue
        rate = rates[system.name]
        ratio = f"{ours / rate:.2f}" if ours and system.name != "workhorse" else ""
        print(f"{system.name:15} {system.bound:19} {rs[0].tasks:6} {rate:8.0f} {ratio:>6} "
              f"{statistics.median(r.peak for r in rs):5.0f} "
              f"{statistics.median(r.cpu_per_task for r in rs) * 1e6:6.0f} µs "
              f"{statistics.median(r.uss for r in rs) / 2**20:6.1f} MB "
              f"{statistics.median(r.rss for r in rs) / 2**20:6.1f} MB "
              f"{statistics.median(r.processes for r in rs):5.0f}")
    print("ratio: workhorse's tasks/s over the system's. peak: most waits in flight at once. "
          "CPU/task: the worker's processes, first start to last end. USS, RSS: summed over "
          "the worker's processes after the drain.")


def long_waits(args: argparse.Namespace, workdir: Path) -> None:
    concurrency = 1000
    count = args.long_tasks
    print(f"\nPart 2: {count} tasks of asyncio.sleep(1) on workhorse, concurrency "
          f"{PROCESSES}, async_concurrency {concurrency}, pre-filled; {args.repeat} runs")
    print(f"{'run':6} {'first start → last end':>23} {'peak':>5} {'supervisor CPU':>15} "
          f"{'children CPU':>13} {'(since launch:':>15} {'supervisor':>10} {'children)':>10}")
    results = []
    for n in range(args.repeat):
        try:
            run = measure(SYSTEMS["workhorse"], count, 1.0, workdir,
                          async_concurrency=concurrency)
        except RunFailed as exc:
            print(f"  {exc}", file=sys.stderr)
            continue
        results.append(run)
        print(f"{n + 1:<6} {run.seconds:21.2f} s {run.peak:5} {run.main_cpu:13.2f} s "
              f"{run.children_cpu:11.2f} s {'':15} {run.main_cpu_total:8.2f} s "
              f"{run.children_cpu_total:8.2f} s")
    if results:
        print(f"{'median':6} {statistics.median(r.seconds for r in results):21.2f} s "
              f"{statistics.median(r.peak for r in results):5.0f} "
              f"{statistics.median(r.main_cpu for r in results):13.2f} s "
              f"{statistics.median(r.children_cpu for r in results):11.2f} s {'':15} "
              f"{statistics.median(r.main_cpu_total for r in results):8.2f} s "
              f"{statistics.median(r.children_cpu_total for r in results):8.2f} s")
    print("CPU over the span (first start to last end) and since the worker was launched; "
          "children: every process below the supervisor (the two pool children and the "
          "sentinel).")


def systems_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SYSTEMS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown system(s) {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    return names


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tasks", type=int, default=10_000,
                        help="tasks of 100 ms for each system in part 1 (Celery prefork: "
                             f"1/{PREFORK_SHARE} of them; default 10000)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", type=systems_list,
                        help=f"comma-separated, of {', '.join(SYSTEMS)} (default: all that "
                             "are installed); part 2 runs unless --skip-long")
    parser.add_argument("--skip-long", action="store_true", help="leave out part 2")
    parser.add_argument("--skip-peers", action="store_true", help="leave out part 1")
    parser.add_argument("--long-tasks", type=int, default=5000,
                        help="tasks of 1 s in part 2 (default 5000)")
    parser.add_argument("--keep", type=Path,
                        help="keep the workers' logs and the tasks' records in this "
                             "directory (default: a temporary one, removed)")
    args = parser.parse_args()
    # SIGTERM as Ctrl-C: unwind, so every worker is killed on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    with tempfile.TemporaryDirectory(prefix="async-io-") as tmp:
        workdir = args.keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        if not args.skip_peers:
            peers(args, workdir)
        if not args.skip_long:
            long_waits(args, workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
