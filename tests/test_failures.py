"""Errors and retries in a real worker on each broker: self.retry, autoretry, Ignore,
Reject, error callbacks, links and chains."""
from __future__ import annotations

import contextlib
import signal
import uuid

import pytest
import redis
from kombu import Exchange, Producer

from workhorse import MaxRetriesExceededError, chain
from workhorse.broker.consumer import DEAD_REASON_HEADER
from workhorse.broker.queues import task_queue
from workhorse.protocol import build_message
from workhorse.states import FAILURE, PENDING, RETRY, SUCCESS

from .conftest import runs, wait_until
from .test_delivery import dead_letters, failure, starts

pytestmark = pytest.mark.timeout(120)


def errback_lines(tmp_path) -> list[str]:
    path = tmp_path / "grandchild.pid.errback"
    return path.read_text().splitlines() if path.exists() else []


def test_manual_retry_goes_through_retry_then_success(broker, client, start_worker, tmp_path):
    from tests.apps.basic import flaky
    start_worker(broker)
    result = flaky.delay(2, 0.3)
    seen: set[str] = set()
    wait_until(lambda: seen.add(result.state) or result.state == SUCCESS, 30, "SUCCESS")
    assert RETRY in seen
    assert result.get() == "ok after 2 retries"
    assert starts(tmp_path, result.id) == 3
    assert broker.queue_size() == 0
    dead_letters(broker, 0)


def test_retry_meta_carries_the_count_and_eta(broker, client, start_worker):
    from tests.apps.basic import flaky
    start_worker(broker)
    result = flaky.delay(1, 1.0)
    wait_until(lambda: client.backend.get_task_meta(result.id)["status"] == RETRY, 20, "RETRY")
    meta = client.backend.get_task_meta(result.id)
    assert meta["retries"] == 1 and meta["eta"]
    assert meta["result"]["exc_type"] == "ValueError"
    assert result.get(timeout=20) == "ok after 1 retries"


def test_past_max_retries_without_exc_is_max_retries_exceeded(broker, client, start_worker,
                                                              tmp_path):
    from tests.apps.basic import always_retry
    start_worker(broker)
    result = always_retry.delay()
    exc = failure(result)
    assert type(exc).__name__ == MaxRetriesExceededError.__name__
    assert starts(tmp_path, result.id) == 3         # the first run and max_retries=2 retries


def test_past_max_retries_the_exception_is_re_raised(broker, client, start_worker):
    from tests.apps.basic import always_retry
    start_worker(broker)
    assert isinstance(failure(always_retry.delay(True)), KeyError)


def test_autoretry_then_success(broker, client, start_worker, tmp_path):
    from tests.apps.basic import auto_flaky
    start_worker(broker)
    result = auto_flaky.delay(2)
    assert result.get(timeout=30) == 2
    assert starts(tmp_path, result.id) == 3


def test_autoretry_gives_up_with_the_last_exception(broker, client, start_worker, tmp_path):
    from tests.apps.basic import auto_flaky
    start_worker(broker)
    result = auto_flaky.delay(10)
    exc = failure(result)
    assert isinstance(exc, ConnectionError) and str(exc) == "attempt 2"
    assert starts(tmp_path, result.id) == 3


def test_dont_autoretry_for_fails_at_once(broker, client, start_worker, tmp_path):
    from tests.apps.basic import auto_selective
    start_worker(broker)
    key = auto_selective.delay("key")
    assert isinstance(failure(key), KeyError)
    assert starts(tmp_path, key.id) == 1
    value = auto_selective.delay("value")
    assert isinstance(failure(value), ValueError)
    assert starts(tmp_path, value.id) == 6       # retry_kwargs: max_retries=5


@pytest.mark.parametrize("broker", ["sqlite", "redis"], indirect=True)
def test_autoretry_with_backoff_and_jitter_in_a_real_worker(broker, client, start_worker,
                                                            tmp_path):
    """retry_backoff from the configuration reaches an autoretrying task."""
    from tests.apps.basic import auto_flaky
    start_worker(broker, retry_backoff=1, retry_jitter=True)
    result = auto_flaky.delay(2)          # waits ≤ 1 s, then ≤ 2 s
    assert result.get(timeout=30) == 2


