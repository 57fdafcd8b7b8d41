"""`workhorse dead list|requeue|purge` on each broker."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from workhorse.daemon.consumer import DEAD_REASON_HEADER
from workhorse.protocol import DELIVERIES_HEADER

from .conftest import ROOT, wait_until, worker_env


def dead(broker, tmp_path, *args):
    env = worker_env(broker, tmp_path)
    return subprocess.run([sys.executable, "-m", "workhorse", "dead", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_list_requeue_purge(broker, client, start_worker, tmp_path):
    from tests.apps.basic import fail
    worker = start_worker(broker, acks_on_failure=False, concurrency=1)   # in order
    failed = [fail.delay(f"n{i}") for i in range(3)]
    for r in failed:
        r.get(timeout=20, propagate=False)
    wait_until(lambda: broker.queue_size(broker.queue + ".dead") == 3, 20, "three dead letters")
    worker.stop()

    listed = dead(broker, tmp_path, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [r["task_id"] for r in rows] == [r.id for r in failed]
    assert rows[0]["task"] == "tests.apps.basic.fail" and rows[0]["reason"].startswith("failed")
    assert rows[0]["queue"] == broker.queue and rows[0]["dead_queue"] == broker.queue + ".dead"
    again = dead(broker, tmp_path, "list", "--json")          # looking changes nothing
    assert [json.loads(line)["task_id"] for line in again.stdout.splitlines()] == \
        [r.id for r in failed]

    assert dead(broker, tmp_path, "requeue").returncode == 2  # ids or --all, never a guess
    replayed = dead(broker, tmp_path, "requeue", failed[1].id)
    assert replayed.returncode == 0 and "requeued 1" in replayed.stdout
    [(headers, _)] = broker.drain(broker.queue)
    assert headers["id"] == failed[1].id and headers[DELIVERIES_HEADER] == 0
    assert DEAD_REASON_HEADER not in headers
    remaining = dead(broker, tmp_path, "list", "--json")
    assert [json.loads(line)["task_id"] for line in remaining.stdout.splitlines()] == \
        [failed[0].id, failed[2].id]

    purged = dead(broker, tmp_path, "purge", "--all")
    assert purged.returncode == 0 and "purged 2" in purged.stdout
    assert broker.queue_size(broker.queue + ".dead") == 0
    assert os.path.exists(tmp_path)   # keep tmp_path referenced for the fixtures
