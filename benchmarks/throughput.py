"""workhorse against Celery prefork (and Dramatiq, where it has the broker): tasks per
second on the same broker, in one run.

    python benchmarks/throughput.py --broker redis --tasks 4000 --repeat 3
    python benchmarks/throughput.py --acks-early      # every worker at-most-once
    python benchmarks/throughput.py --results        # results stored (SQLite, Redis)
    python benchmarks/throughput.py --results-url db+postgresql://postgres@127.0.0.1/bench
                                                     # ... or in this store (also rpc://)
    python benchmarks/throughput.py --workers 2      # two workers of each on one broker
    python benchmarks/throughput.py --metrics        # also workhorse with metrics, scraped
    python benchmarks/throughput.py --one-thread     # also workhorse on one thread (see
                                                     # benchmarks/one_thread.py)
    python benchmarks/throughput.py --against ../base  # also workhorse as another checkout
                                                       # has it (before/after, one run)
    python benchmarks/throughput.py --broker quorum    # RabbitMQ with quorum queues
    python benchmarks/throughput.py --broker sentinel  # Redis Sentinel, a set of its own
    python benchmarks/throughput.py --floor          # also the bare loop of
                                                     # benchmarks/floor.py

Every worker gets the same pre-filled queue (Celery's protocol; Dramatiq's own for
Dramatiq), concurrency and prefetch multiplier (4 unless --prefetch-multiplier), ack mode
(late acks unless --acks-early), and results disabled unless --results; it is timed from
the first finished task to the last. Also printed: the CPU per task of the supervisor
(Celery: its main process; Dramatiq: its master, which only watches, as its worker
processes consume and run tasks themselves), the part of it on the main process's main
thread (workhorse: the loop thread; the rest is its broker thread), and of the processes
below it together, and their memory (RSS: the largest main process, the mean child) at the
end; and the broker server's CPU per task over the same span (redis-server, RabbitMQ's
beam.smp), which shares the machine's two cores with the workers. Then the unique memory
(USS) of all the worker's processes after the drain, summed, and the machine's limit: its
cores divided by the server's and the pool's CPU a task (the rate if the supervisor cost
nothing), with the share of it the worker reached. The machine is shared and noisy: runs
are interleaved, medians of --repeat are printed, and the ratios of medians.

Dramatiq runs as ``dramatiq --processes <concurrency> --threads 1`` with its default
middleware and prefetch (2 a process; --prefetch-multiplier N gives it N, as the others); it is
skipped where it is not installed (pip install 'dramatiq[redis,rabbitmq]'), on SQLite,
which it has no broker for, and on quorum queues, which it does not declare. ``quorum`` is
the RabbitMQ server with the run's queue a quorum queue: workhorse with ``queue_type =
quorum``, Celery with ``task_default_queue_type = "quorum"`` (Celery 5.5+ then gives each
consumer its own prefetch); --against checkouts are skipped there. ``sentinel`` is a Redis
Sentinel set the run starts for itself (``tests/redis_sentinel.py``: a master, a replica,
three sentinels, on ports of their own), every worker given the sentinels and the master's
name; its server CPU is that of all five processes (the replica copies every write).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
from kombu import Connection, Producer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import workhorse  # noqa: E402,F401 - registers sqlite://
from workhorse.protocol import build_message  # noqa: E402
from workhorse.broker.queues import ensure_queue  # noqa: E402
from workhorse.urls import sentinels, split_master_name  # noqa: E402

BROKERS = {
    "sqlite": None,   # a file in the run's temp dir
    "redis": "redis://127.0.0.1:6379/3",
    "amqp": "amqp://guest:guest@127.0.0.1:5672//",
    "quorum": "amqp://guest:guest@127.0.0.1:5672//",     # the run's queue a quorum queue
    "sentinel": None,   # a Sentinel set of the run's own, started by main()
}
#: Where --results stores them: the SQLite file beside the SQLite broker, else Redis.
RESULTS = {BROKERS[name]: "redis://127.0.0.1:6379/4" for name in ("redis", "amqp")}
#: --results-url: one store for every broker and worker (db+postgresql://..., rpc://).
RESULTS_URL: list[str] = []
#: rpc://: the queue the filled messages name in reply_to (the run's queue and this).
REPLIES = ".replies"
#: The queue type each broker's run declares its queue with.
QUEUE_TYPES = {"quorum": "quorum"}
TASK_SETS = {"noop": ("bench.noop", []), "sleep": ("bench.sleep", [0.01])}
#: --against: worker kinds that run another checkout's workhorse (kind -> its directory).
CHECKOUTS: dict[str, Path] = {}


@dataclass
class Run:
    seconds: float
    tasks: int
    main_cpu: float
    children_cpu: float
    main_rss: int
    child_rss: int
    #: The main process's CPU on its main thread (workhorse: the loop thread); the rest
    #: is on its other threads (workhorse: the broker thread).
    main_thread_cpu: float = 0.0
    #: The broker server's CPU over the same span (redis-server, RabbitMQ's beam.smp; 0
    #: for SQLite, whose work is done inside the workers).
    broker_cpu: float = 0.0
    #: The unique memory (USS) of every process of the workers after the drain, summed.
    uss: int = 0

    @property
    def rate(self) -> float:
        return (self.tasks - 1) / self.seconds


def connection(url: str) -> Connection:
    """A kombu connection to ``url``; a sentinel list's ``?master_name=`` (workhorse's
    form) becomes the transport option kombu and Celery read it from."""
    bare, master_name = split_master_name(url)
    return Connection(bare, transport_options={"master_name": master_name} if master_name
                      else {})


def redis_client(url: str) -> Any:
    """A redis-py client of ``url``'s database (of the master, for a sentinel list)."""
    import redis
    if url.startswith("sentinel://"):
        from redis.sentinel import Sentinel
        found = sentinels(url)
        name = split_master_name(url)[1]
        return Sentinel(list(found.addresses)).master_for(name, db=found.db)
    return redis.Redis.from_url(url)