def test_a_crash_between_publishing_the_retry_and_settling_duplicates_never_loses(
        broker, client, start_worker, tmp_path):
    from tests.apps.basic import retry_then_crash
    start_worker(broker)
    result = retry_then_crash.delay()
    assert result.get(timeout=30) == "done"
    # The original came back (child lost, requeued) and the retry ran too: a duplicate.
    wait_until(lambda: starts(tmp_path, result.id) == 3, 20, "the crash, the requeue, the retry")
    wait_until(lambda: broker.queue_size() == 0, 10, "nothing left")
    dead_letters(broker, 0)


def test_ignore_stores_nothing_and_acks(broker, client, start_worker, tmp_path):
    from tests.apps.basic import add, ignorer
    worker = start_worker(broker)
    result = ignorer.delay()
    worker.wait_for_log(rf"Task tests.apps.basic.ignorer\[{result.id}\] ignored")
    assert add.delay(1, 1).get(timeout=20) == 2
    assert result.state == PENDING
    assert broker.queue_size() == 0
    dead_letters(broker, 0)


def test_reject_dead_letters_with_failure(broker, client, start_worker):
    from tests.apps.basic import rejecter
    start_worker(broker)
    result = rejecter.delay(False)
    [(headers, _)] = dead_letters(broker, 1)
    assert headers[DEAD_REASON_HEADER].startswith("rejected")
    assert type(failure(result)).__name__ == "Reject"


def test_reject_requeue_counts_as_a_delivery(broker, client, start_worker, tmp_path):
    from tests.apps.basic import rejecter
    start_worker(broker, max_deliveries=2)
    result = rejecter.delay(True)
    [(headers, _)] = dead_letters(broker, 1)
    assert starts(tmp_path, result.id) == 2
    assert result.state == PENDING        # a requeue stores nothing


@pytest.mark.parametrize("broker", ["sqlite"], indirect=True)
def test_reject_with_early_ack_has_no_effect_but_a_warning(broker, client, start_worker,
                                                           tmp_path):
    from tests.apps.basic import rejecter
    worker = start_worker(broker, acks_late=False)
    result = rejecter.delay(True)
    worker.wait_for_log("no effect with acks_late = false")
    assert starts(tmp_path, result.id) == 1
    assert broker.queue_size() == 0


def test_errback_with_request_exc_traceback_runs_in_the_worker(broker, client, start_worker,
                                                               tmp_path):
    from tests.apps.basic import errback_new, fail
    start_worker(broker)
    result = fail.apply_async(("x",), link_error=errback_new.s())
    failure(result)
    wait_until(lambda: errback_lines(tmp_path), 20, "the errback")
    assert errback_lines(tmp_path) == [f"{result.id} ValueError True tests.apps.basic.fail"]


def test_errback_taking_a_task_id_is_sent_as_a_task(broker, client, start_worker, tmp_path):
    from tests.apps.basic import errback_old, fail
    start_worker(broker)
    result = fail.apply_async(("x",), link_error=errback_old.s())
    failure(result)
    wait_until(lambda: errback_lines(tmp_path), 20, "the errback task")
    assert errback_lines(tmp_path) == [f"old {result.id}"]


def test_a_failing_errback_is_logged_and_the_worker_goes_on(broker, client, start_worker):
    from tests.apps.basic import add, errback_crashing, fail
    worker = start_worker(broker)
    failure(fail.apply_async(("x",), link_error=errback_crashing.s()))
    worker.wait_for_log("its errback tests.apps.basic.errback_crashing failed")
    assert add.delay(2, 2).get(timeout=20) == 4


def test_link_applies_the_callback_to_the_result(broker, client, start_worker):
    from tests.apps.basic import add, mul
    start_worker(broker)
    callback = mul.s(10).set(task_id="cb-" + broker.queue)
    assert add.apply_async((1, 2), link=callback).get(timeout=20) == 3
    assert client.AsyncResult(callback.options["task_id"]).get(timeout=20) == 30


