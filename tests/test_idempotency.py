"""Redelivery hygiene and the opt-in idempotency guard (docs/delivery.md "Duplicates and
losses"), with real workers on every broker: a redelivered message whose SUCCESS is
stored is acked without running; an idempotent task's key is claimed in the result store,
so two deliveries never run at once and a finished key never runs again."""
from __future__ import annotations

import pytest

from workhorse.protocol import DELIVERIES_HEADER
from workhorse.states import REVOKED, SUCCESS

from .conftest import runs, wait_until
from .test_delivery import holds, starts

pytestmark = pytest.mark.timeout(180)

#: Short leases and claims, so "longer than the claim" stays quick.
VT = 2.0


def _sent_twice(task, args, task_id):
    """The same message (one task id) published twice, as a producer retry or a broker
    redelivery would make it."""
    first = task.apply_async(args, task_id=task_id)
    task.apply_async(args, task_id=task_id)
    return first


def test_two_workers_given_one_task_id_twice_run_it_once(broker, client, start_worker,
                                                         tmp_path):
    """It runs three times longer than its claim lasts unrenewed: the claim is renewed."""
    from tests.apps.basic import once
    for _ in range(2):
        start_worker(broker, visibility_timeout=VT, concurrency=2)
    result = _sent_twice(once, (3 * VT,), "idem-" + tmp_path.name)
    assert result.get(timeout=60) == result.id
    wait_until(lambda: broker.queue_size() == 0, 30, "both copies settled")
    holds(lambda: starts(tmp_path, result.id) == 1, VT, "one run only")


@pytest.mark.parametrize("broker", ["sqlite"], indirect=True)
def test_without_the_guard_the_same_task_id_runs_twice(broker, client, start_worker,
                                                        tmp_path):
    """What the guard prevents: a plain task sent twice under one id runs twice."""
    from tests.apps.basic import record
    start_worker(broker, concurrency=2)
    result = _sent_twice(record, (1.0,), "plain-" + tmp_path.name)
    wait_until(lambda: starts(tmp_path, result.id) == 2, 30, "two runs")


def test_a_key_function_runs_one_charge_per_order(broker, client, start_worker, tmp_path):
    from tests.apps.basic import charge
    worker = start_worker(broker, concurrency=2)
    first = charge.delay(17)
    assert first.get(timeout=30) == 17
    second = charge.delay(17)          # another task id, the same key
    wait_until(lambda: second.state == REVOKED, 30, "the duplicate charge to be refused")
    assert "idempotency key 'tests.apps.basic.charge:order-17' is done" in str(second.result)
    assert [name for name, _, _ in runs(tmp_path)] == ["charge"]
    assert charge.delay(18).get(timeout=30) == 18       # another order still runs
    assert "acked without running" in worker.log()
    assert broker.queue_size() == 0


def test_a_killed_idempotent_run_releases_its_claim_for_the_redelivery(
        broker, client, start_worker, tmp_path):
    from tests.apps.basic import once_dies_first
    worker = start_worker(broker, visibility_timeout=30)
    result = once_dies_first.delay()
    assert result.get(timeout=30) == "second time"
    assert starts(tmp_path, result.id) == 2
    # Released at once by the supervisor, not left to lapse after 30 s.
    assert "held by another delivery" not in worker.log()


def test_a_redelivered_message_whose_success_is_stored_is_acked_without_running(
        broker, client, start_worker, tmp_path):
    from tests.apps.basic import record
    worker = start_worker(broker)
    result = record.delay()
    assert result.get(timeout=30) == result.id
    # The same message again, as a worker that died before its ack would leave it.
    again = record.apply_async(task_id=result.id, headers={DELIVERIES_HEADER: 1})
    worker.wait_for_log("redelivered, but its SUCCESS is stored already", 30)
    wait_until(lambda: broker.queue_size() == 0, 30, "the redelivery settled")
    assert starts(tmp_path, result.id) == 1
    assert again.state == SUCCESS
