"""A step's continuations are part of its settlement: never dropped by a crash.

Tier 2/3: the real daemon. The kill window is held open by a broker that goes silent just
as the step finishes: its SUCCESS (and chord count) reach the result store, but the next
step or the chord's body cannot be published; the supervisor is SIGKILLed there, the
silence cut without letting anything through, and a new worker gets the message again.
"""
from __future__ import annotations

import os
import signal
import uuid

import psutil
import pytest

from tests.conftest import (
    REDIS_URL,
    BrokerEnv,
    Worker,
    require_service,
    runs,
    wait_until,
    worker_env,
)
from tests.proxy import SilentBroker
from workhorse import App, Signature, chain, chord
from workhorse.states import SUCCESS

pytestmark = pytest.mark.timeout(120)


def _signature(client: App, name: str, *args: object) -> Signature:
    return Signature(f"tests.apps.basic.{name}", args, app=client)


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
@pytest.mark.parametrize("workflow", ["chain", "chord"])
def test_a_continuation_unsent_when_the_supervisor_died_is_sent_by_the_redelivery(
        kind, workflow, tmp_path):
    if kind != "sqlite":
        require_service("Redis", SilentBroker.PORTS[kind])
    silent = SilentBroker(kind, tmp_path)
    queue = f"cont-{uuid.uuid4().hex[:8]}"
    env = worker_env(BrokerEnv(kind, silent.url, queue), tmp_path,
                     concurrency=2, visibility_timeout=2)
    client = App("client", broker_url=silent.direct_url, queues=[queue],
                 result_backend=env["WORKHORSE_RESULT_BACKEND"])
    gate_file = tmp_path / "open"
    gate = _signature(client, "gate", str(gate_file), 4)
    if workflow == "chain":
        result = chain(gate, _signature(client, "mul", 10)).apply_async()
        step, expected = result.parent, 40
        waiting_for = "the chain's next step"
    else:
        result = chord([_signature(client, "add", 1, 1), gate],
                       _signature(client, "collect")).apply_async()
        step, expected = result.parent.results[1], [2, 4]
        waiting_for = "the chord's body"
    assert step is not None
    first = Worker(tmp_path, env, ["-A", "tests.apps.basic"])
    second = None
    try:
        wait_until(lambda: ("gate", step.id) in [r[:2] for r in runs(tmp_path)], 30,
                   "the gated step to start")
        if workflow == "chord":          # the other header part is counted first
            wait_until(lambda: result.parent.results[0].state == SUCCESS, 30, "add's part")
        children = first.children()
        silent.freeze()
        gate_file.touch()
        wait_until(lambda: client.backend.get_task_meta(step.id)["status"] == SUCCESS, 30,
                   "the gated step's SUCCESS")
        os.kill(first.pid, signal.SIGKILL)      # before its continuation reached the broker
        first.wait_exit(10)
        wait_until(lambda: not any(_alive(pid) for pid in children), 10, "its children's end")
        silent.cut()                            # nothing the first worker sent gets through
        assert client.backend.get_task_meta(result.id)["status"] != SUCCESS
        env["WORKHORSE_BROKER_URL"] = silent.direct_url
        second = Worker(tmp_path, env, ["-A", "tests.apps.basic"])
        assert result.get(timeout=60) == expected, f"{waiting_for} never ran"
        assert "its SUCCESS is stored already" in second.log()
    finally:
        first.kill()
        if second is not None:
            second.kill()
        silent.cut()
        BrokerEnv(kind, silent.direct_url, queue).cleanup()
        client.close()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.fixture(params=["sqlite", "redis"])
def store(request, tmp_path):
    from workhorse.backends import backend_from_url
    if request.param == "redis":
        require_service("Redis", 6379)
        url = REDIS_URL.rsplit("/", 1)[0] + "/1"
    else:
        url = f"sqlite:///{tmp_path / 'results.sqlite3'}"
    backend = backend_from_url(url, expires=600)
    yield backend
    backend.close()


def test_a_chord_counts_each_part_once_and_hands_its_completion_to_the_completing_part_again(
        store):
    group_id = f"g-{uuid.uuid4().hex}"
    store.set_chord_size(group_id, 2)
    for _ in range(3):                      # a part reported again: still one part
        assert store.chord_part_return(group_id, "a", 0, SUCCESS, 1) is None
    done = store.chord_part_return(group_id, "b", 1, SUCCESS, 2)
    assert done is not None and [p.result for p in done.parts] == [1, 2]
    # Its worker died before sending the body: another part does not take over while the
    # claim holds, the completing part's redelivery does.
    assert store.chord_part_return(group_id, "a", 0, SUCCESS, 1) is None
    again = store.chord_part_return(group_id, "b", 1, SUCCESS, 2)
    assert again is not None and [p.result for p in again.parts] == [1, 2]
    store.chord_finished(group_id, again.token)
    assert store.chord_part_return(group_id, "b", 1, SUCCESS, 2) is None   # applied once


def test_a_continuation_that_cannot_be_sent_requeues_its_step_then_dead_letters_it(
        broker, client, start_worker, tmp_path):
    """Its SUCCESS is stored, its callback cannot be sent (here: a priority the protocol
    refuses): the message goes back, counted, never acked without it; its redeliveries do
    not run it again, and past max_deliveries it is dead-lettered, saying why."""
    from tests.apps.basic import mul, record
    from tests.test_delivery import dead_letters, starts
    from workhorse.broker.consumer import DEAD_REASON_HEADER
    start_worker(broker)
    result = record.apply_async(link=mul.s(2).set(priority=999))
    assert result.get(timeout=30) == result.id
    [(headers, _)] = dead_letters(broker, 1)
    assert headers[DEAD_REASON_HEADER].startswith("continuation_failed: ValueError(")
    assert starts(tmp_path, result.id) == 1          # redeliveries sent, never re-ran
