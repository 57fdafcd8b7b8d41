"""A step load on an autoscaling worker: an empty queue, then tasks arriving at a fixed
rate above what one child can run, then nothing.

    python benchmarks/step_load.py                      # Redis, 20,000 tasks of 10 ms
    python benchmarks/step_load.py --broker sqlite --count 5000 --plot docs/x.png

The worker starts with one child (``autoscale = 1,MAX``, ``autoscale_target_age`` 1 s,
``autoscale_idle`` 10 s). A producer sends ``--count`` tasks that sleep 10 ms at ``--rate``
a second, through workhorse's client (which stamps the send time). ``/scale`` is read every
0.25 s: the oldest ready message's age, the ready count, the pool's size and its busy
children; ``/metrics`` gives the tasks done. Printed: how long the pool took to grow, the
oldest message's age once it had grown (median, 95th percentile, most), the throughput
under load, and how long the pool took to shrink back to one child once the load stopped.
``--plot`` draws the three over time into a PNG (needs matplotlib: ``pip install -e
'.[bench]'``).
"""
from __future__ import annotations

import argparse
import json
import os
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kombu import Producer  # noqa: E402

from workhorse.app import App  # noqa: E402
from workhorse.broker.queues import ensure_queue  # noqa: E402
from workhorse.protocol import build_message  # noqa: E402

BROKERS = {"sqlite": None, "redis": "redis://127.0.0.1:6379/3",
           "amqp": "amqp://guest:guest@127.0.0.1:5672//"}


@dataclass
class Sample:
    t: float                 # seconds since the load started
    ready: int | None
    oldest_age: float | None
    pool: int
    busy: int
    done: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as answer:
        return answer.read()