def test_chain_passes_each_result_on(broker, client, start_worker):
    from tests.apps.basic import add, mul
    start_worker(broker)
    result = (add.s(1, 2) | mul.s(10) | add.s(5)).apply_async()
    assert result.get(timeout=30) == 35


def test_a_failing_chain_step_fails_the_rest_of_the_chain_and_calls_its_errback(
        broker, client, start_worker, tmp_path):
    """As Celery does: the later steps never run, and their results (the chain's is the
    last one's) are the failed step's exception, so get() raises instead of hanging."""
    from tests.apps.basic import add, errback_new, fail
    start_worker(broker)
    steps = chain(add.s(1, 2), fail.si("middle"), add.s(100), add.s(1000))
    result = steps.on_error(errback_new.s()).apply_async()
    with pytest.raises(Exception) as raised:
        result.get(timeout=30)
    assert type(raised.value).__name__ == "ValueError" and raised.value.args == ("middle", 42)
    assert result.state == FAILURE and result.parent.state == FAILURE
    wait_until(lambda: errback_lines(tmp_path), 20, "the chain's errback")
    [line] = errback_lines(tmp_path)
    assert line.endswith("ValueError True tests.apps.basic.fail")
    assert broker.queue_size() == 0           # the later steps were never sent


def test_the_rest_of_a_chain_is_failed_in_running_order_so_its_own_result_comes_last():
    """Tier 1. The chain field lists the later steps last first; they are stored first to
    last (a chord's body right after its chord), so a client woken by the chain's result
    failing finds every earlier step failed already (CI once read a PENDING parent)."""
    import types

    from workhorse.chords import fail_chain
    stored: list[str] = []
    backend = types.SimpleNamespace(
        mark_as_failure=lambda task_id, *args, **kwargs: stored.append(task_id))
    app = types.SimpleNamespace(backend=backend)

    def step(task_id: str, **extra: object) -> dict:
        return {"task": "t", "options": {"task_id": task_id}, **extra}
    body = step("body")
    later = [step("last"), step("chord", subtask_type="chord", kwargs={"body": body}),
             step("next")]                                   # as the message carries them
    fail_chain(app, later, ValueError("x"), None, inline_errbacks=False)  # type: ignore[arg-type]
    assert stored == ["next", "chord", "body", "last"]


def test_a_chain_step_whose_child_is_lost_fails_the_rest_of_the_chain(
        broker, client, start_worker):
    """The supervisor stores that FAILURE (the child is gone): it fails the chain too."""
    from tests.apps.basic import add, die
    start_worker(broker, reject_on_worker_lost=False)
    result = (die.s() | add.s(1)).apply_async()
    with pytest.raises(Exception) as raised:
        result.get(timeout=30)
    assert type(raised.value).__name__ == "WorkerLostError"
    assert result.parent.state == FAILURE


def test_a_retry_with_new_args_runs_with_them_and_keeps_custom_headers(
        broker, client, start_worker):
    from tests.apps.basic import retry_with_new_args
    start_worker(broker)
    result = retry_with_new_args.apply_async((1,), {"b": 2}, headers={"tenant": "acme"})
    assert result.get(timeout=30) == [10, 20, "acme"]


def test_a_requeued_message_is_seen_as_redelivered_with_its_priority(broker, client,
                                                                      start_worker):
    from tests.apps.basic import reject_until_redelivered
    start_worker(broker)
    result = reject_until_redelivered.apply_async(priority=3)
    assert result.get(timeout=30) == [True, 3]


