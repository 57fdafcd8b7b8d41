"""Tier 1: due times, with no clock: cron fields, daylight-saving changes in Berlin and New
York (spring gap, autumn repeat), epoch-anchored intervals, durations. The expected times
are worked out by hand from the rules in workhorse/schedules/timing.py."""
from __future__ import annotations

from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from workhorse.schedules.timing import Cron, Every, due_between, parse_duration

pytestmark = pytest.mark.timeout(60)

BERLIN = ZoneInfo("Europe/Berlin")
NEW_YORK = ZoneInfo("America/New_York")
UTC = ZoneInfo("UTC")


def times(timing, after: str, count: int) -> list[str]:
    moment, out = datetime.fromisoformat(after), []
    for _ in range(count):
        moment = timing.next_after(moment)
        out.append(moment.isoformat())
    return out


def test_berlin_spring_and_autumn_as_the_issue_states():
    daily = Cron("30 2 * * *", BERLIN)
    assert times(daily, "2027-03-27T12:00+01:00", 2) == [
        "2027-03-28T03:30:00+02:00", "2027-03-29T02:30:00+02:00"]
    assert times(daily, "2026-10-24T12:00+02:00", 2) == [
        "2026-10-25T02:30:00+02:00", "2026-10-26T02:30:00+01:00"]


def test_an_hourly_cron_skips_the_repeated_hour_and_the_gap_hour_fires_once():
    hourly = Cron("0 * * * *", BERLIN)
    assert times(hourly, "2026-10-25T01:30+02:00", 3) == [
        "2026-10-25T02:00:00+02:00", "2026-10-25T03:00:00+01:00", "2026-10-25T04:00:00+01:00"]
    # Spring: local 02:00 does not exist; read as 01:00 UTC, the instant 03:00+02:00 is.
    assert times(hourly, "2027-03-28T00:30+01:00", 3) == [
        "2027-03-28T01:00:00+01:00", "2027-03-28T03:00:00+02:00", "2027-03-28T04:00:00+02:00"]


def test_new_york_spring_gap():
    """2027-03-14: 02:00 EST becomes 03:00 EDT."""
    assert times(Cron("30 2 * * *", NEW_YORK), "2027-03-13T12:00-05:00", 2) == [
        "2027-03-14T03:30:00-04:00", "2027-03-15T02:30:00-04:00"]
    assert times(Cron("*/30 * * * *", NEW_YORK), "2027-03-14T01:15-05:00", 4) == [
        "2027-03-14T01:30:00-05:00", "2027-03-14T03:00:00-04:00",
        "2027-03-14T03:30:00-04:00", "2027-03-14T04:00:00-04:00"]


def test_new_york_autumn_repeat():
    """2026-11-01: 02:00 EDT becomes 01:00 EST; 01:xx happens twice, fires the first time."""
    assert times(Cron("30 1 * * *", NEW_YORK), "2026-10-31T12:00-04:00", 2) == [
        "2026-11-01T01:30:00-04:00", "2026-11-02T01:30:00-05:00"]
    assert times(Cron("30 2 * * *", NEW_YORK), "2026-10-31T12:00-04:00", 2) == [
        "2026-11-01T02:30:00-05:00", "2026-11-02T02:30:00-05:00"]
    assert times(Cron("0 * * * *", NEW_YORK), "2026-11-01T00:30-04:00", 3) == [
        "2026-11-01T01:00:00-04:00", "2026-11-01T02:00:00-05:00", "2026-11-01T03:00:00-05:00"]


def test_every_fifteen_minutes_over_both_berlin_changes_is_strictly_increasing():
    quarter = Cron("*/15 * * * *", BERLIN)
    # 48 real hours hold 192 quarter hours. Spring: each has a local time on the grid, and
    # the four missing local times map onto four of them (fired once): 192. Autumn: the
    # repeated hour's second pass fires nothing: 188.
    for start, expected in (("2027-03-27T12:00+01:00", 192), ("2026-10-24T12:00+02:00", 188)):
        after = datetime.fromisoformat(start)
        found = due_between(quarter, after, after + timedelta(hours=48))
        instants = [t.timestamp() for t in found]
        assert instants == sorted(set(instants))
        assert len(found) == expected


