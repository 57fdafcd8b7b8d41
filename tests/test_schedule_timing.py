"""Due times with no clock and no broker: cron fields and macros, the day rules (cron's either,
Celery's both), daylight-saving changes in Berlin and New York (spring gap, autumn repeat),
epoch-anchored intervals, durations and due_between.

The expected times around DST changes are worked out by hand from the rules in
workhorse/schedules/timing.py: a local time in the spring gap is read with the offset before
the gap; a repeated autumn time fires only at its first occurrence; each instant fires once.
"""
from __future__ import annotations

import itertools
import math
import re
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from workhorse.schedules.timing import Cron, Every, Timing, due_between, parse_duration

pytestmark = pytest.mark.timeout(60)

BERLIN = ZoneInfo("Europe/Berlin")
NEW_YORK = ZoneInfo("America/New_York")
ZULU = ZoneInfo("UTC")


def at(text: str) -> datetime:
    return datetime.fromisoformat(text)


def following(timing: Timing, after: str, count: int) -> list[str]:
    """The next ``count`` due times after ``after``, each found from the one before."""
    moment, found = at(after), []
    for _ in range(count):
        moment = timing.next_after(moment)
        found.append(moment.isoformat())
    return found


def between(timing: Timing, after: str, until: str, limit: int | None = None) -> list[str]:
    return [moment.isoformat() for moment in due_between(timing, at(after), at(until), limit)]


def gaps(moments: list[datetime]) -> list[timedelta]:
    instants = [moment.astimezone(UTC) for moment in moments]
    return [later - earlier for earlier, later in itertools.pairwise(instants)]


# --- daylight saving: Europe/Berlin (2027-03-28 02:00 CET -> 03:00 CEST;
#     2026-10-25 03:00 CEST -> 02:00 CET) ---

def test_berlin_daily_in_the_spring_gap_fires_an_hour_later():
    daily = Cron("30 2 * * *", BERLIN)
    assert following(daily, "2027-03-27T12:00+01:00", 2) == [
        "2027-03-28T03:30:00+02:00", "2027-03-29T02:30:00+02:00"]


def test_berlin_daily_in_the_repeated_hour_fires_once():
    daily = Cron("30 2 * * *", BERLIN)
    assert following(daily, "2026-10-24T12:00+02:00", 2) == [
        "2026-10-25T02:30:00+02:00", "2026-10-26T02:30:00+01:00"]
    # From inside the second pass (02:40+01:00), the one of that day has passed.
    assert following(daily, "2026-10-25T02:40+01:00", 1) == ["2026-10-26T02:30:00+01:00"]


def test_berlin_hourly_over_both_changes():
    hourly = Cron("0 * * * *", BERLIN)
    # 02:00 does not exist: read as 01:00 UTC, which is 03:00+02:00; local 03:00 is the same
    # instant and fires once.
    assert following(hourly, "2027-03-28T00:30+01:00", 3) == [
        "2027-03-28T01:00:00+01:00", "2027-03-28T03:00:00+02:00", "2027-03-28T04:00:00+02:00"]
    # 02:00 happens twice: only the first time (00:00 UTC), then 03:00+01:00 (02:00 UTC).
    assert following(hourly, "2026-10-24T23:30+02:00", 5) == [
        "2026-10-25T00:00:00+02:00", "2026-10-25T01:00:00+02:00", "2026-10-25T02:00:00+02:00",
        "2026-10-25T03:00:00+01:00", "2026-10-25T04:00:00+01:00"]
    # Asked from inside the second pass, the next one is 03:00+01:00 too.
    assert following(hourly, "2026-10-25T02:15+01:00", 1) == ["2026-10-25T03:00:00+01:00"]


def test_berlin_half_hourly_around_the_gap_fires_each_instant_once():
    # Local 02:00 and 02:30 map to 03:00+02:00 and 03:30+02:00, as local 03:00 and 03:30 do.
    assert following(Cron("*/30 * * * *", BERLIN), "2027-03-28T00:45+01:00", 6) == [
        "2027-03-28T01:00:00+01:00", "2027-03-28T01:30:00+01:00",
        "2027-03-28T03:00:00+02:00", "2027-03-28T03:30:00+02:00",
        "2027-03-28T04:00:00+02:00", "2027-03-28T04:30:00+02:00"]


