"""The supervisor's CPU a task taken apart: user and system time, context switches, and
(with ``--syscalls``) the loop thread's system calls, each per task; beside them the
pool's CPU a task and how the machine's cores spent the same span (busy, idle, stolen).

    python benchmarks/supervisor_costs.py --broker redis [--acks-early] [--pin] [--syscalls]
    python benchmarks/supervisor_costs.py --broker redis --calls   # Python calls a task

Fills a queue, starts ``workhorse worker`` (concurrency 2, prefetch multiplier 4) on it
and measures the supervisor process over ``--seconds`` while it drains. ``--pin`` puts
the supervisor on the first core and the children on the second first: if the figures
then fall, caches and migrations between the cores were part of the cost. ``--syscalls``
counts the loop thread's system calls with ``strace -c`` (which slows it: the counts a
task hold, the rates do not). ``--calls`` runs the supervisor under cProfile instead and
prints the Python function calls a task by package (the rates are cProfile's, not the
worker's).
"""
from __future__ import annotations

import argparse
import collections
import pstats
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_supervisor import drain_parser, draining


def main() -> int:
    parser = drain_parser(__doc__, 60000, 4.0)
    parser.add_argument("--pin", action="store_true",
                        help="the supervisor on the first core, the children on the second")
    parser.add_argument("--syscalls", action="store_true",
                        help="count the loop thread's system calls (strace -c)")
    parser.add_argument("--calls", action="store_true",
                        help="the Python calls a task, by package (cProfile)")
    parser.add_argument("--top", type=int, default=30,
                        help="with --calls: how many functions to list by their own time")
    args = parser.parse_args()
    if args.syscalls and shutil.which("strace") is None:
        print("strace is not installed", file=sys.stderr)
        return 2
    if args.calls:
        return calls(args)
    with draining(args.broker, args.tasks, args.acks_early) as (proc, counter):
        supervisor = psutil.Process(proc.pid)
        if args.pin:
            supervisor.cpu_affinity([0])
            for child in supervisor.children():
                child.cpu_affinity([1])
            time.sleep(0.5)
        tracer, trace, traced0 = None, counter.parent / "strace.txt", 0
        if args.syscalls:       # (-p without -f: the process's main thread, the loop's)
            traced0 = counter.stat().st_size
            tracer = subprocess.Popen(["strace", "-c", "-o", str(trace), "-p", str(proc.pid)],
                                      stderr=subprocess.DEVNULL)
        children = supervisor.children()
        done0, cpu0, ctx0 = (counter.stat().st_size, supervisor.cpu_times(),
                             supervisor.num_ctx_switches())
        machine0, pool0 = psutil.cpu_times(), _cpu(children)
        started = time.monotonic()
        time.sleep(args.seconds)
        done1, cpu1, ctx1 = (counter.stat().st_size, supervisor.cpu_times(),
                             supervisor.num_ctx_switches())
        machine1, pool1 = psutil.cpu_times(), _cpu(children)
        elapsed = time.monotonic() - started
        traced = 1
        if tracer is not None:
            tracer.send_signal(signal.SIGINT)
            tracer.wait(30)
            traced = max(counter.stat().st_size - traced0, 1)     # (a little more: the
            # counts are from strace's whole span, which holds the tasks counted here)
        tasks = max(done1 - done0, 1)
        if done1 >= args.tasks - 100:
            print("warning: the queue ran dry; use more --tasks", file=sys.stderr)
        print(f"{args.broker}, acks_{'early' if args.acks_early else 'late'}"
              f"{', pinned' if args.pin else ''}: {tasks} tasks, {tasks / elapsed:.0f}/s"
              f"{' (under strace)' if tracer else ''}")
        print(f"supervisor CPU a task: user {(cpu1.user - cpu0.user) / tasks * 1e6:.1f} µs, "
              f"system {(cpu1.system - cpu0.system) / tasks * 1e6:.1f} µs; context switches "
              f"a task: {(ctx1.voluntary - ctx0.voluntary) / tasks:.2f} voluntary, "
              f"{(ctx1.involuntary - ctx0.involuntary) / tasks:.2f} involuntary")
        print(f"the pool's CPU a task: {(pool1 - pool0) / tasks * 1e6:.1f} µs; "
              f"the machine meanwhile ({psutil.cpu_count()} cores): "
              f"{_shares(machine0, machine1)}")
        if tracer is not None:
            print(f"the loop thread's system calls a task ({traced} tasks while strace was "
                  "attached; a call of its own may count for a task or two at either end):")
            for name, count in syscalls(trace.read_text()):
                if count / traced >= 0.01:
                    print(f"  {count / traced:6.2f}  {name}")
    return 0


