"""Task options, checked when the task is defined: options that are settings by the
setting's declaration (as Python values: text is not converted), the others by checks of
their own; unknown options and a soft limit not under the hard one are errors."""
from __future__ import annotations

import dataclasses

import pytest

from workhorse import App, Task
from workhorse.builtins import NAMES as BUILTINS
from workhorse.config import task_options
from workhorse.config import types as t
from workhorse.config.settings import BY_NAME
from workhorse.config.types import Invalid
from workhorse.outcome import Policy
from workhorse.task import TaskOptionError


@pytest.fixture
def app(tmp_path):
    return App("tests.opts", broker_url="memory://", result_backend="disabled",
               state_dir=str(tmp_path))


def define(app: App, **options):
    @app.task(**options)
    def job():
        return None
    return job


def error_of(app: App, **options) -> str:
    with pytest.raises(TaskOptionError) as raised:
        define(app, **options)
    return str(raised.value)


JOB = "task tests.test_task_options.define.<locals>.job"


# -- the strict native check of the value types
@pytest.mark.parametrize("kind, text", [
    (t.boolean(), "no"), (t.boolean(), "true"), (t.integer(1), "3"),
    (t.seconds(positive=True), "5"), (t.boolean_or_integer(1), "2"),
    (t.integer(0).or_none(), "none")])
def test_native_values_are_not_read_from_text(kind, text):
    kind.parse(text)                      # env, INI and CLI text is still read
    with pytest.raises(Invalid):
        kind.parse_native(text)


def test_native_check_describes_python_values():
    with pytest.raises(Invalid, match="^expected True or False$"):
        t.boolean().parse_native(1)
    with pytest.raises(Invalid, match=r"^expected an integer of at least 0, or None$"):
        t.integer(0).or_none().parse_native("none")
    assert t.integer(0).or_none().parse_native(None) is None
    assert t.seconds(positive=True).parse_native(5) == 5.0
    assert t.text().parse_native("queue") == "queue"    # text types take str natively


# -- options that are settings
def test_a_string_for_an_integer_option_is_an_error_naming_task_and_option(app):
    assert error_of(app, max_deliveries="3") == (
        f"{JOB}: option max_deliveries: expected an integer from 1 to 1000, got '3' (a str)")


def test_a_string_for_a_boolean_option_is_an_error_not_true(app):
    assert error_of(app, acks_late="no") == (
        f"{JOB}: option acks_late: expected True or False, got 'no' (a str)")
    assert set(app.tasks) == set(BUILTINS)     # nothing was registered


BAD_SETTING_VALUES = {
    "acks_late": 1, "reject_on_worker_lost": "yes", "acks_on_failure": "false",
    "acks_on_timeout": 0, "max_deliveries": 0, "time_limit": "30", "soft_time_limit": -1,
    "track_started": "on", "max_retries": "3", "default_retry_delay": "10",
    "retry_backoff": "true", "retry_backoff_max": float("inf"), "retry_jitter": "off",
    "async_concurrency": 0,
}


def test_every_option_that_is_a_setting_is_declared_and_has_a_bad_value_here():
    assert set(task_options.SETTING_OPTIONS) <= set(BY_NAME)
    assert set(BAD_SETTING_VALUES) == set(task_options.SETTING_OPTIONS)


def test_the_ack_policy_the_supervisor_reads_is_made_of_checked_options():
    policy_fields = {f.name for f in dataclasses.fields(Policy)}
    assert policy_fields <= set(task_options.SETTING_OPTIONS)


@pytest.mark.parametrize("name, value", sorted(BAD_SETTING_VALUES.items()))
def test_options_that_are_settings_are_checked_by_their_declaration(app, name, value):
    expected = BY_NAME[name].type.describe_native()
    message = error_of(app, **{name: value})
    assert message.startswith(f"{JOB}: option {name}: expected {expected}, got {value!r}")


def test_setting_options_keep_their_normal_form(app):
    job = define(app, time_limit=30, soft_time_limit=20, retry_backoff=0, max_deliveries=5)
    assert (job.time_limit, job.soft_time_limit) == (30.0, 20.0)
    assert isinstance(job.time_limit, float)
    assert job.retry_backoff is False and job.max_deliveries == 5


def test_none_means_the_configured_value_and_for_max_retries_no_limit(app):
    job = define(app, acks_late=None, time_limit=None, max_retries=None)
    assert job.option("acks_late") is True          # the configuration's default
    assert job.max_retries is None and job.option("max_retries") is None