def test_berlin_quarter_hourly_over_48_hours_of_each_change():
    quarter = Cron("*/15 * * * *", BERLIN)
    spring = due_between(quarter, at("2027-03-27T00:00+01:00"), at("2027-03-29T00:00+02:00"))
    # 47 hours of absolute time (the day lost an hour), a due time every 15 minutes.
    assert len(spring) == 47 * 4
    assert set(gaps(spring)) == {timedelta(minutes=15)}
    assert spring[0].isoformat() == "2027-03-27T00:15:00+01:00"
    assert spring[-1].isoformat() == "2027-03-29T00:00:00+02:00"

    autumn = due_between(quarter, at("2026-10-24T00:00+02:00"), at("2026-10-26T00:00+01:00"))
    # 49 hours of absolute time; the repeated hour's second pass (4 quarters) does not fire.
    assert len(autumn) == 49 * 4 - 4
    steps = gaps(autumn)
    assert steps.count(timedelta(minutes=75)) == 1
    assert set(steps) == {timedelta(minutes=15), timedelta(minutes=75)}
    jump = steps.index(timedelta(minutes=75))
    assert [autumn[jump].isoformat(), autumn[jump + 1].isoformat()] == [
        "2026-10-25T02:45:00+02:00", "2026-10-25T03:00:00+01:00"]
    for found in (spring, autumn):
        instants = [moment.astimezone(UTC) for moment in found]
        assert instants == sorted(set(instants))
        assert all(moment.tzinfo is BERLIN for moment in found)


# --- daylight saving: America/New_York (2027-03-14 02:00 EST -> 03:00 EDT;
#     2026-11-01 02:00 EDT -> 01:00 EST) ---

def test_new_york_spring_gap():
    assert following(Cron("30 2 * * *", NEW_YORK), "2027-03-13T12:00-05:00", 2) == [
        "2027-03-14T03:30:00-04:00", "2027-03-15T02:30:00-04:00"]
    assert following(Cron("30 1 * * *", NEW_YORK), "2027-03-13T12:00-05:00", 2) == [
        "2027-03-14T01:30:00-05:00", "2027-03-15T01:30:00-04:00"]
    assert following(Cron("0 * * * *", NEW_YORK), "2027-03-13T23:30-05:00", 4) == [
        "2027-03-14T00:00:00-05:00", "2027-03-14T01:00:00-05:00",
        "2027-03-14T03:00:00-04:00", "2027-03-14T04:00:00-04:00"]
    assert following(Cron("*/30 * * * *", NEW_YORK), "2027-03-14T00:45-05:00", 5) == [
        "2027-03-14T01:00:00-05:00", "2027-03-14T01:30:00-05:00",
        "2027-03-14T03:00:00-04:00", "2027-03-14T03:30:00-04:00",
        "2027-03-14T04:00:00-04:00"]


def test_new_york_autumn_repeat():
    assert following(Cron("30 1 * * *", NEW_YORK), "2026-10-31T12:00-04:00", 2) == [
        "2026-11-01T01:30:00-04:00", "2026-11-02T01:30:00-05:00"]
    assert following(Cron("30 2 * * *", NEW_YORK), "2026-10-31T12:00-04:00", 2) == [
        "2026-11-01T02:30:00-05:00", "2026-11-02T02:30:00-05:00"]
    assert following(Cron("0 * * * *", NEW_YORK), "2026-10-31T23:30-04:00", 4) == [
        "2026-11-01T00:00:00-04:00", "2026-11-01T01:00:00-04:00",
        "2026-11-01T02:00:00-05:00", "2026-11-01T03:00:00-05:00"]
    assert following(Cron("*/30 * * * *", NEW_YORK), "2026-11-01T00:15-04:00", 5) == [
        "2026-11-01T00:30:00-04:00", "2026-11-01T01:00:00-04:00",
        "2026-11-01T01:30:00-04:00", "2026-11-01T02:00:00-05:00",
        "2026-11-01T02:30:00-05:00"]