def fill(url: str, queue: str, task: str, args: list, count: int,
         results: bool = False, queue_type: str = "classic") -> None:
    """``count`` messages in Celery's protocol v2, as a Celery client sends them; their
    ``ignore_result`` header is set unless ``results`` (both workers honour it)."""
    with connection(url) as conn:
        ensure_queue(conn, queue, queue_type)
        reply_to = ""
        if results and RESULTS_URL == ["rpc://"]:    # a queue for the states to go to
            reply_to = queue + REPLIES
            ensure_queue(conn, reply_to)
        producer = Producer(conn)
        for _ in range(count):
            msg = build_message(task, str(uuid.uuid4()), args, {}, ignore_result=not results,
                                reply_to=reply_to)
            producer.publish(msg.body, exchange="", routing_key=queue, serializer="json",
                             headers=msg.headers, correlation_id=msg.properties["correlation_id"],
                             reply_to=reply_to, delivery_mode=2)


def fill_dramatiq(url: str, queue: str, task: str, args: list, count: int) -> None:
    from benchmarks.dramatiq_tasks import actors, make_broker
    broker = make_broker(url)
    try:
        actor = actors(broker, queue)[task]
        for _ in range(count):
            actor.send(*args)
    finally:
        broker.close()


def drop(url: str, queue: str) -> None:
    """Delete the run's queue. On Redis the whole benchmark database goes: a worker killed
    at the end of a run leaves the leases of what it held in kombu's shared ``unacked``
    keys, and every later run's sweep would spend its time putting them back. The Redis
    results database (--results) goes too."""
    if url in RESULTS:
        redis_client(RESULTS[url]).flushdb()
    if url == BROKERS["redis"] or url.startswith("sentinel://"):
        redis_client(url).flushdb()
        return
    with connection(url) as conn:
        for name in (queue, f"{queue}.DQ", f"{queue}.XQ", queue + REPLIES):  # Dramatiq's too
            try:
                ensure_queue(conn, name)(conn.default_channel).delete()
            except Exception:  # noqa: BLE001 - cleanup is best effort
                pass


