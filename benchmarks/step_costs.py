"""What each step of the supervisor's loop costs a task, timed inside a worker that drains
no-op tasks at full speed (``py-spy`` samples too rarely to tell steps of a few µs apart,
and cProfile slows every call, the smallest most).

    python benchmarks/step_costs.py --broker redis [--acks-early] [--seconds 6]

Each step is a method of the supervisor, wrapped to add its wall time (two
``perf_counter`` calls, about 0.3 µs a call, counted in the step and in the steps around
it). Wall time: a step that wakes a process (a job written to a child's pipe, a take to
the broker's socket) includes the time the kernel lets the woken process run first on this
2-core machine. Figures a task are totals divided by the jobs started (one a task).
Nested steps are indented under the step they are part of.

    python -m benchmarks.step_costs --launch -m workhorse worker ...

is how the benchmark runs the worker (with ``STEP_COSTS_OUT``, where the totals go at
exit); a step a broker does not take (RabbitMQ takes nothing) shows no calls.
"""
from __future__ import annotations

import argparse
import atexit
import importlib
import os
import runpy
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: (depth, label, module, class, method): the steps, in the order printed.
STEPS: list[tuple[int, str, str, str, str]] = [
    (0, "a turn's events handled (readers, timers)", "workhorse.daemon.loop", "Loop",
     "dispatch"),
    (1, "a child's frame read", "workhorse.daemon.slots", "Slots", "on_readable"),
    (2, "its task's end settled", "workhorse.daemon.supervisor", "Supervisor", "job_done"),
    (1, "a take's answer read (Redis, on the loop thread)", "workhorse.broker.link",
     "BrokerLink", "_read_sent"),
    (2, "messages made of it (kombu's)", "workhorse.transport.redis", "Channel",
     "_take_reply"),
    (1, "deliveries read (RabbitMQ, on the loop thread)", "workhorse.broker.link",
     "BrokerLink", "_read_here"),
    (2, "the reading handed back to the broker thread (it was busy)",
     "workhorse.broker.link", "BrokerLink", "_reads_back"),
    (2, "the reading lent to the loop again", "workhorse.broker.link", "BrokerLink",
     "_reads_lent"),
    (1, "what the broker thread posted run (its messages, acks' answers)",
     "workhorse.broker.link", "BrokerLink", "_run_posted"),
    (0, "a turn's arrivals looked at", "workhorse.daemon.supervisor", "Supervisor",
     "_accept_received"),
    (1, "one message's intake", "workhorse.daemon.intake", "Intake", "accept"),
    (0, "a turn's dispatch", "workhorse.daemon.dispatch", "Dispatch", "dispatch"),
    (1, "a job started", "workhorse.daemon.dispatch", "Dispatch", "_start"),
    (2, "the journal's line", "workhorse.broker.journal", "Journal", "started"),
    (2, "the job's frame made and written (wakes the child)", "workhorse.pool.spawn",
     "ForkedProcess", "send"),
    (0, "a take sent (Redis, before the loop waits)", "workhorse.broker.link", "BrokerLink",
     "_send_take"),
    (0, "acks and a take made here (SQLite, before the loop waits)", "workhorse.broker.link",
     "BrokerLink", "_take_here"),
    (1, "the take, its messages made (kombu's)", "workhorse.transport.sqlite", "Channel",
     "take"),
    (2, "its transaction", "workhorse.transport.store", "Store", "lease_many"),
    (0, "room and credit said to the broker side", "workhorse.daemon.supervisor",
     "Supervisor", "_changed"),
]
#: The step whose calls count the tasks.
TASKS = ("workhorse.daemon.dispatch", "Dispatch", "_start")


def _wrap(owner: Any, name: str, totals: list[float]) -> None:
    method = getattr(owner, name)
    clock = time.perf_counter

    def timed(*args: Any, **kwargs: Any) -> Any:
        began = clock()
        try:
            return method(*args, **kwargs)
        finally:
            totals[0] += 1
            totals[1] += clock() - began

    setattr(owner, name, timed)


def launch() -> int:
    """The worker, its steps timed; their totals written to ``STEP_COSTS_OUT`` at exit
    (by the supervisor only: the children inherit the wrappers, not the writing)."""
    args = sys.argv[2:]
    if args[:2] != ["-m", "workhorse"]:
        print("usage: python -m benchmarks.step_costs --launch -m workhorse worker ...",
              file=sys.stderr)
        return 2
    totals: dict[tuple[str, str, str], list[float]] = {}
    for _, _, module, owner, name in STEPS:
        key = (module, owner, name)
        try:
            cls = getattr(importlib.import_module(module), owner)
        except (ImportError, AttributeError):
            continue
        if key not in totals:
            totals[key] = [0.0, 0.0]
            _wrap(cls, name, totals[key])
    supervisor, out = os.getpid(), os.environ["STEP_COSTS_OUT"]

    def write() -> None:
        if os.getpid() == supervisor:
            Path(out).write_text("".join(f"{m} {o} {n} {c:.0f} {t!r}\n"
                                         for (m, o, n), (c, t) in totals.items()))

    atexit.register(write)
    sys.argv = ["workhorse", *args[2:]]
    runpy.run_module("workhorse", run_name="__main__", alter_sys=True)
    return 0


def main() -> int:
    from profile_supervisor import drain_parser, draining

    parser: argparse.ArgumentParser = drain_parser(__doc__, 60000, 6.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "steps.txt"
        os.environ["STEP_COSTS_OUT"] = str(out)
        with draining(args.broker, args.tasks, args.acks_early, stop=signal.SIGTERM,
                      python_args=("-m", "benchmarks.step_costs", "--launch"),
                      ) as (proc, counter):
            import psutil
            process = psutil.Process(proc.pid)
            done0, cpu0 = counter.stat().st_size, sum(process.cpu_times()[:2])
            began = time.monotonic()
            time.sleep(args.seconds)
            done1, cpu1 = counter.stat().st_size, sum(process.cpu_times()[:2])
            rate = (done1 - done0) / (time.monotonic() - began)
        if not out.exists():
            print("the worker wrote no step totals (did it exit cleanly?)", file=sys.stderr)
            return 1
        rows = {(m, o, n): (float(c), float(t)) for m, o, n, c, t in
                (line.split() for line in out.read_text().splitlines())}
    tasks = rows.get(TASKS, (0.0, 0.0))[0]
    if tasks < 1000:
        print(f"only {tasks:.0f} jobs started: drain longer", file=sys.stderr)
        return 1
    print(f"{args.broker}, acks {'early' if args.acks_early else 'late'}: {rate:,.0f} tasks/s "
          f"while timed, supervisor CPU {(cpu1 - cpu0) / max(done1 - done0, 1) * 1e6:.0f} µs "
          f"a task (the wrappers' own included); {tasks:,.0f} jobs started")
    print(f"{'step':66s} {'calls/task':>10s} {'µs/call':>8s} {'µs/task':>8s}")
    for depth, label, module, owner, name in STEPS:
        calls, seconds = rows.get((module, owner, name), (0.0, 0.0))
        if calls:
            print(f"{'  ' * depth + label:66s} {calls / tasks:10.2f} "
                  f"{seconds / calls * 1e6:8.1f} {seconds / tasks * 1e6:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(launch() if sys.argv[1:2] == ["--launch"] else main())