def test_a_half_hour_gap_can_put_a_later_wall_time_first():
    """Australia/Lord_Howe, 2026-10-04: 02:00+10:30 becomes 02:30+11:00. Local 02:20 does not
    exist: read with +10:30 it is 02:50+11:00, later than the real 02:40+11:00."""
    lord_howe = ZoneInfo("Australia/Lord_Howe")
    assert following(Cron("20,40 * * * *", lord_howe), "2026-10-04T01:50+10:30", 4) == [
        "2026-10-04T02:40:00+11:00", "2026-10-04T02:50:00+11:00",
        "2026-10-04T03:20:00+11:00", "2026-10-04T03:40:00+11:00"]


def test_a_day_long_jump_is_handled_too():
    """Samoa skipped 2011-12-30 (-10:00 -> +14:00 at 10:00 UTC): noon on the 30th is read
    with -10:00, which is noon on the 31st, and fires once."""
    apia = ZoneInfo("Pacific/Apia")
    assert following(Cron("0 12 * * *", apia), "2011-12-29T16:00+00:00", 3) == [
        "2011-12-29T12:00:00-10:00", "2011-12-31T12:00:00+14:00", "2012-01-01T12:00:00+14:00"]
    # Asked after the jump, when the wall clock already shows the 31st, 06:00.
    assert following(Cron("0 12 30 12 *", apia), "2011-12-30T16:00+00:00", 1) == [
        "2011-12-31T12:00:00+14:00"]


def test_after_may_be_in_any_zone_and_must_be_aware():
    daily = Cron("30 2 * * *", BERLIN)
    assert daily.next_after(at("2027-03-28T01:29:59+00:00")).isoformat() == (
        "2027-03-28T03:30:00+02:00")
    assert daily.next_after(at("2027-03-28T01:30:00+00:00")).isoformat() == (
        "2027-03-29T02:30:00+02:00")
    with pytest.raises(ValueError, match="aware"):
        daily.next_after(datetime(2027, 3, 28))
    with pytest.raises(ValueError, match="aware"):
        Every(60, BERLIN).next_after(datetime(2027, 3, 28))


# --- fields ---

def test_names_are_case_insensitive_and_7_is_sunday():
    weekdays = Cron("0 9 * jan,JUL Mon-Fri", ZULU)
    assert following(weekdays, "2026-06-30T12:00+00:00", 4) == [
        "2026-07-01T09:00:00+00:00", "2026-07-02T09:00:00+00:00",
        "2026-07-03T09:00:00+00:00", "2026-07-06T09:00:00+00:00"]
    for sunday in ("0", "7", "sun", "SUN"):          # 2026-03-08 is a Sunday
        assert following(Cron(f"0 0 * * {sunday}", ZULU), "2026-03-04T00:00+00:00", 1) == [
            "2026-03-08T00:00:00+00:00"]
    assert following(Cron("0 0 * * 5-7", ZULU), "2026-03-02T00:00+00:00", 4) == [
        "2026-03-06T00:00:00+00:00", "2026-03-07T00:00:00+00:00",
        "2026-03-08T00:00:00+00:00", "2026-03-13T00:00:00+00:00"]


def test_steps_lists_and_start_slash_step():
    hour = ("2026-05-01T00:00+00:00", "2026-05-01T01:00+00:00")
    assert between(Cron("5/20 * * * *", ZULU), *hour) == [
        "2026-05-01T00:05:00+00:00", "2026-05-01T00:25:00+00:00", "2026-05-01T00:45:00+00:00"]
    assert between(Cron("10-40/10 * * * *", ZULU), *hour) == [
        "2026-05-01T00:10:00+00:00", "2026-05-01T00:20:00+00:00",
        "2026-05-01T00:30:00+00:00", "2026-05-01T00:40:00+00:00"]
    assert between(Cron("0,30 */6 * * *", ZULU), "2026-05-01T00:00+00:00",
                   "2026-05-01T12:00+00:00") == [
        "2026-05-01T00:30:00+00:00", "2026-05-01T06:00:00+00:00",
        "2026-05-01T06:30:00+00:00", "2026-05-01T12:00:00+00:00"]
    assert between(Cron("0 0 1 */4,dec *", ZULU), "2026-01-01T00:00+00:00",
                   "2027-01-01T00:00+00:00") == [
        "2026-05-01T00:00:00+00:00", "2026-09-01T00:00:00+00:00",
        "2026-12-01T00:00:00+00:00", "2027-01-01T00:00:00+00:00"]