def tasks_done(port: int) -> int:
    total = 0.0
    for line in get(f"http://127.0.0.1:{port}/metrics").decode().splitlines():
        if line.startswith("workhorse_tasks_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def sample(port: int, started: float) -> Sample:
    found = json.loads(get(f"http://127.0.0.1:{port}/scale"))
    return Sample(time.monotonic() - started, found["ready"], found["oldest_age"],
                  found["slots"]["total"], found["slots"]["busy"], tasks_done(port))


def produce(app: App, queue: str, count: int, rate: float, seconds: float) -> float:
    """``count`` tasks at ``rate`` a second; returns when the last was sent."""
    with app.connection() as connection:
        ensure_queue(connection, queue, "classic")
        producer = Producer(connection)
        start = time.monotonic()
        for n in range(count):
            delay = start + n / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            message = build_message("bench.sleep", str(uuid.uuid4()), [seconds], {},
                                    ignore_result=True)
            producer.publish(message.body, exchange="", routing_key=queue,
                             serializer="json", headers=message.headers, delivery_mode=2,
                             correlation_id=message.properties["correlation_id"])
        return time.monotonic() - start


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--broker", choices=sorted(BROKERS), default="redis")
    parser.add_argument("--count", type=int, default=20_000)
    parser.add_argument("--rate", type=float, default=300.0, help="tasks sent a second")
    parser.add_argument("--seconds", type=float, default=0.01, help="each task's sleep")
    parser.add_argument("--max", type=int, default=8, help="the pool's most children")
    parser.add_argument("--target-age", type=float, default=1.0)
    parser.add_argument("--idle", type=float, default=10.0)
    parser.add_argument("--plot", type=Path, help="a PNG of age, pool and throughput")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="step-load-"))
    url = BROKERS[args.broker] or f"sqlite:///{workdir / 'broker.sqlite3'}"
    if args.broker == "redis":
        import redis
        redis.Redis.from_url(url).flushdb()
    queue = f"step-{uuid.uuid4().hex[:8]}"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKHORSE_")}
    env.update(PYTHONPATH=str(ROOT), WORKHORSE_BROKER_URL=url,
               WORKHORSE_RESULT_BACKEND="disabled", WORKHORSE_STATE_DIR=str(workdir / "state"),
               WORKHORSE_REMOTE_CONTROL="false", WORKHORSE_HEARTBEAT_EVENTS="false")
    log = open(workdir / "worker.log", "wb")
    worker = subprocess.Popen(
        [sys.executable, "-m", "workhorse", "worker", "-A", "benchmarks.bench_tasks:app",
         "-Q", queue, "-c", "1", "--autoscale", f"1,{args.max}", "--metrics-port", str(port),
         "--autoscale-target-age", str(args.target_age), "--autoscale-idle", str(args.idle)],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    samples: list[Sample] = []
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if json.loads(get(f"http://127.0.0.1:{port}/scale"))["backlog_known"]:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or worker.poll() is not None:
                raise SystemExit(f"the worker did not start: see {workdir / 'worker.log'}")
            time.sleep(0.1)
        app = App("step-load", broker_url=url, result_backend="disabled")
        started = time.monotonic()
        stop = threading.Event()
        sent_for: list[float] = []

        def load() -> None:
            sent_for.append(produce(app, queue, args.count, args.rate, args.seconds))
        producer = threading.Thread(target=load)
        producer.start()
        while True:
            samples.append(sample(port, started))
            last = samples[-1]
            if (not producer.is_alive() and last.done >= args.count and last.pool == 1) or (
                    last.t > args.count / args.rate + 300):
                break
            stop.wait(0.25)
        producer.join()
    finally:
        worker.terminate()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
        log.close()
    report(args, samples, sent_for[0] if sent_for else float("nan"))
    if args.plot:
        plot(args, samples, args.plot)
    return 0


def report(args: argparse.Namespace, samples: list[Sample], sending: float) -> None:
    top = max(s.pool for s in samples)
    grown = next(s.t for s in samples if s.pool == top)
    under_load = [s for s in samples if grown <= s.t <= sending]
    ages = [s.oldest_age for s in under_load if s.oldest_age is not None]
    drained = next((s.t for s in samples if s.t > sending and s.done >= args.count), None)
    back = next((s.t for s in samples if drained is not None and s.t > drained
                 and s.pool == 1), None)
    during = [s for s in samples if s.t <= sending]
    rate = ((during[-1].done - during[0].done) / (during[-1].t - during[0].t)
            if len(during) > 1 else float("nan"))
    print(f"step load on {args.broker}: {args.count} tasks of {args.seconds * 1000:.0f} ms "
          f"at {args.rate:.0f}/s for {sending:.1f} s; autoscale 1,{args.max}, target age "
          f"{args.target_age:g} s, idle {args.idle:g} s")
    print(f"  pool grew to {top} children in {grown:.1f} s")
    if ages:
        print(f"  oldest ready message's age once grown: median {statistics.median(ages):.3f} "
              f"s, p95 {percentile(ages, 0.95):.3f} s, most {max(ages):.3f} s "
              f"({len(ages)} samples)")
    over = [s.t for s in samples if s.t <= sending and (s.oldest_age or 0) > args.target_age]
    if over:
        steady = [s for s in samples if over[-1] < s.t <= sending]
        print(f"  the oldest ready message past the target age until {over[-1]:.1f} s; "
              f"from then to the end of the load ({len(steady)} samples) at most "
              f"{max((s.oldest_age or 0 for s in steady), default=0):.3f} s, the pool "
              f"{min((s.pool for s in steady), default=0)}-"
              f"{max((s.pool for s in steady), default=0)} children")
    print(f"  tasks done a second under load: {rate:.0f}")
    if back is not None and drained is not None:
        print(f"  all done {drained - sending:.1f} s after the last send; back to 1 child "
              f"{back - drained:.1f} s after that")


def plot(args: argparse.Namespace, samples: list[Sample], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t = [s.t for s in samples]
    fig, (age, pool, rate) = plt.subplots(3, 1, sharex=True, figsize=(8, 7))
    age.plot(t, [s.oldest_age or 0 for s in samples], color="tab:red")
    age.axhline(args.target_age, linestyle="--", color="grey", label="target age")
    age.set_ylabel("oldest ready (s)")
    age.legend(loc="upper right")
    pool.step(t, [s.pool for s in samples], where="post", label="children")
    pool.step(t, [s.busy for s in samples], where="post", label="busy", alpha=0.6)
    pool.set_ylabel("pool")
    pool.legend(loc="upper right")
    rates = [0.0] + [(b.done - a.done) / (b.t - a.t) if b.t > a.t else 0.0
                     for a, b in zip(samples, samples[1:], strict=False)]
    rate.plot(t, rates, color="tab:green")
    rate.axhline(args.rate, linestyle="--", color="grey", label="arrival rate")
    rate.set_ylabel("tasks/s")
    rate.set_xlabel("seconds since the load started")
    rate.legend(loc="upper right")
    fig.suptitle(f"step load on {args.broker}: {args.count} tasks of "
                 f"{args.seconds * 1000:.0f} ms at {args.rate:.0f}/s, autoscale 1,{args.max}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"  plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
