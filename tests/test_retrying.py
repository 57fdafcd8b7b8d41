"""Retries, in pure logic: the back-off schedule, autoretry selection, and what
self.retry() sends and raises (with the broker call captured, not made)."""
from __future__ import annotations

import random
from datetime import timedelta

import pytest

from workhorse import App, MaxRetriesExceededError, Retry, _state
from workhorse.protocol import utcnow
from workhorse.retrying import retry_countdown, should_autoretry
from workhorse.task import Context


@pytest.mark.parametrize("base, expected", [(1, [1, 2, 4, 8]), (True, [1, 2, 4, 8]),
                                            (3, [3, 6, 12, 24])])
def test_backoff_table_without_jitter(base, expected):
    assert [retry_countdown(n, backoff=base, backoff_max=600, jitter=False, default_delay=180)
            for n in range(4)] == expected


def test_backoff_is_capped():
    assert retry_countdown(20, backoff=3, backoff_max=600, jitter=False, default_delay=1) == 600


def test_jitter_draws_within_zero_and_the_countdown():
    rng = random.Random(1)
    draws = [retry_countdown(3, backoff=1, backoff_max=600, jitter=True, default_delay=1, rng=rng)
             for _ in range(2000)]
    assert all(0 <= d <= 8 for d in draws)
    assert min(draws) < 1 and max(draws) > 7          # spread over the whole range


def test_without_backoff_the_default_delay_applies():
    assert retry_countdown(5, backoff=False, backoff_max=600, jitter=True, default_delay=180) == 180


def test_autoretry_selection():
    assert should_autoretry(ConnectionError(), (OSError,), ())
    assert not should_autoretry(KeyError(), (Exception,), (KeyError,))
    assert not should_autoretry(ValueError(), (), ())


@pytest.fixture
def app(monkeypatch, tmp_path):
    app = App("retry-logic", broker_url="memory://", result_backend="disabled",
              state_dir=str(tmp_path), max_retries=3)
    sent: list[dict] = []
    monkeypatch.setattr(app, "send_task", lambda name, args, kwargs, **options: sent.append(
        {"name": name, "args": args, "kwargs": kwargs, **options}))
    app.sent = sent  # type: ignore[attr-defined]
    yield app
    # Tests push a running request (as a child does): take it off again, so that nothing
    # sent later in this process thinks it has a parent task.
    _state.clear_contexts()


def running(task, retries=0, **fields):
    task.push_request(Context(id="t-1", task=task.name, args=[1], kwargs={"k": 2},
                              retries=retries, called_directly=False, queue="q", priority=7,
                              timelimit=(30.0, 20.0), root_id="root", parent_id="parent",
                              **fields))


def test_retry_sends_the_same_task_again_then_raises(app):
    @app.task(bind=True)
    def job(self, a, k):
        return None
    running(job, retries=1)
    before = utcnow()
    with pytest.raises(Retry) as raised:
        job.retry(countdown=5, exc=ValueError("x"))
    [sent] = app.sent
    assert sent["task_id"] == "t-1" and sent["retries"] == 2
    assert (sent["args"], sent["kwargs"]) == ([1], {"k": 2})
    assert (sent["queue"], sent["priority"]) == ("q", 7)
    assert (sent["time_limit"], sent["soft_time_limit"]) == (30.0, 20.0)
    assert (sent["root_id"], sent["parent_id"]) == ("root", "parent")
    assert before + timedelta(seconds=4.9) <= sent["eta"] <= utcnow() + timedelta(seconds=5.1)
    assert isinstance(raised.value.exc, ValueError) and raised.value.when == 5


def test_retry_without_countdown_uses_default_retry_delay(app):
    @app.task(bind=True)
    def job(self):
        return None
    running(job)
    with pytest.raises(Retry):
        job.retry()
    assert app.sent[0]["eta"] - utcnow() > timedelta(seconds=179)


def test_retry_throw_false_returns_the_signal(app):
    @app.task(bind=True)
    def job(self):
        return None
    running(job)
    signal = job.retry(countdown=1, throw=False)
    assert isinstance(signal, Retry) and len(app.sent) == 1


@pytest.mark.parametrize("task_limit, call_limit, retries, allowed", [
    (None, None, 3, True),     # config: 3 retries
    (None, None, 4, False),
    (1, None, 1, True),        # the task's own limit beats the config
    (1, None, 2, False),
    (1, 5, 4, True),           # retry(max_retries=) beats the task
])
def test_max_retries_precedence(app, task_limit, call_limit, retries, allowed):
    options = {} if task_limit is None else {"max_retries": task_limit}

    @app.task(bind=True, **options)
    def job(self):
        return None
    running(job, retries=retries - 1)
    if allowed:
        with pytest.raises(Retry):
            job.retry(countdown=0, max_retries=call_limit)
    else:
        with pytest.raises(MaxRetriesExceededError) as raised:
            job.retry(countdown=0, max_retries=call_limit)
        assert raised.value.task_args == [1] and raised.value.task_kwargs == {"k": 2}
        assert app.sent == []