def test_macros_and_whitespace():
    after = "2026-03-04T10:20+00:00"                   # a Wednesday
    assert following(Cron("@hourly", ZULU), after, 1) == ["2026-03-04T11:00:00+00:00"]
    assert following(Cron("@daily", ZULU), after, 1) == ["2026-03-05T00:00:00+00:00"]
    assert following(Cron("@midnight", ZULU), after, 1) == ["2026-03-05T00:00:00+00:00"]
    assert following(Cron("@weekly", ZULU), after, 1) == ["2026-03-08T00:00:00+00:00"]
    assert following(Cron("@monthly", ZULU), after, 1) == ["2026-04-01T00:00:00+00:00"]
    assert following(Cron("@yearly", ZULU), after, 1) == ["2027-01-01T00:00:00+00:00"]
    assert following(Cron("@annually", ZULU), after, 1) == ["2027-01-01T00:00:00+00:00"]
    spaced = Cron("  30 \t2  *   * *\n", BERLIN)
    assert spaced.expression == "30 2 * * *"
    assert spaced.describe() == "cron '30 2 * * *' in Europe/Berlin"
    assert Cron("@daily", ZULU).describe() == "cron '@daily' in UTC"


# --- the day rules ---

def test_cron_takes_either_day_field_when_both_are_restricted():
    either = Cron("0 0 13 * 5", ZULU)                 # the 13th, and every Friday
    assert following(either, "2026-02-01T00:00+00:00", 6) == [
        "2026-02-06T00:00:00+00:00", "2026-02-13T00:00:00+00:00",
        "2026-02-20T00:00:00+00:00", "2026-02-27T00:00:00+00:00",
        "2026-03-06T00:00:00+00:00", "2026-03-13T00:00:00+00:00"]
    assert following(either, "2026-04-04T00:00+00:00", 3) == [
        "2026-04-10T00:00:00+00:00", "2026-04-13T00:00:00+00:00",   # a Monday, the 13th
        "2026-04-17T00:00:00+00:00"]
    # A field that starts with "*" is not restricted: then both must match.
    assert following(Cron("0 0 * * 5", ZULU), "2026-02-01T00:00+00:00", 2) == [
        "2026-02-06T00:00:00+00:00", "2026-02-13T00:00:00+00:00"]
    assert following(Cron("0 0 */2 * 5", ZULU), "2026-02-01T00:00+00:00", 2) == [
        "2026-02-13T00:00:00+00:00", "2026-02-27T00:00:00+00:00"]     # odd-day Fridays
    # "1-31" is written out, so it counts as restricted: every day is due.
    assert following(Cron("0 0 1-31 * 5", ZULU), "2026-02-01T00:00+00:00", 2) == [
        "2026-02-02T00:00:00+00:00", "2026-02-03T00:00:00+00:00"]


