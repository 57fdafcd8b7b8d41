"""What a periodic task's due time costs: Redis commands on its fence, counted with MONITOR.

    python benchmarks/schedule_fire_cost.py --workers 3 --seconds 20
    python benchmarks/schedule_fire_cost.py --broker amqp://guest:guest@127.0.0.1:5672//

Starts ``--workers`` workers with one 1-second schedule (sent to a queue nobody consumes),
watches the Redis they use for the fence (the broker on Redis; the result store,
``--results``, on RabbitMQ) with MONITOR, and prints the commands on the schedule's keys per
due time, by command, beside the due times sent. Needs a Redis on 127.0.0.1:6379.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--broker", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--results", default="redis://127.0.0.1:6379/1")
    args = parser.parse_args()
    name = f"cost-{uuid.uuid4().hex[:6]}"
    sink = f"{name}.sink"
    monitored = args.broker if args.broker.startswith("redis") else args.results
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "workhorse.toml"
        config.write_text(f'[worker]\nconcurrency = 1\n[[schedule]]\nname = "{name}"\n'
                          f'task = "tests.apps.basic.add"\nevery = "1s"\nargs = [1, 2]\n'
                          f'queue = "{sink}"\n')
        env = {**os.environ, "PYTHONPATH": str(ROOT), "WORKHORSE_BROKER_URL": args.broker,
               "WORKHORSE_RESULT_BACKEND": args.results, "WORKHORSE_CONFIG": str(config),
               "WORKHORSE_QUEUES": name, "WORKHORSE_STATE_DIR": f"{tmp}/state"}
        counts: Counter[str] = Counter()
        stop = threading.Event()
        watcher = threading.Thread(target=watch, args=(monitored, name, counts, stop),
                                   daemon=True)
        watcher.start()
        workers = [subprocess.Popen(
            [sys.executable, "-m", "workhorse", "worker", "-A", "tests.apps.basic",
             "-n", f"cost{i}@bench"], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT, start_new_session=True) for i in range(args.workers)]
        try:
            time.sleep(5)                   # (every worker up and sending)
            counts.clear()
            began = time.time()
            time.sleep(args.seconds)
            seconds = time.time() - began
            snapshot = Counter(counts)
        finally:
            for worker in workers:
                os.killpg(worker.pid, signal.SIGKILL)
            stop.set()
        due = round(seconds)
        print(f"{args.workers} workers, broker {args.broker.split(':')[0]}, fence in "
              f"{'the broker' if monitored == args.broker else 'the result store'}: "
              f"{due} due times in {seconds:.1f} s")
        for command, count in sorted(snapshot.items()):
            print(f"  {command:10s} {count:6d}  {count / due:5.2f} a due time, "
                  f"{count / due / args.workers:5.2f} a worker")


def watch(url: str, name: str, counts: Counter[str], stop: threading.Event) -> None:
    client = redis.Redis.from_url(url)
    with client.monitor() as monitor:
        for event in monitor.listen():
            if stop.is_set():
                return
            command = event.get("command", "")
            if f"workhorse.schedule.{name}" in command:
                counts[command.split(" ", 1)[0].strip('"').upper()] += 1


if __name__ == "__main__":
    main()
