"""A child that cannot start is not respawned for ever: after max_boot_failures in a row the
worker requeues what it holds and exits with status 4 (ExitCode.CHILD_BOOT), saying why.
Real daemon, SQLite."""
from __future__ import annotations

import pytest

from workhorse.daemon.exitcodes import ExitCode

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.parametrize("broker", ["sqlite"], indirect=True)]


@pytest.mark.parametrize("concurrency", [1, 2])
def test_children_that_cannot_start_stop_the_worker_with_exit_4_and_lose_nothing(
        broker, client, start_worker, concurrency):
    from tests.apps.basic import add
    sent = add.delay(1, 2)
    worker = start_worker(broker, app="tests.apps.unbootable", ready=False,
                          concurrency=concurrency)
    assert worker.wait_exit(30) == ExitCode.CHILD_BOOT
    log = worker.log()
    assert ("children die before they are ready (5 in a row; last: exited with status 1); "
            "see the log above for their error; stopping with exit status 4") in log
    assert "unbootable: cannot connect to the database in this child" in log
    assert "supervisor failed" not in log
    assert broker.queue_size() == 1          # requeued, and not dead-lettered
    assert broker.queue_size(broker.queue + ".dead") == 0
    start_worker(broker, concurrency=1)      # the children can start now
    assert sent.get(timeout=30) == 3