def test_celery_crontab_fields_take_both_day_fields():
    every_day = range(1, 32)
    months = range(1, 13)
    friday_13th = Cron.from_fields([0], [0], [13], months, [5], BERLIN, days_both=True)
    assert following(friday_13th, "2026-02-01T00:00+01:00", 4) == [
        "2026-02-13T00:00:00+01:00", "2026-03-13T00:00:00+01:00",
        "2026-11-13T00:00:00+01:00", "2027-08-13T00:00:00+02:00"]
    assert friday_13th.describe() == "cron '0 0 13 * 5' in Europe/Berlin"
    # Without days_both, as cron: either field (both are restricted here).
    either = Cron.from_fields([0], [0], [13], months, [5], BERLIN, days_both=False)
    assert following(either, "2026-02-01T00:00+01:00", 2) == [
        "2026-02-06T00:00:00+01:00", "2026-02-13T00:00:00+01:00"]
    weekdays = Cron.from_fields(range(0, 60, 15), [9], every_day, months, [1, 2, 3, 4, 5],
                                BERLIN, days_both=True, text="crontab(*/15 9 * * mon-fri)")
    assert weekdays.describe() == "crontab(*/15 9 * * mon-fri) in Europe/Berlin"
    assert following(weekdays, "2026-11-27T09:50+01:00", 2) == [       # a Friday
        "2026-11-30T09:00:00+01:00", "2026-11-30T09:15:00+01:00"]
    sunday = Cron.from_fields([0], [0], every_day, months, [7], ZULU, days_both=True)
    assert following(sunday, "2026-03-04T00:00+00:00", 1) == ["2026-03-08T00:00:00+00:00"]


def test_leap_day_crons_skip_whole_years():
    # (Days that cannot match are skipped, not scanned minute by minute: the cost is a
    # benchmark's question, not a test's.)
    leap = Cron("0 0 29 2 *", ZULU)
    found = following(leap, "2026-01-01T00:00+00:00", 20)
    # 2028 ... 2096 every four years (18), then 2104 (2100 is not a leap year), 2108.
    assert found[:2] == ["2028-02-29T00:00:00+00:00", "2032-02-29T00:00:00+00:00"]
    assert found[-3:] == ["2096-02-29T00:00:00+00:00", "2104-02-29T00:00:00+00:00",
                          "2108-02-29T00:00:00+00:00"]
    # Celery's both-fields rule: Feb 29 on a Monday (2016, then every 28 years until 2100).
    monday = Cron.from_fields([0], [0], [29], [2], [1], ZULU, days_both=True)
    found = following(monday, "2016-03-01T00:00+00:00", 2)
    assert found == ["2044-02-29T00:00:00+00:00", "2072-02-29T00:00:00+00:00"]


# --- errors ---