def test_a_message_handed_back_returns_to_its_own_queue_only(broker, client, start_worker,
                                                              tmp_path):
    """A Celery producer's message a topic exchange routed to the worker's queue and to
    another, buffered when a warm shutdown hands it back: it returns to the worker's
    queue, once, and the other queue keeps its one copy. (On Redis, kombu put a message
    back by its exchange and routing key: into every queue the key matched, or, in a
    process that had not declared the exchange, nowhere, and the hand-back failed.)"""
    from tests.apps.basic import record
    other = broker.queue + "-other"
    broker.extra_queues.append(other)
    running = record.delay(10)      # (holds the one child past the hand-back)
    worker = start_worker(broker, concurrency=1, prefetch_multiplier=4)
    wait_until(lambda: runs(tmp_path), 20, "the first task to start")
    topic = Exchange(f"x-{uuid.uuid4().hex[:8]}", type="topic", auto_delete=True)
    task_id = str(uuid.uuid4())
    message = build_message(record.name, task_id)
    with broker.connection() as conn:
        channel = conn.default_channel
        topic(channel).declare()
        try:
            for name in (broker.queue, other):
                queue = task_queue(name, broker.queue_type)(channel)
                queue.declare()
                queue.bind_to(topic, "jobs.#")
            Producer(conn).publish(message.body, exchange=topic, routing_key="jobs.one",
                                   serializer="json", headers=message.headers,
                                   **message.properties)
            wait_until(lambda: broker.queue_size() == 0, 10, "the message to be buffered")
            worker.signal(signal.SIGTERM)
            wait_until(lambda: broker.queue_size() == 1, 5,
                       "the buffered message back before the running one ends")
            assert worker.wait_exit(30) == 0
            assert running.get(timeout=5) == running.id
            assert (broker.queue_size(), broker.queue_size(other)) == (1, 1)
            assert starts(tmp_path, task_id) == 0
        finally:
            with contextlib.suppress(Exception):
                topic(channel).delete()
            if broker.kind == "redis":      # (kombu leaves an exchange's bindings there)
                redis.Redis.from_url(broker.url).delete(
                    *[f"_kombu.{kind}.{topic.name}" for kind in ("binding", "binding_permanent")])


@pytest.mark.parametrize("shape", ["group last", "chord last", "group then task",
                                   "chord then task"])
def test_chains_holding_groups_and_chords(broker, client, start_worker, shape):
    """As Celery runs them: a group's tasks get the previous result, a task after a group
    gets the group's results (the pair becomes a chord), the rest of a chain follows a
    chord's body; the chain's result is known when it is sent."""
    from tests.apps.basic import add, collect, mul
    from workhorse import chord, group
    start_worker(broker)
    header = group(add.s(10), add.s(20))
    canvas = {"group last": chain(add.s(1, 1), header),
              "chord last": chain(add.s(1, 1), chord(header, collect.s())),
              "group then task": add.s(1, 1) | header | collect.s(),
              "chord then task": chain(add.s(1, 1), chord(header, collect.s()), mul.s(2))}[shape]
    result = canvas.apply_async()
    if shape == "group last":
        assert result.join(timeout=30) == [12, 22]
    else:
        expected = [12, 22, 12, 22] if shape == "chord then task" else [12, 22]
        assert result.get(timeout=30) == expected


@pytest.mark.parametrize(("kind", "value"), [("task", 5), ("chain", 20),
                                           ("group", [2, 4])])
def test_a_replaced_task_gives_its_id_callbacks_and_chain_to_its_replacement(
        broker, client, start_worker, kind, value):
    """Celery's Task.replace: the replacement's result is the replaced task's, its link
    callback and the rest of its chain follow the replacement."""
    import uuid

    from tests.apps.basic import collect, replace_with
    from workhorse import chord, group
    start_worker(broker)
    callback_id = str(uuid.uuid4())
    replaced = replace_with.apply_async((kind,), link=collect.s().set(task_id=callback_id))
    assert replaced.get(timeout=30) == value
    assert client.AsyncResult(callback_id).get(timeout=30) == value
    chained = (replace_with.si(kind) | collect.s()).apply_async()
    assert chained.get(timeout=30) == value and chained.parent.get(timeout=5) == value
    member = chord(group(replace_with.si(kind), collect.si(7)), collect.s()).apply_async()
    assert member.get(timeout=30) == [value, 7]         # its place in a chord, too


def test_immutable_signature_ignores_the_previous_result(broker, client, start_worker):
    from tests.apps.basic import add
    start_worker(broker)
    assert (add.s(1, 1) | add.si(5, 5)).apply_async().get(timeout=20) == 10
