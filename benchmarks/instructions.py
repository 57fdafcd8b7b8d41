"""The supervisor's instructions a task, counted by callgrind: a figure that repeats
from run to run where seconds do not.

    python benchmarks/instructions.py --broker redis
    python benchmarks/instructions.py --broker redis --against ../base --repeat 3

This machine's timings move by 20% from one run to the next and by 2x from day to day,
so a change worth 2% of the supervisor's CPU cannot be seen in tasks per second.
Instructions can: the worker runs under ``valgrind --tool=callgrind`` (its children too,
forked from it), drains a queue of no-op tasks (concurrency 2, prefetch multiplier 4,
late acks unless ``--acks-early``), and the supervisor's instructions over ``--seconds``
of the drain (every thread of it; start-up left out) are divided by the tasks finished
in that span. Three runs of one commit agreed within 1%.

What it does not count: the kernel's side of system calls (the figure is user-space
instructions only), and time spent waiting. Under callgrind everything runs about 60
times slower, so what happens once a second (timers, polls, heartbeats) weighs about
60 times more a task than it does at full speed; compare commits with it, not brokers.
``--against DIR`` runs another checkout's worker (a git worktree of an earlier commit)
in turn with this one, ``--repeat`` times each, and prints the ratio of the medians.
``--children`` counts the pool's children instead: both, from their fork to their exit
(the worker is stopped after ``--seconds``), over every task they ran: what a no-op
task costs on the child's side, which shares the 2 cores with the supervisor.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_supervisor import drain_parser, draining

#: Start-up under callgrind (imports, 60 times slower) takes half a minute here.
STARTUP = 600.0


def main() -> int:
    parser = drain_parser(__doc__, 20000, 20.0)
    parser.add_argument("--against", type=Path,
                        help="also count the worker of the checkout in this directory")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--children", action="store_true",
                        help="count the pool's children, not the supervisor")
    args = parser.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("valgrind (with callgrind_control) is not installed", file=sys.stderr)
        return 2
    checkouts: list[tuple[str, Path | None]] = [("this checkout", None)]
    if args.against is not None:
        checkouts.append((str(args.against), args.against.resolve()))
    counts: dict[str, list[float]] = {name: [] for name, _ in checkouts}
    for _ in range(args.repeat):
        for name, root in checkouts:
            per_task, tasks = (count_children if args.children else count)(args, root)
            counts[name].append(per_task)
            print(f"{name}: {per_task:,.0f} instructions a task ({tasks} tasks)", flush=True)
    medians = {name: statistics.median(values) for name, values in counts.items()}
    acks = "early" if args.acks_early else "late"
    whose = "the children's" if args.children else "the supervisor's"
    for name, median in medians.items():
        print(f"{args.broker}, acks {acks}, {name}: median {median:,.0f} of {whose} "
              f"instructions a task over {len(counts[name])} run(s)")
    if args.against is not None:
        this, other = medians["this checkout"], medians[str(args.against)]
        print(f"this checkout / {args.against}: {this / other:.3f}")
    return 0


def count(args: argparse.Namespace, root: Path | None) -> tuple[float, int]:
    """One drain under callgrind (the worker of checkout ``root``, or this one's): the
    supervisor's instructions a task, and the tasks counted."""
    broker, tasks, acks_early, seconds = args.broker, args.tasks, args.acks_early, args.seconds
    out_dir, prefix = _callgrind()
    with draining(broker, tasks, acks_early, prefix=prefix, root=root,
                  startup=STARTUP) as (proc, counter):
        subprocess.run(["callgrind_control", "--zero", str(proc.pid)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        done0 = counter.stat().st_size
        time.sleep(seconds)
        subprocess.run(["callgrind_control", "--dump=window", str(proc.pid)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        done1 = counter.stat().st_size
        if done1 >= tasks - 100:
            print("warning: the queue ran dry; use more --tasks", file=sys.stderr)
        instructions = _window(out_dir, proc.pid)
        proc.send_signal(signal.SIGKILL)
    _remove_counts(out_dir, [proc.pid])
    done = max(done1 - done0, 1)
    return instructions / done, done


def count_children(args: argparse.Namespace, root: Path | None) -> tuple[float, int]:
    """One drain under callgrind, stopped (SIGTERM) after ``args.seconds``: the pool's
    children's instructions from fork to exit, over the tasks finished. (callgrind_control
    finds no child: their titles hide valgrind's command line. Each writes its counts as
    it exits.)"""
    # (a forked process inherits its parent's counts: zeroed as the fork returns in it)
    out_dir, prefix = _callgrind("--zero-before=PyOS_AfterFork_Child")
    with draining(args.broker, args.tasks, args.acks_early, prefix=prefix, root=root,
                  startup=STARTUP) as (proc, counter):
        children = [child.pid for child in psutil.Process(proc.pid).children()
                    if child.name().startswith("workhorse: chil")]  # (its title, cut)
        time.sleep(args.seconds)
        proc.send_signal(signal.SIGTERM)
        proc.wait(STARTUP)
        done = counter.stat().st_size
    if done >= args.tasks - 100:
        print("warning: the queue ran dry; use more --tasks", file=sys.stderr)
    instructions = 0
    for pid in children:
        found = _total((out_dir / f"workhorse-callgrind.{pid}").read_text(errors="replace"))
        if found is None:
            raise RuntimeError(f"callgrind wrote no counts for child {pid}")
        instructions += found
    _remove_counts(out_dir, [proc.pid, *children])
    return instructions / max(done, 1), done


def _callgrind(*options: str) -> tuple[Path, list[str]]:
    """Where callgrind writes its counts (a file a process), and the command that runs
    the worker under it."""
    out_dir = Path(os.environ.get("TMPDIR", "/tmp"))
    return out_dir, ["valgrind", "--tool=callgrind", "--trace-children=no", *options,
                     f"--callgrind-out-file={out_dir}/workhorse-callgrind.%p"]


def _total(text: str) -> int | None:
    """The instructions a callgrind file counts."""
    found = re.search(r"^(?:summary|totals):\s+(\d+)", text, re.M)
    return None if found is None else int(found.group(1))


def _remove_counts(out_dir: Path, pids: list[int]) -> None:
    for pid in pids:
        for leftover in [*out_dir.glob(f"workhorse-callgrind.{pid}"),
                         *out_dir.glob(f"workhorse-callgrind.{pid}.*")]:
            leftover.unlink()


def _window(out_dir: Path, pid: int) -> int:
    """The instructions of the dump named ``window`` of process ``pid``."""
    for path in out_dir.glob(f"workhorse-callgrind.{pid}*"):
        text = path.read_text(errors="replace")
        if re.search(r"^desc: Trigger: .*window", text, re.M) is None:
            continue
        found = _total(text)
        if found is not None:
            return found
    raise RuntimeError(f"callgrind wrote no dump named window for process {pid}")


if __name__ == "__main__":
    sys.exit(main())
