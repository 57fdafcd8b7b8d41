"""What a supervisor's death costs the messages it held, on every broker, with the real
daemon restarted each time it dies (as systemd does): only a message that may have
started is charged a delivery; its neighbours in the window, only held, are not
(docs/delivery.md "delivery count"). A message that kills its supervisor before it starts is
stopped by the backstop (``max_held_losses``), not looped for ever."""
from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable

import pytest

from workhorse.broker.consumer import DEAD_REASON_HEADER, DEAD_TASK_HEADER
from workhorse.exceptions import TooManyDeliveries

from .conftest import BROKERS, broker_fixture, BrokerEnv, Worker, runs, wait_until
from .test_delivery import failure, starts

pytestmark = pytest.mark.timeout(300)

#: Also on RabbitMQ's quorum queues.
broker = broker_fixture(*BROKERS, "quorum")


class Restarting:
    """Workers on one broker, a new one started whenever the last has died (``settings``:
    theirs, and ``app``)."""

    def __init__(self, start: Callable[..., Worker], broker: BrokerEnv, **settings: object):
        self.start, self.broker, self.settings = start, broker, settings
        self.workers = [self._new()]

    def _new(self) -> Worker:
        # Not waiting for "ready": a worker may die before it says so.
        return self.start(self.broker, ready=False, remote_control=False, **self.settings)

    @property
    def deaths(self) -> int:
        return sum(1 for worker in self.workers if worker.proc.poll() is not None)

    def replace_dead(self) -> None:
        if self.workers[-1].proc.poll() is not None:
            self.workers.append(self._new())

    def kill(self) -> None:
        """SIGKILL the supervisor alone, as the OOM killer does (its children follow it)."""
        worker = self.workers[-1]
        os.kill(worker.pid, signal.SIGKILL)
        worker.proc.wait(10)


def _succeeded(results) -> bool:  # type: ignore[no-untyped-def]
    return all(r.state == "SUCCESS" for r in results)


def _dead_letters(broker: BrokerEnv, collected: list) -> list:
    collected.extend(broker.drain(broker.queue + ".dead"))
    return collected


def test_a_task_that_kills_its_supervisor_costs_its_neighbours_nothing(
        broker, client, start_worker, tmp_path):
    """The poison starts three times (max_deliveries) and is dead-lettered; the ten plain
    tasks behind it, held in its window at each death (one of them ran beside it the first
    time), all complete, none dead-lettered."""
    from tests.apps.basic import kill_supervisor, record
    poison = kill_supervisor.delay()
    plain = [record.delay(0.05) for _ in range(10)]
    workers = Restarting(start_worker, broker, max_deliveries=3)
    dead: list = []

    def settled() -> bool:
        workers.replace_dead()
        assert workers.deaths <= 4, f"{workers.deaths} deaths: the poison was not stopped"
        return bool(_dead_letters(broker, dead)) and _succeeded(plain)
    wait_until(settled, 180, "the poison to be dead-lettered and the others to succeed")

    assert starts(tmp_path, poison.id) == 3 and workers.deaths == 3
    assert [headers[DEAD_TASK_HEADER] for headers, _ in dead] == [poison.id]
    assert headers_reason(dead[0][0]).startswith("too_many_deliveries: delivery 4 of")
    assert type(failure(poison)).__name__ == TooManyDeliveries.__name__
    for result in plain:        # each completed once; one may have run beside the poison
        assert result.get(timeout=5) == result.id
        assert 1 <= starts(tmp_path, result.id) <= 2
    assert sum(starts(tmp_path, r.id) for r in plain) <= len(plain) + 1
    assert broker.queue_size(broker.queue + ".dead") == 0


def headers_reason(headers: dict) -> str:
    return str(headers[DEAD_REASON_HEADER])


def test_ten_supervisor_kills_in_a_row_while_tasks_flow_dead_letter_nothing(
        broker, client, start_worker, tmp_path):
    """Each kill, at a random moment once the worker has run a few tasks, finds a window of
    buffered messages and two running: the held ones may be held at all ten kills, the
    running ones are charged once (and run alone, first, next time). Nothing reaches
    either bound; every task completes, none is run again once it succeeded."""
    from tests.apps.basic import record
    results = [record.delay(0.02) for _ in range(200)]
    workers = Restarting(start_worker, broker)
    jitter = random.Random(25)
    for kill in range(10):
        before = len(runs(tmp_path))
        wait_until(lambda before=before: len(runs(tmp_path)) >= before + 6
                   or _succeeded(results), 60, f"tasks to run before kill {kill + 1}")
        time.sleep(jitter.uniform(0, 0.03))     # not always just after a start
        if _succeeded(results):
            pytest.fail(f"all tasks ran before kill {kill + 1}: the test needs more of them")
        workers.kill()
        workers.replace_dead()
    wait_until(lambda: _succeeded(results), 120, "every task to succeed")
    assert workers.deaths == 10
    assert _dead_letters(broker, []) == []
    started = {r.id: starts(tmp_path, r.id) for r in results}
    assert all(1 <= n <= 3 for n in started.values()), started
    # Runs again only what was running at a kill: at most two a kill.
    assert sum(started.values()) <= len(results) + 2 * 10


def test_a_message_that_kills_its_supervisor_while_it_is_read_is_stopped_by_the_backstop(
        broker, client, start_worker, tmp_path):
    """It never starts: each worker dies reading it (before any child has it). Its
    neighbours in the window, held at every one of those deaths, are counted once (at the
    first, before the poison was known to have been held); the poison alone at the others.
    At max_held_losses (20) it is dead-lettered unread, and the others run."""
    from tests.apps.basic import record
    from tests.apps.read_poison import POISON_HEADER
    poison = record.apply_async(headers={POISON_HEADER: 1})
    plain = [record.delay() for _ in range(5)]
    workers = Restarting(start_worker, broker, app="tests.apps.read_poison")
    dead: list = []

    def settled() -> bool:
        workers.replace_dead()
        assert workers.deaths <= 21, f"{workers.deaths} deaths: the poison was not stopped"
        return bool(_dead_letters(broker, dead)) and _succeeded(plain)
    wait_until(settled, 240, "the poison to be dead-lettered and the others to succeed")

    assert workers.deaths == 20
    assert starts(tmp_path, poison.id) == 0
    assert [headers[DEAD_TASK_HEADER] for headers, _ in dead] == [poison.id]
    assert headers_reason(dead[0][0]).startswith(
        "too_many_deliveries: held by 20 workers that died before it started")
    assert type(failure(poison)).__name__ == TooManyDeliveries.__name__
    assert all(starts(tmp_path, r.id) == 1 for r in plain)
