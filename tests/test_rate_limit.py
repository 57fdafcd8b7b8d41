"""Task rate limits (Celery's ``rate_limit="10/m"``): tier 1, the rate and its bucket; tier
2, a real worker spacing a task's starts while other tasks pass the waiting ones."""
from __future__ import annotations

from datetime import datetime

import pytest

from workhorse.ratelimit import RateLimits, TokenBucket, parse_rate
from workhorse.task import TaskOptionError


pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(("given", "per_second"), [
    ("10/s", 10.0), ("120/m", 2.0), ("36/h", 0.01), ("5", 5.0), (" 3 / m ", 0.05), (4, 4.0),
    (0.5, 0.5), (None, None), (0, None), ("0/m", None)])
def test_rates_are_read_as_celery_writes_them(given, per_second):
    assert parse_rate(given) == per_second


@pytest.mark.parametrize("bad", ["10/d", "ten/s", "-1/s", -1, True, [10], "1/s/s"])
def test_a_bad_rate_is_refused_saying_what_is_accepted(bad):
    with pytest.raises(ValueError, match='expected a rate such as "10/s"'):
        parse_rate(bad)


def test_a_bad_rate_limit_option_stops_the_task_definition():
    from workhorse import App
    app = App("rates", broker_url="memory://", result_backend="disabled")
    with pytest.raises(TaskOptionError, match=r"task .*: option rate_limit: expected a rate"):
        app.task(rate_limit="fast")(lambda: None)


def test_starts_are_spaced_one_over_the_rate_apart_and_one_token_is_kept_at_most():
    bucket = TokenBucket(2.0, now=100.0)
    assert bucket.wait(100.0) == 0.0          # the first start: at once
    bucket.take(100.0)
    assert bucket.wait(100.1) == pytest.approx(0.4)
    bucket.take(100.5)
    assert bucket.wait(100.5) == pytest.approx(0.5)
    bucket.take(101.0)
    assert bucket.wait(160.0) == 0.0          # idle for a minute: one start at once...
    bucket.take(160.0)
    assert bucket.wait(160.0) == pytest.approx(0.5)   # ...not sixty


def test_rate_limits_are_per_task_and_a_new_rate_starts_afresh():
    limits = RateLimits()
    assert limits.wait("a", None, 0.0) == 0.0
    assert limits.wait("a", 1.0, 0.0) == 0.0
    limits.take("a", 0.0)
    assert limits.wait("a", 1.0, 0.2) == pytest.approx(0.8)
    assert limits.wait("b", 1.0, 0.2) == 0.0
    assert limits.wait("a", 100.0, 0.2) == 0.0        # reloaded with another rate


def test_a_rate_limited_task_starts_at_its_rate_while_other_tasks_pass_it(
        broker, client, start_worker):
    from tests.apps.basic import add, rated
    start_worker(broker, concurrency=2)
    limited = [rated.delay() for _ in range(4)]
    other = add.delay(1, 1)
    assert other.get(timeout=30) == 2
    starts = sorted(r.get(timeout=30) for r in limited)
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert min(gaps) >= 0.45, gaps            # 2/s: half a second apart at least
    other_done = datetime.fromisoformat(client.backend.get_task_meta(other.id)["date_done"])
    assert other_done.timestamp() < starts[-1]   # it did not wait behind them
