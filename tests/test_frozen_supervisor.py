"""A supervisor frozen (SIGSTOP, as a paused VM or a stopped process is) long enough for its
broker to give what it held to another worker consuming the same queue: past the
visibility timeout on SQLite and Redis (its leases run out), past the heartbeat timeout
on RabbitMQ (the broker closes its connection). Woken again (SIGCONT), the frozen one
must not start what it had buffered but not started: on SQLite and Redis its leases are
old, so it renews them before it starts anything, and drops those found lost; on
RabbitMQ it has the broker thread read what its connection holds before it starts
anything, and finds it gone. Only what was running at the freeze may run twice (its
child finished it meanwhile), as with a supervisor killed outright. Real daemons, real
signals."""
from __future__ import annotations

import os
import signal
import time

import pytest

from .conftest import BrokerEnv, broker_fixture, runs, wait_until
from .test_delivery import holds

broker = broker_fixture("sqlite", "redis", "amqp")


@pytest.mark.timeout(300)
def test_what_a_frozen_supervisor_held_but_had_not_started_runs_once(
        broker: BrokerEnv, client, start_worker, tmp_path):
    from tests.apps.basic import record
    vt = 2.0
    # (RabbitMQ: a heartbeat timeout of 5 s, where 30 by default made this test wait
    # some 90 s for the broker to give up on the frozen worker)
    frozen = start_worker(broker, visibility_timeout=vt, concurrency=1, prefetch_multiplier=4,
                          broker_heartbeat=5)
    results = [record.delay(0.5) for _ in range(8)]
    wait_until(lambda: len(runs(tmp_path)) >= 1, 20, "the first task to start")
    wait_until(lambda: broker.queue_size() <= 4, 20, "four held by the first worker")
    os.kill(frozen.proc.pid, signal.SIGSTOP)
    try:
        # What its child took before the freeze is started by now (nothing more can
        # reach it): those may run twice, nothing else.
        time.sleep(0.5)
        started_before = {task_id for _, task_id, _ in runs(tmp_path)}
        start_worker(broker, visibility_timeout=vt, concurrency=2)
        # Its leases run out (RabbitMQ: its connection is closed, after its heartbeat
        # timeout of silence and more), and the other worker runs all it can take.
        wait_until(lambda: broker.queue_size() == 0 and len(
            {task_id for _, task_id, _ in runs(tmp_path)}) == len(results), 150,
            "the other worker to run what the frozen one held")
        time.sleep(vt)      # (every lease of the frozen one is past its timeout)
    finally:
        os.kill(frozen.proc.pid, signal.SIGCONT)
    for result in results:
        assert result.get(timeout=60) == result.id
    frozen.wait_for_log(r"lease lost before it started" if broker.kind != "amqp"
                        else r"broker connection lost", 20)

    def only_the_running_ran_twice() -> bool:
        counts = {r.id: sum(1 for _, task_id, _ in runs(tmp_path) if task_id == r.id)
                  for r in results}
        return all(n >= 1 for n in counts.values()) and all(
            n == 1 for task_id, n in counts.items() if task_id not in started_before)
    # Whatever it would start, it starts within a second of waking, with a child idle.
    holds(only_the_running_ran_twice, 2, "what the frozen worker held ran once")
    assert frozen.proc.poll() is None, "the frozen worker goes on"
