"""How big the SQLite broker and result files, and their write-ahead logs, grow while
messages come and go: one workhorse worker runs --tasks no-op tasks (results stored unless
--no-results), published in chunks while it runs so that at most --backlog wait at once.

    python benchmarks/file_sizes.py                     # 100,000 tasks, backlog 2,000
    python benchmarks/file_sizes.py --tasks 20000 --backlog 20000

Printed: the run's rate; each file's size, pages and free pages (a file's free pages are
reused before it grows, so the broker file follows the largest backlog, not the number of
tasks); its write-ahead log's largest size seen (sampled every 50 ms) and its size once
the worker has been idle for --idle seconds.
"""
from __future__ import annotations

import argparse
import os
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.throughput import command, fill, kill  # noqa: E402
from workhorse import sqlitedb  # noqa: E402


class Peaks:
    """The largest size each write-ahead log reached, looked at every 50 ms."""

    def __init__(self, files: list[Path]) -> None:
        self.files = files
        self.peak = dict.fromkeys(files, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            for path in self.files:
                self.peak[path] = max(self.peak[path], sqlitedb.wal_size(path))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def pages(path: Path) -> tuple[int, int]:
    """(pages, free pages) of a SQLite file, read-only."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return (conn.execute("PRAGMA page_count").fetchone()[0],
                conn.execute("PRAGMA freelist_count").fetchone()[0])
    finally:
        conn.close()


def run(tasks: int, backlog: int, results: bool, concurrency: int, idle: float,
        workdir: Path) -> None:
    broker, stored = workdir / "broker.sqlite3", workdir / "results.sqlite3"
    url = f"sqlite:///{broker}"
    queue = f"sizes-{uuid.uuid4().hex[:8]}"
    counter = workdir / f"{queue}.count"
    counter.touch()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKHORSE_")}
    env.update(PYTHONPATH=str(ROOT), BENCH_COUNTER=str(counter), BENCH_QUEUE=queue,
               WORKHORSE_BROKER_URL=url, WORKHORSE_STATE_DIR=str(workdir / "state"),
               WORKHORSE_RESULT_BACKEND=f"sqlite:///{stored}" if results else "disabled",
               WORKHORSE_PREFETCH_MULTIPLIER="4")
    fill(url, queue, "bench.noop", [], 1, results=results)     # the files exist
    peaks = Peaks([broker, stored] if results else [broker])
    with open(workdir / "worker.log", "wb") as log:
        worker = subprocess.Popen(command("workhorse", queue, concurrency), cwd=ROOT, env=env,
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    started = time.monotonic()
    sent = 1
    try:
        while (done := counter.stat().st_size) < tasks:
            if worker.poll() is not None:
                tail = (workdir / "worker.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the worker exited ({worker.returncode}):\n{tail}")
            if sent < tasks and sent - done < backlog // 2:
                chunk = min(tasks - sent, backlog - (sent - done))
                fill(url, queue, "bench.noop", [], chunk, results=results)
                sent += chunk
            else:
                time.sleep(0.01)
        seconds = time.monotonic() - started
        time.sleep(idle)
        at_rest = {path: sqlitedb.wal_size(path) for path in peaks.files}
    finally:
        kill(worker)
        peaks.stop()
    print(f"{tasks} no-op tasks, results {'stored' if results else 'disabled'}, at most "
          f"{backlog} waiting: {tasks / seconds:.0f} tasks/s")
    for path in peaks.files:
        total, free = pages(path)
        print(f"  {path.name}: {path.stat().st_size / 1e6:.2f} MB ({total} pages, {free} free); "
              f"write-ahead log at most {peaks.peak[path] / 1e6:.2f} MB, "
              f"{at_rest[path] / 1e6:.2f} MB after {idle:g} s idle")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=100_000)
    parser.add_argument("--backlog", type=int, default=2_000,
                        help="at most this many messages waiting at once")
    parser.add_argument("--no-results", dest="results", action="store_false")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--idle", type=float, default=2.0,
                        help="seconds the worker idles before the logs' sizes at rest")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="workhorse-sizes-") as workdir:
        run(args.tasks, args.backlog, args.results, args.concurrency, args.idle,
            Path(workdir))


if __name__ == "__main__":
    main()