def test_max_retries_none_on_the_task_means_no_limit(app):
    @app.task(bind=True, max_retries=None)
    def job(self):
        return None
    running(job, retries=1000)
    with pytest.raises(Retry):
        job.retry(countdown=0)


def test_past_max_retries_the_given_exception_is_raised(app):
    @app.task(bind=True, max_retries=0)
    def job(self):
        return None
    running(job)
    with pytest.raises(KeyError):
        job.retry(exc=KeyError("k"), countdown=0)


def test_a_task_called_directly_cannot_retry(app):
    @app.task(bind=True)
    def job(self):
        return None
    with pytest.raises(ValueError):
        job.retry(exc=ValueError("direct"))


def test_options_come_from_a_shared_base_class(app):
    from workhorse import Task

    class Patient(Task):
        max_retries = 10
        retry_backoff = 2

    @app.task(bind=True, base=Patient)
    def job(self):
        return None

    @app.task(bind=True, base=Patient, retry_backoff=5)
    def other(self):
        return None
    assert job.option("max_retries") == 10 and job.option("retry_backoff") == 2
    assert other.option("retry_backoff") == 5
    assert job.option("retry_backoff_max") == 600      # config default


def _signature_of(a, b=0, *rest, c=None, **more):
    return None


@pytest.mark.parametrize(("original", "args", "kwargs", "expected"), [
    # neither given: the original arguments
    (([1], {"b": 2}), None, None, ([1], {"b": 2})),
    # both given: exactly those
    (([1], {"b": 2}), [5], {"c": 3}, ([5], {"c": 3})),
    # args only: original keywords for parameters the new args fill are dropped
    (([], {"a": 1, "b": 2, "c": 3}), [7], None, ([7], {"b": 2, "c": 3})),
    (([], {"a": 1, "b": 2}), [7, 8], None, ([7, 8], {})),
    # kwargs only: an original positional argument they name is replaced in place
    (([1, 2, 3], {}), None, {"b": 9}, ([1, 9, 3], {})),
    (([1], {}), None, {"c": 4}, ([1], {"c": 4})),
    (([1, 2], {}), None, {"a": 5, "x": 6}, ([5, 2], {"x": 6})),
])
def test_retry_combines_new_and_original_arguments_as_celery_does(original, args, kwargs,
                                                                  expected):
    from workhorse.retrying import retry_arguments
    assert retry_arguments(_signature_of, *original, args, kwargs) == expected


def test_retry_with_new_args_does_not_pass_a_value_twice(app):
    """Celery 5.7: retry(args=…) of a task sent with keyword arguments; today's error was
    'got multiple values for argument'."""
    @app.task(bind=True)
    def job(self, a, k):
        return None
    running(job)                       # args [1], kwargs {"k": 2}
    with pytest.raises(Retry):
        job.retry(args=[10, 20], countdown=1)
    assert (app.sent[0]["args"], app.sent[0]["kwargs"]) == ([10, 20], {})
    app.sent.clear()
    with pytest.raises(Retry):
        job.retry(kwargs={"a": 30}, countdown=1)
    assert (app.sent[0]["args"], app.sent[0]["kwargs"]) == ([30], {})   # kwargs replaced


def test_retry_keeps_custom_headers_ignore_result_chord_and_expiry(app):
    @app.task(bind=True)
    def job(self, a, k):
        return None
    expires = utcnow() + timedelta(hours=1)
    running(job, headers={"tenant": "acme", "id": "t-1", "retries": 0, "ignore_result": True,
                          "redelivered": True, "x-workhorse-deliveries": 2},
            chord={"task": "body"}, expires=expires)
    with pytest.raises(Retry):
        job.retry(countdown=1)
    [sent] = app.sent
    assert sent["headers"] == {"tenant": "acme"}
    assert sent["ignore_result"] is True and sent["chord"] == {"task": "body"}
    assert sent["expires"] == expires


def test_custom_headers_leave_the_protocol_and_the_bookkeeping_behind():
    from workhorse.protocol import build_message, custom_headers
    built = build_message("t", "i", (1,), {}, extra_headers={"tenant": "acme"})
    assert custom_headers(built.headers) == {"tenant": "acme", "replaced_task_nesting": 0,
                                             "stamped_headers": None, "stamps": {}}