@pytest.mark.parametrize("expression, says", [
    ("61 * * * *", "minute field '61': 61 is out of range 0-59"),
    ("* 24 * * *", "hour field '24': 24 is out of range 0-23"),
    ("* * 0 * *", "day-of-month field '0': 0 is out of range 1-31"),
    ("* * * 13 *", "month field '13': 13 is out of range 1-12"),
    ("* * * * 8", "day-of-week field '8': 8 is out of range 0-7"),
    ("* * * foo *", "month field 'foo': 'foo' is not a number or a name"),
    ("5-1 * * * *", "minute field '5-1': range '5-1' runs backwards"),
    ("*/0 * * * *", "minute field '*/0': step '0' must be a positive integer"),
    ("* * *", "expected 5 fields (minute hour day-of-month month day-of-week), got 3"),
    ("@reboot", "unknown macro"),
    ("0 0 30 2 *", "never due"),
])
def test_parse_errors_name_the_field(expression, says):
    with pytest.raises(ValueError) as caught:
        Cron(expression, UTC)
    assert says in str(caught.value) and expression in str(caught.value)


def test_fields_names_steps_lists_and_macros():
    after = "2026-06-01T00:00+00:00"           # a Monday
    assert times(Cron("0 9 * * mon-fri", UTC), "2026-06-05T10:00+00:00", 1) == [
        "2026-06-08T09:00:00+00:00"]
    assert times(Cron("0 0 * * 7", UTC), after, 1) == times(Cron("0 0 * * sun", UTC), after, 1)
    assert times(Cron("50/5 0 * * *", UTC), after, 3) == [
        "2026-06-01T00:50:00+00:00", "2026-06-01T00:55:00+00:00",
        "2026-06-02T00:50:00+00:00"]
    assert times(Cron("0 1,13 * JAN,jul *", UTC), after, 2) == [
        "2026-07-01T01:00:00+00:00", "2026-07-01T13:00:00+00:00"]
    assert times(Cron("@weekly", UTC), after, 1) == ["2026-06-07T00:00:00+00:00"]
    assert times(Cron("  0   0  29 2 *", UTC), after, 2) == [
        "2028-02-29T00:00:00+00:00", "2032-02-29T00:00:00+00:00"]


def test_either_day_field_in_cron_both_in_celerys_crontab():
    after = "2026-11-14T00:00+00:00"
    either = Cron("0 0 13 * 5", UTC)          # the 13th, or a Friday
    assert times(either, after, 2) == ["2026-11-20T00:00:00+00:00",
                                       "2026-11-27T00:00:00+00:00"]
    both = Cron.from_fields([0], [0], [13], range(1, 13), [5], UTC, days_both=True)
    assert times(both, after, 1) == ["2027-08-13T00:00:00+00:00"]


def test_every_is_on_the_epoch_grid_whenever_it_is_asked():
    ninety = Every(90, BERLIN)
    a = ninety.next_after(datetime.fromisoformat("2026-10-25T01:59:59+02:00"))
    b = ninety.next_after(a - timedelta(seconds=1))
    assert a == b and a.timestamp() % 90 == 0
    # Across the autumn change the spacing stays 90 s of real time.
    found = due_between(ninety, a, a + timedelta(hours=3))
    steps = {y.timestamp() - x.timestamp() for x, y in zip(found, found[1:], strict=False)}
    assert steps == {90.0}
    anchored = Every(3600, UTC, datetime.fromisoformat("2026-01-01T00:15:00+00:00"))
    assert times(anchored, "2026-06-01T10:20+00:00", 1) == ["2026-06-01T11:15:00+00:00"]
    for bad in (0, -1, True, "1s"):
        with pytest.raises(ValueError):
            Every(bad, UTC)              # type: ignore[arg-type]


@pytest.mark.parametrize("given, seconds", [
    ("90s", 90), ("15m", 900), ("1h", 3600), ("1h30m", 5400), ("2d", 172800), ("1.5h", 5400),
    ("500ms", 0.5), ("1w", 604800), (45, 45), (2.5, 2.5), ("30", 30)])
def test_durations(given, seconds):
    assert parse_duration(given, "every") == seconds


@pytest.mark.parametrize("given", ["", "soon", "-5s", "0", "1x", "h", True, None, [1]])
def test_bad_durations_name_the_setting(given):
    with pytest.raises(ValueError) as caught:
        parse_duration(given, "misfire_grace")
    assert str(caught.value).startswith("misfire_grace: ")


def test_due_between_stops_at_its_limit():
    after = datetime.fromisoformat("2026-06-01T00:00+00:00")
    assert len(due_between(Every(1, UTC), after, after + timedelta(days=1), limit=5)) == 5
