"""Where the supervisor's time goes: a sampling profile of a worker draining no-op tasks.

    pip install py-spy
    python benchmarks/profile_supervisor.py --broker redis [--acks-early] [--results]

Fills a queue, starts ``workhorse worker`` (concurrency 2, prefetch multiplier 4) on it,
and samples the supervisor process (all its threads) with py-spy while it drains. Prints
the supervisor's CPU per task over the sampled span and the functions holding the most
samples, as self time and as inclusive time (a function anywhere on the stack); the raw
collapsed stacks are kept (``--keep``) for a flame graph.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import BROKERS, ROOT, command, drop, fill


def drain_parser(doc: str, tasks: int, seconds: float) -> argparse.ArgumentParser:
    """The options of a script that measures a worker ``draining`` a queue."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--broker", choices=sorted(BROKERS), default="redis")
    parser.add_argument("--tasks", type=int, default=tasks)
    parser.add_argument("--seconds", type=float, default=seconds)
    parser.add_argument("--acks-early", action="store_true", help="acks_late = false")
    return parser


def main() -> int:
    parser = drain_parser(__doc__, 20000, 6)
    parser.add_argument("--results", action="store_true",
                        help="store results (SQLite or Redis store, as the broker)")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--keep", help="write the collapsed stacks here")
    parser.add_argument("--rate", type=int, default=250,
                        help="samples a second (more: finer shares, a slower worker)")
    parser.add_argument("--idle", action="store_true",
                        help="count idle samples (threads waiting in select) too")
    parser.add_argument("--all", action="store_true",
                        help="sample every thread, not only the one holding the GIL (the "
                             "default shows where Python code spends CPU)")
    parser.add_argument("--child", action="store_true",
                        help="sample the pool child that has used the most CPU, not the "
                             "supervisor (the CPU a task is then that child's, its "
                             "share of the tasks about half)")
    args = parser.parse_args()
    # The venv's bin directory first: running its python does not put it on PATH.
    pyspy = (shutil.which("py-spy", path=str(Path(sys.executable).parent))
             or shutil.which("py-spy"))
    if pyspy is None:
        print("py-spy is not installed: pip install py-spy", file=sys.stderr)
        return 2
    with draining(args.broker, args.tasks, args.acks_early, args.results) as (proc, counter):
        main_proc = psutil.Process(proc.pid)
        if args.child:
            time.sleep(1)       # (at 200 tasks done, a child's CPU still reads 0)
            main_proc = max((child for child in main_proc.children()
                             if child.name().startswith("workhorse: child")),
                            key=lambda child: sum(child.cpu_times()[:2]))
        done0, cpu0 = counter.stat().st_size, sum(main_proc.cpu_times()[:2])
        raw = counter.parent / "stacks.txt"
        spy = [pyspy, "record", "-p", str(main_proc.pid), "-d", str(round(args.seconds)),
               "-r", str(args.rate),
               "-f", "raw", "-o", str(raw), "--nonblocking", "--threads"]
        if args.idle:
            spy.append("--idle")
        if not args.all:
            spy.append("--gil")
        subprocess.run(spy, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        done1, cpu1 = counter.stat().st_size, sum(main_proc.cpu_times()[:2])
        collapsed = raw.read_text()
        if args.keep:
            shutil.copy(raw, args.keep)
    tasks = done1 - done0
    if tasks >= args.tasks - 200:
        print("warning: the queue ran dry while sampling; use more --tasks", file=sys.stderr)
    print(f"{args.broker}, acks_{'early' if args.acks_early else 'late'}, results "
          f"{'stored' if args.results else 'disabled'}: {tasks} tasks in the sampled span, "
          f"{'a child' if args.child else 'supervisor'} CPU "
          f"{(cpu1 - cpu0) / max(tasks, 1) * 1e6:.0f} µs/task "
          "(py-spy's own sampling included)")
    report(collapsed, args.top)
    return 0


@contextlib.contextmanager
def draining(broker: str, tasks: int, acks_early: bool = False, results: bool = False,
             stop: int | None = None, python_args: Sequence[str] = (),
             prefix: Sequence[str] = (), root: Path | None = None, startup: float = 60.0,
             ) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """A queue of ``tasks`` no-op tasks and ``workhorse worker`` (concurrency 2, prefetch
    multiplier 4) draining it, once 200 are done (within ``startup`` seconds): the
    worker's process and the file that grows by a byte a task. Killed, and the queue
    dropped, on leaving (sent ``stop`` first and given a minute to exit, if given).
    ``python_args`` go to the interpreter before the worker's module (``-m cProfile -o
    FILE``), ``prefix`` before the interpreter (a program that runs it, as valgrind);
    ``root``: the checkout whose workhorse runs (this one's by default)."""
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        url = BROKERS[broker] or f"sqlite:///{workdir / 'broker.sqlite3'}"
        queue = f"prof-{uuid.uuid4().hex[:8]}"
        counter = workdir / "count"
        counter.touch()
        fill(url, queue, "bench.noop", [], tasks, results=results)
        store = "disabled"
        if results:
            store = ("redis://127.0.0.1:6379/4" if broker == "redis"
                     else f"sqlite:///{workdir / 'results.sqlite3'}")
        env = {k: v for k, v in os.environ.items() if not k.startswith("WORKHORSE_")}
        root = root or ROOT
        env.update(PYTHONPATH=str(root), BENCH_COUNTER=str(counter), WORKHORSE_BROKER_URL=url,
                   WORKHORSE_RESULT_BACKEND=store, WORKHORSE_STATE_DIR=str(workdir / "state"),
                   WORKHORSE_PREFETCH_MULTIPLIER="4",
                   WORKHORSE_ACKS_LATE="false" if acks_early else "true")
        if results:
            env["BENCH_RESULTS"] = store
        log = open(workdir / "worker.log", "wb")
        python, *worker = command("workhorse", queue, 2)
        proc = subprocess.Popen([*prefix, python, *python_args, *worker], cwd=root, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + startup
            while counter.stat().st_size < 200:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the worker did not start draining:\n"
                                       + (workdir / "worker.log").read_text())
                time.sleep(0.01)
            yield proc, counter
        finally:
            if stop is not None:
                proc.send_signal(stop)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(60)
            with contextlib.suppress(ProcessLookupError):     # (gone with its group)
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            log.close()
            drop(url, queue)


def report(collapsed: str, top: int) -> None:
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue    # (py-spy splits a stack over two lines now and then: left out)
        count = int(count_text)
        frames = stack.split(";")
        total += count
        threads[frames[0]] += count
        names = [_short(f) for f in frames[1:]]
        if names:
            own[names[-1]] += count
        for name in set(names):
            inclusive[name] += count
    print(f"{total} samples; by thread: " + ", ".join(
        f"{name} {100 * n / total:.0f}%" for name, n in threads.most_common()))
    for title, counter in (("self", own), ("inclusive", inclusive)):
        print(f"\n-- {title}")
        for name, n in counter.most_common(top):
            print(f"{100 * n / total:5.1f}%  {name}")


def _short(frame: str) -> str:
    """``function (path/to/file.py:123)`` -> ``function (file.py)``."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    parts = Path(path).parts
    short = "/".join(parts[-2:]) if len(parts) >= 2 else path
    return f"{name} ({short})"


if __name__ == "__main__":
    sys.exit(main())