def _cpu(processes: list[psutil.Process]) -> float:
    """User and system CPU seconds of ``processes`` (one that is gone counts nothing)."""
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def _shares(before: object, after: object) -> str:
    """How the machine's CPU time went between two ``psutil.cpu_times()``: busy, idle
    (nothing to run: the pipeline waits) and stolen by the hypervisor."""
    spent = {field: getattr(after, field) - getattr(before, field)
             for field in after._fields}     # type: ignore[attr-defined]
    total = sum(spent.values()) or 1.0
    share = {field: 100 * value / total for field, value in spent.items()}
    busy = 100 - share["idle"] - share.get("iowait", 0) - share.get("steal", 0)
    return (f"busy {busy:.0f}% (user {share['user']:.0f}%, system {share['system']:.0f}%, "
            f"softirq {share.get('softirq', 0):.0f}%), idle {share['idle']:.0f}%, "
            f"iowait {share.get('iowait', 0):.0f}%, steal {share.get('steal', 0):.0f}%")


def syscalls(summary: str) -> list[tuple[str, int]]:
    """(name, calls) from ``strace -c``'s table, most first."""
    out = []
    for line in summary.splitlines():
        fields = line.split()
        if len(fields) >= 5 and fields[0][0].isdigit() and fields[-1] != "total":
            out.append((fields[-1], int(fields[3])))
    return sorted(out, key=lambda row: -row[1])


def calls(args: argparse.Namespace) -> int:
    """The supervisor under cProfile (``python -m cProfile``), stopped with SIGTERM so that
    it writes its profile: its Python calls a task, by package."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "supervisor.prof"
        with draining(args.broker, args.tasks, args.acks_early, stop=signal.SIGTERM,
                      python_args=("-m", "cProfile", "-o", str(out))) as (_, counter):
            time.sleep(args.seconds)
            tasks = counter.stat().st_size
        profile = pstats.Stats(str(out))
        stats = profile.stats      # type: ignore[attr-defined]
    by_package: collections.Counter[str] = collections.Counter()
    for (path, _, _), (_, ncalls, _, _, _) in stats.items():
        by_package[_package(path)] += ncalls
    print(f"{args.broker}: {tasks} tasks (start-up included, so drain long enough); "
          "calls a task:")
    for package, count in by_package.most_common(15):
        print(f"  {count / tasks:7.1f}  {package}")
    print("the functions with the most time of their own (cProfile's, which slows the "
          "smallest calls most), µs a task:")
    own = sorted(stats.items(), key=lambda item: -item[1][2])
    for (path, line, name), (_, ncalls, tottime, _, _) in own[:args.top]:
        print(f"  {tottime / tasks * 1e6:7.2f}  {ncalls / tasks:6.2f} calls  "
              f"{_package(path)}:{line} {name}")
    return 0


def _package(path: str) -> str:
    """``workhorse/daemon``, ``kombu``, ``json``...; ``~`` is the built-ins."""
    if path == "~":
        return "built-ins"
    path = re.sub(r".*/lib/python3\.\d+/", "", path.split("site-packages/")[-1])
    parts = [p for p in Path(path).parts if p != "/"]
    if "workhorse" in parts:
        rest = parts[parts.index("workhorse"):]
        return "/".join(rest[:2]).removesuffix(".py")
    return parts[0].removesuffix(".py") if parts else path


if __name__ == "__main__":
    sys.exit(main())