def command(kind: str, queue: str, concurrency: int) -> list[str]:
    if kind.startswith("workhorse"):
        module = "benchmarks.one_thread" if kind == "workhorse+one-thread" else "workhorse"
        return [sys.executable, "-m", module, "worker", "-A", "benchmarks.bench_tasks:app",
                "-c", str(concurrency), "-Q", queue, "-l", "WARNING"]
    if kind == "floor":
        return [sys.executable, "-m", "benchmarks.floor", "-Q", queue, "-c", str(concurrency)]
    if kind == "dramatiq":
        return [sys.executable, "-m", "dramatiq", "benchmarks.dramatiq_tasks", "--processes",
                str(concurrency), "--threads", "1", "--queues", queue]
    return [sys.executable, "-m", "celery", "-A", "benchmarks.celery_tasks:celery_app", "worker",
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


def results_url(broker: str, workdir: Path) -> str:
    if RESULTS_URL:
        return RESULTS_URL[0]
    return RESULTS.get(BROKERS[broker] or "") or f"sqlite:///{workdir / 'results.sqlite3'}"


def measure(kind: str, broker: str, url: str, task_set: str, count: int, concurrency: int,
            workdir: Path, acks_late: bool = True, results: bool = False,
            workers: int = 1, prefetch_multiplier: int | None = None) -> Run:
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    task, args = TASK_SETS[task_set]
    counter = workdir / f"{queue}.count"
    counter.touch()
    if kind == "dramatiq":
        fill_dramatiq(url, queue, task, args, count)
    else:
        fill(url, queue, task, args, count, results=results,
             queue_type=QUEUE_TYPES.get(broker, "classic"))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("WORKHORSE_", "CELERY_", "DRAMATIQ_"))}
    root = CHECKOUTS.get(kind, ROOT)
    env.update(PYTHONPATH=str(root), BENCH_COUNTER=str(counter), BENCH_QUEUE=queue,
               WORKHORSE_BROKER_URL=url, WORKHORSE_RESULT_BACKEND="disabled",
               WORKHORSE_STATE_DIR=str(workdir / "state"),
               WORKHORSE_PREFETCH_MULTIPLIER=str(prefetch_multiplier or 4),
               BENCH_PREFETCH_MULTIPLIER=str(prefetch_multiplier or 4),
               WORKHORSE_ACKS_LATE=str(acks_late).lower(),
               BENCH_ACKS_LATE=str(acks_late).lower(),
               CELERY_BROKER_URL=split_master_name(url)[0], DRAMATIQ_BROKER_URL=url,
               BENCH_MASTER_NAME=split_master_name(url)[1] or "")
    if prefetch_multiplier is not None:     # (else Dramatiq keeps its default, 2 a process)
        env["dramatiq_queue_prefetch"] = str(prefetch_multiplier)
    if broker in QUEUE_TYPES:       # (only then: a checkout before queue_type refuses it)
        env.update(WORKHORSE_QUEUE_TYPE=QUEUE_TYPES[broker], BENCH_QUEUE_TYPE=QUEUE_TYPES[broker])
    if results:
        env["WORKHORSE_RESULT_BACKEND"] = results_url(broker, workdir)
        store = results_url(broker, workdir)
        env["BENCH_RESULTS"] = store if RESULTS_URL else store.replace("sqlite:", "db+sqlite:")
    stop_scraping = threading.Event()
    if kind == "workhorse+metrics":
        port = free_port()
        env["WORKHORSE_METRICS_PORT"] = str(port)
        threading.Thread(target=scrape, args=(port, stop_scraping), daemon=True).start()
    log = open(workdir / f"{queue}.{kind}.log", "wb")
    procs = []
    for n in range(workers):
        env["WORKHORSE_HOSTNAME"] = f"bench{n}@{socket.gethostname()}"
        procs.append(subprocess.Popen(command(kind, queue, concurrency), cwd=root, env=env,
                                      stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    mains = [psutil.Process(proc.pid) for proc in procs]
    try:
        deadline = time.monotonic() + 600
        first = None
        while counter.stat().st_size < count:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                tail = Path(log.name).read_text(errors="replace").splitlines()[-15:]
                raise RuntimeError(f"{kind} did not finish; its log ends:\n" + "\n".join(tail))
            if first is None and counter.stat().st_size >= 1:
                first = time.monotonic()
                cpu_start = sum(_cpu(main) for main in mains)
                thread_start = sum(main_thread_cpu(main) for main in mains)
                children_start = sum(children_cpu(main) for main in mains)
                broker_start = server_cpu(broker)
            time.sleep(0.001)
        last = time.monotonic()
        cpu = sum(_cpu(main) for main in mains) - cpu_start
        thread_cpu = sum(main_thread_cpu(main) for main in mains) - thread_start
        children = sum(children_cpu(main) for main in mains) - children_start
        broker_used = server_cpu(broker) - broker_start
        main_rss = max(main.memory_info().rss for main in mains)
        child_rss = [rss for main in mains for rss in pool_rss(main)]
        uss = sum(unique_memory(main) for main in mains)
    finally:
        stop_scraping.set()
        for proc in procs:
            kill(proc)
        log.close()
        drop(url, queue)
    assert first is not None
    return Run(last - first, count, cpu, children, main_rss,
               int(statistics.mean(child_rss)) if child_rss else 0, thread_cpu, broker_used,
               uss)


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL a worker's process group (it is gone already if the worker died)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _cpu(process: psutil.Process) -> float:
    return float(sum(process.cpu_times()[:2]))


#: The broker servers' process names, for their CPU per task.
SERVERS = {"redis": "redis-server", "amqp": "beam.smp", "quorum": "beam.smp"}
#: The processes of a server set the run started (broker -> pids): their CPU is summed.
SERVER_PIDS: dict[str, list[int]] = {}


def server_cpu(broker: str) -> float:
    """CPU seconds the broker's server process has used so far (0 if not found: SQLite,
    or a server this machine does not run); a set's processes summed."""
    if broker in SERVER_PIDS:
        total = 0.0
        for pid in SERVER_PIDS[broker]:
            with contextlib.suppress(psutil.Error):
                total += _cpu(psutil.Process(pid))
        return total
    name = SERVERS.get(broker)
    for process in psutil.process_iter(["name"]) if name else ():
        try:
            if process.info["name"] == name:
                return _cpu(process)
        except psutil.Error:
            pass
    return 0.0


def main_thread_cpu(process: psutil.Process) -> float:
    """CPU seconds of the process's main thread (its thread id is the process id)."""
    for thread in process.threads():
        if thread.id == process.pid:
            return float(thread.user_time + thread.system_time)
    return 0.0


def children_cpu(main: psutil.Process) -> float:
    """CPU seconds of the processes below ``main`` (workhorse's sentinel: next to nothing)."""
    total = 0.0
    for child in main.children(recursive=True):
        try:
            total += _cpu(child)
        except psutil.NoSuchProcess:
            pass
    return total


def unique_memory(main: psutil.Process) -> int:
    """The USS of ``main`` and every process below it, summed: what would be freed if the
    worker went (RSS counts the pages a child shares with its parent once per process)."""
    total = 0
    for process in [main, *main.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += process.memory_full_info().uss
    return total


def pool_rss(main: psutil.Process) -> list[int]:
    """The RSS of the pool's processes (workhorse's sentinel, a small ``python -I -S``, is
    left out)."""
    sizes = []
    for child in main.children():
        try:
            if "-I" not in child.cmdline()[1:3]:
                sizes.append(child.memory_info().rss)
        except psutil.NoSuchProcess:
            pass
    return sizes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", choices=sorted(BROKERS), action="append")
    parser.add_argument("--set", choices=sorted(TASK_SETS), action="append", dest="sets")
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1,
                        help="workers of each kind on the broker (default 1)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--prefetch-multiplier", type=int, metavar="N",
                        help="every worker's window: N a process of the pool, Dramatiq's "
                             "too (without it: 4, and Dramatiq keeps its own default, 2 a "
                             "process)")
    parser.add_argument("--metrics", action="store_true",
                        help="also run workhorse with metrics on, scraped every second")
    parser.add_argument("--one-thread", action="store_true",
                        help="also run workhorse with its broker thread's loop on the loop "
                             "thread (an experiment: benchmarks/one_thread.py)")
    parser.add_argument("--floor", action="store_true",
                        help="also run the bare loop of benchmarks/floor.py (not on Sentinel): "
                             "the least a supervisor can cost a task")
    parser.add_argument("--acks", choices=("late", "early", "both"), default="late",
                        help="acks_late = true (late, the default), false for every worker "
                             "(early: at-most-once), or each in turn")
    parser.add_argument("--acks-early", action="store_true", help="the same as --acks early")
    parser.add_argument("--results", action="store_true",
                        help="store results: in the SQLite file beside the SQLite broker, "
                             "else in Redis (Celery too; Dramatiq stores none)")
    parser.add_argument("--results-url", metavar="URL", action="append",
                        help="store results there, for every broker and worker: "
                             "db+postgresql://postgres@127.0.0.1/bench, rpc://, ...; "
                             "given more than once, each store in turn within a round")
    parser.add_argument("--against", type=Path, action="append", default=[],
                        help="also run workhorse as the checkout in this directory has it "
                             "(e.g. a git worktree of an earlier commit): before and after "
                             "a change, in one run")
    parser.add_argument("--only", choices=("workhorse", "celery", "dramatiq"), action="append",
                        help="run only these (default: all that can run)")
    args = parser.parse_args()
    if args.results_url:
        RESULTS_URL[:] = args.results_url[:1]
        args.results = True
    for checkout in args.against:
        CHECKOUTS[f"workhorse@{checkout.resolve().name}"[:18]] = checkout.resolve()
    dramatiq = importlib.util.find_spec("dramatiq") is not None
    brokers = args.broker or ["sqlite", "redis", "amqp"]
    if args.results and "sentinel" in brokers:
        parser.error("--results cannot be used with --broker sentinel: results are not "
                     "stored through the sentinels here (run --broker redis for them)")
    if args.floor and args.results:
        parser.error("--floor cannot be used with --results: the floor stores no results")
    if args.floor and "sentinel" in brokers:
        print("(the floor is left out on Sentinel: it talks to one Redis server)")
    sets = args.sets or ["noop", "sleep"]
    modes = ["early"] if args.acks_early else (["late", "early"] if args.acks == "both"
                                               else [args.acks])
    stored = ("stored in " + ", ".join(args.results_url or [results_url(brokers[0], Path())])
              if args.results else "disabled")
    print(f"{args.tasks} no-op tasks ({max(200, args.tasks // 5)} of 10 ms), concurrency "
          f"{args.concurrency}, {args.workers} worker(s) of each, prefetch multiplier "
          f"{args.prefetch_multiplier or 4}"
          f"{'' if args.prefetch_multiplier else ' (Dramatiq: its default, 2)'}, "
          f"acks {' and '.join(modes)}, results "
          f"{stored}"
          f"; medians of {args.repeat} rounds, "
          "each worker once a round in turn (a ratio: the median of the rounds' ratios)")
    if not dramatiq:
        print("(Dramatiq is not installed: pip install 'dramatiq[redis,rabbitmq]')")
    print(f"{'broker':8} {'set':6} {'acks':5} {'worker':18} {'tasks/s':>8} {'ratio':>6} "
          f"{'main CPU/task':>14} {'(main thread)':>14} {'pool CPU/task':>14} {'main RSS':>9} "
          f"{'child RSS':>10} {'server CPU/task':>16} {'USS':>9} {'limit/s':>8} "
          f"{'of limit':>8}")
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as servers:
        workdir = Path(tmp)
        for broker in brokers:
            url = BROKERS[broker] or f"sqlite:///{workdir / 'broker.sqlite3'}"
            if broker == "sentinel":
                url = servers.enter_context(sentinel_set(workdir / "sentinel"))
            # Celery stores SQLite results through SQLAlchemy, Dramatiq none here.
            celery = not (args.results and broker == "sqlite"
                          and importlib.util.find_spec("sqlalchemy") is None)
            if not celery:
                print("(Celery is left out on SQLite: its SQLite result store needs "
                      "SQLAlchemy, pip install sqlalchemy)")
            kinds = ["workhorse", *([] if broker in QUEUE_TYPES else CHECKOUTS)] + (
                ["workhorse+metrics"] if args.metrics else []) + (
                ["workhorse+one-thread"] if args.one_thread else []) + (
                ["floor"] if args.floor and broker != "sentinel" else []) + (
                ["celery"] if celery else []) + (
                ["dramatiq"] if dramatiq and broker in ("redis", "amqp", "sentinel")
                and not args.results
                else [])
            if args.only:
                kinds = [k for k in kinds
                         if k == "floor" or re.split("[+@]", k)[0] in args.only]
            for task_set, mode in [(t, m) for t in sets for m in modes]:
                count = args.tasks if task_set == "noop" else max(200, args.tasks // 5)
                # For each store (--results-url, given more than once: each in turn
                # within a round), one list per kind, a place per round (None: failed).
                stores = list(args.results_url or [None])
                results: dict[str | None, dict[str, list[Run | None]]] = {
                    store: {kind: [] for kind in kinds} for store in stores}
                for _ in range(args.repeat):
                    for store, kind in [(s, k) for s in stores for k in kinds]:
                        RESULTS_URL[:] = [store] if store else []
                        try:   # interleaved: the same noise for each
                            run: Run | None = measure(
                                kind, broker, url, task_set, count, args.concurrency,
                                workdir, acks_late=mode == "late", results=args.results,
                                workers=args.workers,
                                prefetch_multiplier=args.prefetch_multiplier)
                        except RuntimeError as exc:
                            print(f"  {kind} on {broker}: {exc}", file=sys.stderr)
                            run = None
                        results[store][kind].append(run)
                for store in stores:
                    if len(stores) > 1:
                        print(f"-- results stored in {store}")
                    report(broker, task_set, mode, results[store])
    return 0


@contextlib.contextmanager
def sentinel_set(base: Path) -> Iterator[str]:
    """A Redis Sentinel set of the run's own, up until the run ends: its URL in workhorse's
    form (database 3, as the shared Redis's runs use), its processes' CPU the server's."""
    from tests.redis_sentinel import SentinelSet, available
    why = available()
    if why:
        raise SystemExit(f"--broker sentinel: cannot start a Sentinel set here: {why}")
    found = SentinelSet(base)
    try:
        found.up()
        SERVER_PIDS["sentinel"] = [i.process.pid for i in (*found.servers, *found.sentinels)
                                   if i.process is not None]
        yield f"{found.urls(3)}?master_name={found.master_name}"
    finally:
        SERVER_PIDS.pop("sentinel", None)
        found.down()


def report(broker: str, task_set: str, mode: str,
           rounds: dict[str, list[Run | None]]) -> None:
    """One line per worker kind: medians; the ratio is workhorse's rate over its, the
    median of the rounds' ratios (each round ran every kind once, one after another)."""
    results = {k: [r for r in v if r is not None] for k, v in rounds.items()}
    rates = {k: statistics.median(r.rate for r in v) for k, v in results.items() if v}
    ours = rounds.get("workhorse", [])
    for kind, runs in results.items():
        if not runs:
            print(f"{broker:8} {task_set:6} {mode:5} {kind:18} {'failed':>8}")
            continue
        rate = rates[kind]
        paired = [a.rate / b.rate for a, b in zip(ours, rounds[kind], strict=True)
                  if a is not None and b is not None]
        ratio = f"{statistics.median(paired):.2f}" if paired and kind != "workhorse" else ""
        main_cpu = statistics.median(r.main_cpu / r.tasks * 1e6 for r in runs)
        thread_cpu = statistics.median(r.main_thread_cpu / r.tasks * 1e6 for r in runs)
        pool_cpu = statistics.median(r.children_cpu / r.tasks * 1e6 for r in runs)
        main_rss = statistics.median(r.main_rss for r in runs) / 2**20
        child_rss = statistics.median(r.child_rss for r in runs) / 2**20
        server = statistics.median(r.broker_cpu / r.tasks * 1e6 for r in runs)
        uss = statistics.median(r.uss for r in runs) / 2**20
        # The machine's limit for this worker: its cores, if the supervisor cost nothing
        # and the broker server and the pool's CPU a task were all there was to pay.
        limit = (os.cpu_count() or 1) / ((server + pool_cpu) / 1e6) if server + pool_cpu else 0
        share = f"{rate / limit:7.0%}" if limit else ""
        print(f"{broker:8} {task_set:6} {mode:5} {kind:18} {rate:8.0f} {ratio:>6} "
              f"{main_cpu:11.0f} µs {thread_cpu:11.0f} µs {pool_cpu:11.0f} µs "
              f"{main_rss:6.1f} MB {child_rss:7.1f} MB {server:13.0f} µs {uss:6.1f} MB "
              f"{limit:8.0f} {share:>8}")


if __name__ == "__main__":
    sys.exit(main())
