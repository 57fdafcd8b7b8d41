"""A long queue: does draining 100,000 messages slow down, or grow the supervisor?

    python benchmarks/drain.py --broker redis [--tasks 100000] [--celery]

Fills one queue with ``--tasks`` no-op messages, starts a worker on it (concurrency 2,
prefetch multiplier 4, late acks, results disabled) and samples, ten times a second, how many
tasks have run and the supervisor's RSS (Celery: its main process). Prints the rate in
each tenth of the drain, and the RSS once the first tenth has run against the largest
seen: a supervisor that holds only its prefetch window keeps both flat.
"""
from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import BROKERS, ROOT, command, drop, fill, kill


def drain(kind: str, url: str, count: int, workdir: Path) -> list[tuple[float, int, int]]:
    """(seconds, tasks run, supervisor RSS) samples from the first task run to the last."""
    queue = f"drain-{uuid.uuid4().hex[:8]}"
    counter = workdir / f"{queue}.count"
    counter.touch()
    started = time.monotonic()
    fill(url, queue, "bench.noop", [], count)
    print(f"  {kind}: {count} messages queued in {time.monotonic() - started:.0f} s",
          file=sys.stderr)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WORKHORSE_", "CELERY_"))}
    env.update(PYTHONPATH=str(ROOT), BENCH_COUNTER=str(counter), BENCH_QUEUE=queue,
               WORKHORSE_BROKER_URL=url, WORKHORSE_RESULT_BACKEND="disabled",
               WORKHORSE_STATE_DIR=str(workdir / "state"), WORKHORSE_PREFETCH_MULTIPLIER="4",
               WORKHORSE_ACKS_LATE="true", BENCH_ACKS_LATE="true", CELERY_BROKER_URL=url)
    log = open(workdir / f"{queue}.log", "wb")
    proc = subprocess.Popen(command(kind, queue, 2), cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    main = psutil.Process(proc.pid)
    samples: list[tuple[float, int, int]] = []
    try:
        deadline = time.monotonic() + 1800
        first = None
        while True:
            done = counter.stat().st_size
            if first is None and done:
                first = time.monotonic()
            if first is not None:
                samples.append((time.monotonic() - first, done, main.memory_info().rss))
            if done >= count:
                return samples
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"{kind} did not finish; see {log.name}")
            time.sleep(0.1 if first is not None else 0.01)
    finally:
        kill(proc)
        log.close()
        drop(url, queue)


def report(kind: str, count: int, samples: list[tuple[float, int, int]]) -> None:
    def time_at(done: int) -> float:
        """When ``done`` tasks had run, interpolated between the samples around it."""
        before = samples[0]
        for sample in samples:
            if sample[1] >= done:
                if sample[1] == before[1]:
                    return sample[0]
                share = (done - before[1]) / (sample[1] - before[1])
                return before[0] + share * (sample[0] - before[0])
            before = sample
        return samples[-1][0]

    marks = [time_at(max(1, count * tenth // 10)) for tenth in range(11)]
    rates = [count / 10 / max(b - a, 1e-9) for a, b in itertools.pairwise(marks)]
    settled = next(s for s in samples if s[1] >= count // 10)[2]
    largest = max(s[2] for s in samples)
    total = samples[-1][0]
    print(f"{kind}: {count} tasks in {total:.1f} s ({count / total:.0f}/s); per tenth: "
          + " ".join(f"{r:.0f}" for r in rates))
    print(f"{kind}: supervisor RSS {settled / 2**20:.1f} MB after the first tenth, "
          f"largest {largest / 2**20:.1f} MB (+{(largest - settled) / 2**20:.1f} MB)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", choices=sorted(BROKERS), default="redis")
    parser.add_argument("--tasks", type=int, default=100_000)
    parser.add_argument("--celery", action="store_true", help="drain with Celery too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        url = BROKERS[args.broker] or f"sqlite:///{workdir / 'broker.sqlite3'}"
        for kind in ["workhorse"] + (["celery"] if args.celery else []):
            report(kind, args.tasks, drain(kind, url, args.tasks, workdir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