# -- options with checks of their own
@pytest.mark.parametrize("name, value, expected", [
    ("ignore_result", "yes", "expected True or False"),
    ("typing", 0, "expected True or False"),
    ("queue", "", "expected a queue name (a non-empty str), or None"),
    ("queue", 5, "expected a queue name (a non-empty str), or None"),
    ("priority", 256, "expected an integer from 0 to 255, or None"),
    ("priority", "5", "expected an integer from 0 to 255, or None"),
    ("priority", True, "expected an integer from 0 to 255, or None"),
    ("autoretry_for", (ValueError, "KeyError"), "expected an exception class or a tuple of them"),
    ("dont_autoretry_for", int, "expected an exception class or a tuple of them"),
    ("retry_kwargs", [("countdown", 5)], "expected a dict of self.retry() keyword arguments"),
    ("idempotent", "order_id", "expected True, False or a function of the task's arguments"),
    ("name", "", "expected a non-empty str, or None"),
    ("bind", "True", "expected True or False"),
    ("base", object, "expected a Task subclass, or None"),
])
def test_other_options_have_checks_of_their_own(app, name, value, expected):
    message = error_of(app, **{name: value})
    assert message.startswith(f"{JOB}: option {name}: {expected}")
    article = "an" if type(value).__name__[0] in "aeiou" else "a"
    assert message.endswith(f"got {value!r} ({article} {type(value).__name__})")


def test_other_options_take_their_python_values(app):
    key = lambda order: str(order)  # noqa: E731
    job = define(app, autoretry_for=ConnectionError, dont_autoretry_for=[KeyError],
                 retry_kwargs={"countdown": 1}, idempotent=key, queue="q", priority=0,
                 ignore_result=True, typing=False)
    assert job.autoretry_for == (ConnectionError,) and job.dont_autoretry_for == (KeyError,)
    assert job.retry_kwargs == {"countdown": 1} and job.idempotent is key
    assert (job.queue, job.priority, job.ignore_result, job.typing) == ("q", 0, True, False)


# -- time limits together
def test_a_soft_limit_not_under_the_hard_limit_is_an_error_naming_both(app):
    assert error_of(app, time_limit=20, soft_time_limit=30) == (
        f"{JOB}: time_limit (20) must be greater than soft_time_limit (30)")
    assert error_of(app, time_limit=20, soft_time_limit=20.0).endswith(
        "time_limit (20) must be greater than soft_time_limit (20)")


def test_the_limits_are_checked_across_the_base_class_and_the_decorator(app):
    class Limited(Task):
        time_limit = 10

    assert error_of(app, base=Limited, soft_time_limit=12) == (
        f"{JOB}: time_limit (10) must be greater than soft_time_limit (12)")
    assert define(app, base=Limited, soft_time_limit=5).option("time_limit") == 10.0


# -- unknown options
def test_an_unknown_option_is_an_error_suggesting_the_close_one(app):
    message = error_of(app, acks_lat=True)
    assert message.startswith(f"{JOB}: unknown option acks_lat (did you mean acks_late?); "
                              "task options: acks_late, ")
    assert "other attributes belong on a Task subclass given as base=" in message


def test_attributes_of_their_own_go_on_a_base_class(app):
    class Audited(Task):
        audit_log = "billing"

    assert define(app, base=Audited).audit_log == "billing"


# -- Task subclasses
def test_options_set_on_a_task_subclass_are_checked_when_it_is_defined():
    with pytest.raises(TaskOptionError) as raised:
        class Patient(Task):
            max_retries = "10"
    assert str(raised.value) == (
        "Task subclass tests.test_task_options.test_options_set_on_a_task_subclass_are_checked"
        "_when_it_is_defined.<locals>.Patient: option max_retries: expected an integer of at "
        "least 0, or None, got '10' (a str)")


def test_a_task_subclass_with_its_soft_limit_over_its_hard_limit_is_an_error():
    with pytest.raises(TaskOptionError, match=r"\.Slow: time_limit \(5\) must be greater "
                                              r"than soft_time_limit \(9\)$"):
        class Slow(Task):
            time_limit = 5
            soft_time_limit = 9


def test_subclass_options_take_their_normal_form():
    class Shared(Task):
        autoretry_for = OSError
        time_limit = 60

    assert Shared.autoretry_for == (OSError,) and Shared.time_limit == 60.0


def test_the_error_is_both_a_type_error_and_a_value_error(app):
    with pytest.raises(TypeError):
        define(app, max_deliveries="3")
    with pytest.raises(ValueError):
        define(app, max_deliveries=0)


def test_the_messages_ignore_result_overrides_the_tasks_as_in_celery():
    """Celery's producers always send the header (send_task: false), and Celery's worker
    lets it win over the task's option; null leaves the task's option in force."""
    app = App("ignore", broker_url="memory://", result_backend="disabled")
    quiet = app.task(ignore_result=True)(lambda: None)
    loud = app.task(name="loud")(lambda: None)
    assert quiet.ignores_result(None) and not quiet.ignores_result(False)
    assert not loud.ignores_result(None) and loud.ignores_result(True)