@pytest.mark.parametrize(("expression", "message"), [
    ("61 * * * *", "cron '61 * * * *': minute field '61': 61 is out of range 0-59"),
    ("* 24 * * *", "hour field '24': 24 is out of range 0-23"),
    ("* * 0 * *", "day-of-month field '0': 0 is out of range 1-31"),
    ("* * 32 * *", "day-of-month field '32': 32 is out of range 1-31"),
    ("* * * 13 *", "month field '13': 13 is out of range 1-12"),
    ("* * * foo *", "month field 'foo': 'foo' is not a number or month name"),
    ("* * * * 8", "day-of-week field '8': 8 is out of range 0-7"),
    ("* * * * funday", "day-of-week field 'funday': 'funday' is not a number or weekday"),
    ("x * * * *", "minute field 'x': 'x' is not a number"),
    ("5-1 * * * *", "minute field '5-1': range '5-1' runs backwards"),
    ("* * * * fri-mon", "day-of-week field 'fri-mon': range 'fri-mon' runs backwards"),
    ("*/0 * * * *", "minute field '*/0': step 0"),
    ("* 1-5/0 * * *", "hour field '1-5/0': step 0"),
    ("* */x * * *", "hour field '*/x': step 'x' is not a number"),
    ("1,,2 * * * *", "minute field '1,,2': an empty item"),
    ("-5 * * * *", "minute field '-5': a value is missing"),
    ("L * * * *", "minute field 'L': 'L' is not a number"),
    ("* * *", "cron '* * *': expected 5 fields (minute hour day-of-month month day-of-week), "
              "got 3"),
    ("* * * * * *", "expected 5 fields (minute hour day-of-month month day-of-week), got 6"),
    ("", "expected 5 fields (minute hour day-of-month month day-of-week), got 0"),
    ("@reboot", "cron '@reboot': @reboot is not a schedule"),
    ("@fortnightly", "cron '@fortnightly': unknown macro"),
    ("0 0 30 2 *", "cron '0 0 30 2 *': never due (no such day)"),
    ("0 0 31 4 *", "cron '0 0 31 4 *': never due (no such day)"),
    ("0 0 30,31 2 *", "never due (no such day)"),
    ("0 0 31 2,4,6,9,11 *", "never due (no such day)"),
])
def test_bad_cron_expressions(expression, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Cron(expression, BERLIN)


def test_rare_but_real_days_are_accepted():
    for expression in ("0 0 29 2 *", "0 0 31 2,3 *", "0 0 30 2 5", "59 23 31 12 sat"):
        Cron(expression, BERLIN)


@pytest.mark.parametrize(("fields", "message"), [
    (([60], [0], [1], [1], [0]), "minute field: 60 is out of range 0-59"),
    (([0], [24], [1], [1], [0]), "hour field: 24 is out of range 0-23"),
    (([0], [0], [0], [1], [0]), "day-of-month field: 0 is out of range 1-31"),
    (([0], [0], [1], [13], [0]), "month field: 13 is out of range 1-12"),
    (([0], [0], [1], [1], [8]), "day-of-week field: 8 is out of range 0-7"),
    (([], [0], [1], [1], [0]), "minute field: no values"),
    (([0], [0], [30], [2], range(7)), "never due (no such day)"),
])
def test_bad_crontab_fields(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Cron.from_fields(*fields, BERLIN, days_both=True, text="crontab(x)")


def test_celery_both_rule_can_be_never_due_where_cron_is_not():
    # Feb 30 or any Friday is due as cron; Feb 30 and a Friday never is.
    Cron.from_fields([0], [0], [30], [2], [5], ZULU, days_both=False)
    with pytest.raises(ValueError, match="never due"):
        Cron.from_fields([0], [0], [30], [2], [5], ZULU, days_both=True)


# --- Every ---

def test_every_is_anchored_at_the_epoch():
    every = Every(90, ZULU)
    assert every.seconds == 90.0
    assert every.describe() == "every 90 s"
    # 2026-01-01T00:00Z is 1767225600 s after the epoch, a multiple of 90: strictly after.
    assert following(every, "2026-01-01T00:00:00+00:00", 2) == [
        "2026-01-01T00:01:30+00:00", "2026-01-01T00:03:00+00:00"]
    assert following(every, "2026-01-01T00:00:01+00:00", 1) == ["2026-01-01T00:01:30+00:00"]
    # tz only decides how the result is shown.
    assert following(Every(90, BERLIN), "2026-01-01T00:00:00+01:00", 1) == [
        "2026-01-01T00:01:30+01:00"]


def test_every_with_an_anchor():
    hourly = Every(3600, BERLIN, anchor=datetime(2026, 1, 1, 0, 17))    # naive: Berlin time
    assert hourly.describe() == "every 3600 s from 2026-01-01T00:17:00+01:00"
    assert following(hourly, "2026-07-01T12:00+02:00", 2) == [
        "2026-07-01T12:17:00+02:00", "2026-07-01T13:17:00+02:00"]
    aware = Every(600, ZULU, anchor=at("2026-01-01T00:03:00+00:00"))
    assert following(aware, "1999-12-31T23:59:00+00:00", 1) == ["2000-01-01T00:03:00+00:00"]


def test_every_workers_agree_whenever_they_start():
    every = Every(433, ZULU)
    until = at("2026-05-01T02:00+00:00")
    early = due_between(every, at("2026-05-01T00:00+00:00"), until)
    late = due_between(every, at("2026-05-01T00:16:40+00:00"), until)
    assert late == [moment for moment in early if moment > at("2026-05-01T00:16:40+00:00")]
    assert set(gaps(early)) == {timedelta(seconds=433)}
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    assert all((moment - epoch) % timedelta(seconds=433) == timedelta(0) for moment in early)


def test_every_ignores_daylight_saving():
    half = Every(1800, BERLIN)
    spring = between(half, "2027-03-28T00:00+01:00", "2027-03-28T05:00+02:00")
    assert spring == [
        "2027-03-28T00:30:00+01:00", "2027-03-28T01:00:00+01:00", "2027-03-28T01:30:00+01:00",
        "2027-03-28T03:00:00+02:00", "2027-03-28T03:30:00+02:00", "2027-03-28T04:00:00+02:00",
        "2027-03-28T04:30:00+02:00", "2027-03-28T05:00:00+02:00"]
    autumn = due_between(half, at("2026-10-25T01:00+02:00"), at("2026-10-25T04:00+01:00"))
    assert [moment.isoformat() for moment in autumn] == [
        "2026-10-25T01:30:00+02:00", "2026-10-25T02:00:00+02:00", "2026-10-25T02:30:00+02:00",
        "2026-10-25T02:00:00+01:00", "2026-10-25T02:30:00+01:00", "2026-10-25T03:00:00+01:00",
        "2026-10-25T03:30:00+01:00", "2026-10-25T04:00:00+01:00"]
    assert set(gaps(autumn)) == {timedelta(seconds=1800)}


def test_every_is_exact_for_fractions_of_a_second():
    tenth = Every(0.1, ZULU)
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    # 0.3 / 0.1 is 2.9999999999999996 in floats: a float grid would answer 0.3 again.
    assert tenth.next_after(epoch + timedelta(seconds=0.3)) == epoch + timedelta(seconds=0.4)
    assert tenth.describe() == "every 0.1 s"


@pytest.mark.parametrize("seconds", [0, -1, -0.5, math.nan, math.inf, True, "90", 1e-9])
def test_every_refuses_a_bad_interval(seconds):
    with pytest.raises(ValueError, match="every: the interval must be"):
        Every(seconds, ZULU)


# --- parse_duration ---

@pytest.mark.parametrize(("value", "seconds"), [
    ("90s", 90.0), ("15m", 900.0), ("1h", 3600.0), ("1h30m", 5400.0), ("2d", 172800.0),
    ("1.5h", 5400.0), ("500ms", 0.5), ("1w", 604800.0), ("1d2h3m4s", 93784.0),
    (" 1h 30m ", 5400.0), ("90", 90.0), ("2.5", 2.5), (90, 90.0), (0.25, 0.25),
])
def test_parse_duration(value, seconds):
    assert parse_duration(value, "every") == seconds


@pytest.mark.parametrize("value", [
    "", "   ", "0", "0s", "-5", "-5s", "5x", "h", "1h-30m", "soon", "1.2.3s", "inf", "nan",
    0, -3, math.nan, math.inf, True, None, [5], timedelta(seconds=5),
])
def test_parse_duration_refuses(value):
    with pytest.raises(ValueError, match="^misfire_grace: ") as caught:
        parse_duration(value, "misfire_grace")
    assert str(caught.value).endswith(f"got '{value}'")


# --- due_between ---

def test_due_between_bounds_and_limit():
    hourly = Cron("0 * * * *", ZULU)
    window = ("2026-01-01T00:00+00:00", "2026-01-01T10:00+00:00")
    everything = between(hourly, *window)
    assert len(everything) == 10                         # 01:00 ... 10:00: after <, <= until
    assert everything[0] == "2026-01-01T01:00:00+00:00"
    assert everything[-1] == "2026-01-01T10:00:00+00:00"
    assert between(hourly, *window, limit=3) == everything[:3]
    assert between(hourly, *window, limit=0) == []
    assert between(hourly, window[1], window[0]) == []
    assert between(Every(600, ZULU), *window, limit=2) == [
        "2026-01-01T00:10:00+00:00", "2026-01-01T00:20:00+00:00"]


def test_due_between_compares_instants_not_wall_times():
    """In the repeated hour 02:00+01:00 comes after 02:45+02:00, though its wall time is
    earlier (and two datetimes in one zone compare by wall time)."""
    quarter = Every(900, BERLIN)
    until = datetime(2026, 10, 25, 2, 45, tzinfo=BERLIN)         # fold=0: 02:45+02:00
    found = due_between(quarter, at("2026-10-25T02:00+02:00"), until)
    assert [moment.isoformat() for moment in found] == [
        "2026-10-25T02:15:00+02:00", "2026-10-25T02:30:00+02:00", "2026-10-25T02:45:00+02:00"]
