"""Tier 4 (chaos): three workers fire one 1-second schedule on one broker while one of
them is SIGKILLed and restarted every few seconds, and one is frozen (SIGSTOP) for 10 s.
Every due second of the span is sent exactly once: counted by nominal time in a queue no
worker consumes, so what is counted is what was sent, not what ran."""
from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

import pytest

from tests.conftest import Worker, broker_fixture, wait_until, worker_env

#: How long the chaos lasts (the issue asks for a minute).
CHAOS_SECONDS = float(os.environ.get("WH_SCHEDULE_CHAOS_SECONDS", "60"))

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(CHAOS_SECONDS + 150)]

broker = broker_fixture("sqlite", "redis", "amqp", "quorum")


def write_config(path: Path, name: str, sink: str) -> None:
    path.write_text(f"""\
[worker]
concurrency = 1

[[schedule]]
name = "{name}"
task = "tests.apps.basic.add"
every = "1s"
args = [1, 2]
queue = "{sink}"
catchup = "all"
misfire_grace = "30s"
""")


def start(tmp_path: Path, broker, index: int, config: Path) -> Worker:
    env = worker_env(broker, tmp_path, hostname=f"fire{index}-{os.getpid()}@test")
    env["WORKHORSE_CONFIG"] = str(config)
    worker = Worker(tmp_path, env, ["-A", "tests.apps.basic"])
    worker.wait_ready()
    return worker


def test_every_due_second_is_sent_exactly_once_while_workers_die_and_freeze(broker, tmp_path):
    sink = broker.queue + ".sink"
    broker.extra_queues.append(sink)
    config = tmp_path / "workhorse.toml"
    # A name of its own: on the shared Redis an earlier run's fence would still be there,
    # and catchup = "all" would rightly send its last 30 s of due times into this run.
    name = f"every-second-{broker.queue}"
    write_config(config, name, sink)
    rng = random.Random(int(os.environ.get("WH_CHAOS_SEED", "0")) or None)
    workers = [start(tmp_path, broker, i, config) for i in range(3)]
    kills = 0
    try:
        began = time.time()
        frozen_at = began + CHAOS_SECONDS / 3
        frozen: Worker | None = None
        while time.time() < began + CHAOS_SECONDS:
            time.sleep(rng.uniform(2.0, 5.0))     # (the chaos' pace, not a wait for a result)
            now = time.time()
            if frozen is None and now >= frozen_at:
                frozen = workers[0]
                frozen.signal(signal.SIGSTOP)
                thaw_at = now + 10
            if frozen is not None and now >= thaw_at and frozen.proc.poll() is None:
                frozen.signal(signal.SIGCONT)
            victim = rng.randrange(1, 3)          # never the frozen one
            workers[victim].kill()
            kills += 1
            workers[victim] = start(tmp_path, broker, victim, config)
        if frozen is not None:
            frozen.signal(signal.SIGCONT)
        ended = time.time()

        def complete() -> bool:
            # Every due second from the first up to now: on RabbitMQ one whose sender was
            # killed between the fence and the confirm comes SENDING_STALE (15 s) late.
            seen = set(_nominals(broker, sink))
            return bool(seen) and all(n in seen for n in range(min(seen), int(ended) - 1))
        wait_until(complete, 45, "every due second up to now sent")
    finally:
        for worker in workers:
            worker.kill()
        if broker.kind == "redis":
            import redis
            redis.Redis.from_url(broker.url).delete(f"workhorse.schedule.{name}")
    sent = _nominals(broker, sink)
    counts = Counter(sent)
    twice = {n: c for n, c in counts.items() if c > 1}
    seconds = sorted(counts)
    first, last = seconds[0], seconds[-1]
    gaps = [n for n in range(first, last + 1) if n not in counts]
    print(f"\n{broker.kind}: {len(seconds)} due seconds {first}..{last}, {len(sent)} sent, "
          f"{len(twice)} twice, {len(gaps)} gaps, {kills} kills, one frozen 10 s")
    assert not twice, f"sent more than once: {twice}"
    assert not gaps, f"never sent: {gaps}"
    assert last - first >= CHAOS_SECONDS - 10


_SEEN: dict[str, list[int]] = {}


def _nominals(broker, sink: str) -> list[int]:
    """The nominal seconds of the messages in the sink (taken out, and remembered)."""
    seen = _SEEN.setdefault(sink, [])
    for headers, _body in broker.drain(sink, limit=100_000):
        nominal = headers.get("workhorse_nominal_time")
        seen.append(int(datetime.fromisoformat(nominal).timestamp()))
    return list(seen)
