"""Chaos under steady load: kill children, SIGKILL supervisors, restart the broker; then
count, per task id, how often it started and how often it finished.

    python -m tests.chaos.harness --broker redis --seconds 60 --rate 40

Two workers (two children each) share one queue; a producer sends ``chaos_work`` tasks
(0-200 ms each) at a steady rate while a fixed, seeded schedule of events runs. Every
task logs its start and its end with its pid and the time. Afterwards:

- lost: a task with no stored SUCCESS (it must be none);
- twice done: a task that ran to its end more than once, although every end but the last
  was in a process nobody killed within a second after it. (A child killed between its
  task's end and storing its result runs it again, rightly: "rerun after a kill"; and a task
  the producer sent again after a failed send may be there twice, as two messages of one
  id, which rightly run twice: "sent twice".) Only a broker restart may cause it, on
  RabbitMQ, which hands a lost connection's running tasks to another worker;
- unexplained: a start that did not end, in a process nobody killed (must be none);
- redelivery delay: after each supervisor kill, how long until the tasks its children
  were running started again elsewhere (bounded by visibility_timeout + a few seconds).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import psutil
from kombu import Producer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.conftest import BrokerEnv, RedisServer, Worker, worker_env  # noqa: E402
from tests.rabbitmq_cluster import Cluster  # noqa: E402

#: The kinds of event, as the schedule names them.
CHILD, SUPERVISOR, BROKER = "kill a child", "SIGKILL a supervisor", "restart the broker"


@dataclass
class Report:
    broker: str
    sent: int = 0
    starts: int = 0
    ends: int = 0
    lost: list[str] = field(default_factory=list)
    twice_done: list[str] = field(default_factory=list)
    rerun_after_kill: list[str] = field(default_factory=list)
    #: Ran twice, but the producer sent it twice: its first send failed (a broker restart
    #: between the broker taking the message and its reply), and it sent it again.
    sent_twice: list[str] = field(default_factory=list)
    unexplained: list[str] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)
    redelivery_delays: list[float] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        kinds = defaultdict(int)
        for _, kind in self.events:
            kinds[kind] += 1
        worst = max(self.redelivery_delays, default=0.0)
        return (f"{self.broker:7} sent {self.sent:5}  starts {self.starts:5}  ends {self.ends:5}  "
                f"lost {len(self.lost)}  twice done {len(self.twice_done)} (rerun after a kill "
                f"{len(self.rerun_after_kill)}, sent twice {len(self.sent_twice)})  unexplained "
                f"{len(self.unexplained)}  | child kills {kinds[CHILD]}, supervisor kills "
                f"{kinds[SUPERVISOR]}, broker restarts {kinds[BROKER]} | max redelivery "
                f"after a supervisor kill {worst:.1f} s | {self.seconds:.0f} s")


class Chaos:
    def __init__(self, kind: str, workdir: Path, *, seconds: float, rate: float,
                 visibility_timeout: float, seed: int) -> None:
        self.kind = kind
        self.workdir = workdir
        self.seconds = seconds
        self.rate = rate
        self.vt = visibility_timeout
        self.random = random.Random(seed)
        self.log = workdir / "chaos.log"
        self.log.touch()
        self.redis: RedisServer | None = None
        self.rabbitmq: Cluster | None = None
        queue = f"chaos-{uuid.uuid4().hex[:8]}"
        if kind == "sqlite":
            url = f"sqlite:///{workdir / 'broker.sqlite3'}"
        elif kind == "redis":
            self.redis = RedisServer(workdir / "redis-data")
            url = self.redis.url()
        else:
            # A RabbitMQ node of the run's own, which it may restart (never the shared one)
            self.rabbitmq = Cluster(workdir / "rabbitmq", size=1).up()
            url = self.rabbitmq.nodes[0].url
        self.broker = BrokerEnv(kind, url, queue)
        self.workers: list[Worker] = []
        self.killed: dict[int, float] = {}          # child pid -> when it was killed
        self.resent: set[str] = set()             # task ids whose first send failed
        self.supervisor_kills: list[tuple[float, set[int]]] = []
        self.report = Report(kind)

    def trail(self, task_ids: list[str], tail: int = 15) -> str:
        """For a failed run: every worker log line naming these tasks, and each log's end
        (pytest keeps few temporary directories; the CI log keeps this)."""
        out = []
        for worker in self.workers:
            lines = worker.log().splitlines()
            out.append(f"--- worker {worker.pid} ({worker.log_path.name}), "
                       f"exit {worker.proc.poll()}")
            out.extend(line for line in lines if any(t in line for t in task_ids))
            out.append(f"  ... last {tail} lines:")
            out.extend(lines[-tail:])
        return "\n".join(out)

    # -- processes
    def start_worker(self) -> Worker:
        env = worker_env(self.broker, self.workdir, visibility_timeout=self.vt, concurrency=2)
        env["WH_CHAOS_LOG"] = str(self.log)
        worker = Worker(self.workdir, env, ["-A", "tests.apps.basic"])
        self.workers.append(worker)
        worker.wait_ready(60)
        return worker

    def _children(self, worker: Worker) -> list[psutil.Process]:
        try:
            return psutil.Process(worker.pid).children()
        except psutil.Error:
            return []

    def kill_child(self) -> str:
        alive = [w for w in self.workers if w.proc.poll() is None]
        busy = [c for w in alive for c in self._children(w) if _running_a_task(c)]
        if not busy:
            return "no child was running a task"
        child = self.random.choice(busy)
        # The time is taken once the signal is sent, not before: a task that ended in
        # between (its end logged, its Done not yet read) is a run the kill interrupted,
        # and it ended before this time. Taken before, such an end came after the
        # recorded kill and was counted as a task done twice (seen once in CI on Redis).
        child.send_signal(signal.SIGKILL)
        self.killed[child.pid] = time.time()
        return f"child {child.pid}"

    def kill_supervisor(self) -> str:
        alive = [w for w in self.workers if w.proc.poll() is None]
        worker = self.random.choice(alive)
        children = {c.pid for c in self._children(worker)}
        now = time.time()
        for pid in children:
            self.killed[pid] = now
        self.supervisor_kills.append((now, children))
        worker.kill()
        self.start_worker()
        return f"supervisor {worker.pid}; a fresh one started"

    def restart_broker(self) -> str:
        if self.redis is not None:
            self.redis.kill()
            self.redis.start()
            return "redis-server killed and started again"
        if self.rabbitmq is not None:
            node = self.rabbitmq.nodes[0]
            self.rabbitmq.ctl(node, "stop_app")
            self.rabbitmq.ctl(node, "start_app")
            return f"rabbitmqctl -n {node.name} stop_app, start_app (the run's own node)"
        return "SQLite has no server to restart"

    # -- load
    def produce(self, app: object, stop: threading.Event, sent: list) -> None:
        from tests.apps.basic import chaos_work
        interval = 1.0 / self.rate
        with self._counting_failed_sends():
            while not stop.is_set():
                task_id = str(uuid.uuid4())
                duration = round(self.random.uniform(0, 0.2), 3)
                while True:    # the producer is not under test: resend until the broker has it
                    try:
                        chaos_work.apply_async((duration,), task_id=task_id)
                        break
                    except Exception:  # noqa: BLE001 - whatever the outage raises, send again
                        self.resent.add(task_id)
                        if stop.wait(0.2):
                            return
                sent.append(task_id)
                stop.wait(interval)

    @contextlib.contextmanager
    def _counting_failed_sends(self) -> Iterator[None]:
        """Every send that failed, seen where kombu's publish retry (``apply_async`` sends
        with ``retry=True``) tries again without telling the caller. The broker may have
        taken the first one, its reply lost to the restart (Redis logs an LPUSH to its
        append-only file before replying): then the task is there twice, as two messages
        of one id with two delivery tags, and rightly runs twice (seen once in CI on Redis:
        two copies taken together just after a restart)."""
        real = Producer._publish
        resent = self.resent

        def publish(producer: Producer, body: Any, priority: Any, content_type: Any,
                    content_encoding: Any, headers: Any, *rest: Any, **kwargs: Any) -> Any:
            try:
                return real(producer, body, priority, content_type, content_encoding,
                            headers, *rest, **kwargs)
            except Exception:
                resent.add((headers or {}).get("id"))
                raise

        with mock.patch.object(Producer, "_publish", publish):
            yield

    def run(self, schedule: list[str]) -> Report:
        saved_environ = dict(os.environ)
        os.environ.update({k: v for k, v in worker_env(self.broker, self.workdir).items()
                           if k.startswith(("WORKHORSE_", "WH_TEST_"))})
        from tests.apps import basic
        basic.app.configure()
        started = time.monotonic()
        try:
            for _ in range(2):
                self.start_worker()
            stop, sent = threading.Event(), []
            producer = threading.Thread(target=self.produce, args=(basic.app, stop, sent))
            producer.start()
            gap = self.seconds / (len(schedule) + 1)
            for kind in schedule:
                time.sleep(gap)
                action = {CHILD: self.kill_child, SUPERVISOR: self.kill_supervisor,
                          BROKER: self.restart_broker}[kind]
                detail = action()
                self.report.events.append((time.time(), kind))
                print(f"  {self.kind}: {kind}: {detail}", flush=True)
            time.sleep(gap)
            stop.set()
            producer.join(60)
            self._wait_for(basic.app, sent)
            self.report.sent = len(sent)
            self._analyse(basic.app, sent)
        finally:
            for worker in self.workers:
                worker.kill()
            basic.app.close()
            self.broker.cleanup()
            if self.redis is not None:
                self.redis.kill()
            if self.rabbitmq is not None:
                self.rabbitmq.down()
            os.environ.clear()
            os.environ.update(saved_environ)
            basic.app.configure()
        self.report.seconds = time.monotonic() - started
        return self.report

    def _wait_for(self, app: object, sent: list[str]) -> None:
        """Until every task has a stored SUCCESS, or nothing has finished for a while."""
        pending = set(sent)
        last_progress = time.monotonic()
        quiet_limit = self.vt + 30
        while pending and time.monotonic() - last_progress < quiet_limit:
            done = {t for t in pending if app.AsyncResult(t).state == "SUCCESS"}  # type: ignore[attr-defined]
            if done:
                pending -= done
                last_progress = time.monotonic()
            time.sleep(0.2)

    def _analyse(self, app: object, sent: list[str]) -> None:
        starts: dict[str, list[tuple[int, float]]] = defaultdict(list)
        ends: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for line in self.log.read_text().splitlines():
            what, task_id, pid, at = line.split()
            (starts if what == "start" else ends)[task_id].append((int(pid), float(at)))
        report = self.report
        report.starts = sum(len(v) for v in starts.values())
        report.ends = sum(len(v) for v in ends.values())
        for task_id in sent:
            if app.AsyncResult(task_id).state != "SUCCESS":  # type: ignore[attr-defined]
                report.lost.append(task_id)
            if len(ends[task_id]) > 1:
                earlier = sorted(ends[task_id], key=lambda end: end[1])[:-1]
                if all(0 <= self.killed.get(pid, -1e9) - at < 1.0 for pid, at in earlier):
                    report.rerun_after_kill.append(task_id)
                elif task_id in self.resent:
                    report.sent_twice.append(task_id)
                else:
                    report.twice_done.append(task_id)
            ended_in = {pid for pid, _ in ends[task_id]}
            for pid, _ in starts[task_id]:
                if pid not in ended_in and pid not in self.killed:
                    report.unexplained.append(task_id)
        for killed_at, children in self.supervisor_kills:
            for task_id, runs in starts.items():
                interrupted = [at for pid, at in runs if pid in children and at < killed_at
                               and pid not in {p for p, _ in ends[task_id]}]
                later = [at for _, at in runs if at > killed_at]
                if interrupted and later:
                    report.redelivery_delays.append(min(later) - killed_at)


def _running_a_task(process: psutil.Process) -> bool:
    try:
        return "running" in " ".join(process.cmdline())
    except psutil.Error:
        return False


def default_schedule(kind: str) -> list[str]:
    """Every kind of event, twice or more; broker restarts where there is a server."""
    schedule = [CHILD, SUPERVISOR, CHILD, BROKER, CHILD, SUPERVISOR, CHILD, BROKER, CHILD]
    return [e for e in schedule if e != BROKER or kind != "sqlite"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", choices=["sqlite", "redis", "amqp"], action="append")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=40.0, help="tasks sent per second")
    parser.add_argument("--visibility-timeout", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    failed = False
    for kind in args.broker or ["sqlite", "redis", "amqp"]:
        with tempfile.TemporaryDirectory() as tmp:
            report = Chaos(kind, Path(tmp), seconds=args.seconds, rate=args.rate,
                           visibility_timeout=args.visibility_timeout,
                           seed=args.seed).run(default_schedule(kind))
        print(report.summary(), flush=True)
        failed |= bool(report.lost or report.unexplained)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
