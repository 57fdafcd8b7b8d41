"""Tier 2: a Celery app's beat_schedule, run by a workhorse worker with -A and no beat."""
from __future__ import annotations

import subprocess
import sys
from datetime import datetime
from zoneinfo import ZoneInfo

import pytest

from tests.conftest import ROOT, Worker, make_broker, wait_until, worker_env

pytestmark = pytest.mark.timeout(120)
celery = pytest.importorskip("celery")


def test_a_celery_apps_beat_schedule_runs_unchanged(tmp_path):
    broker = make_broker("sqlite", tmp_path)
    env = worker_env(broker, tmp_path)
    env["WH_CELERY_QUEUE"] = broker.queue
    worker = Worker(tmp_path, env, ["-A", "tests.apps.celery_beat:app"])
    runlog = tmp_path / "runs.log"

    def runs() -> list[list[str]]:
        return [line.split(" ", 2) for line in runlog.read_text().splitlines()] \
            if runlog.exists() else []
    try:
        worker.wait_ready()
        wait_until(lambda: sum(r[0] == "td" for r in runs()) >= 3, 30,
                   "three runs of the 2-second entry")
    finally:
        worker.kill()
    seconds = [datetime.fromisoformat(r[1]) for r in runs() if r[0] == "n"]
    twos = [datetime.fromisoformat(r[1]) for r in runs() if r[0] == "td"]
    assert len(seconds) >= 4 and len(set(seconds)) == len(seconds)
    assert all(t.tzinfo is not None and t.utcoffset() == ZoneInfo("Europe/Berlin").utcoffset(t)
               for t in seconds)                       # in the app's timezone
    assert all(int(t.timestamp()) % 2 == 0 and t.microsecond == 0 for t in twos)
    assert {r[2] for r in runs() if r[0] == "td"} == {"stamp every 2 s"}


def test_a_celery_crontab_keeps_its_meaning():
    from celery.schedules import crontab

    from workhorse.schedules.celery import _timing
    berlin = ZoneInfo("Europe/Berlin")
    cron = _timing(crontab(minute="*/15", hour="9-17", day_of_week="mon-fri"), berlin, "x")
    after = datetime(2026, 11, 27, 17, 50, tzinfo=berlin)       # a Friday
    assert cron.next_after(after).isoformat() == "2026-11-30T09:00:00+01:00"
    # Celery's crontab wants both day fields (Friday the 13th), where cron takes either.
    both = _timing(crontab(minute=0, hour=0, day_of_month=13, day_of_week="fri"), berlin, "x")
    assert both.next_after(after).isoformat() == "2027-08-13T00:00:00+02:00"


def test_a_solar_entry_stops_the_worker_with_exit_2(tmp_path):
    env = worker_env(make_broker("sqlite", tmp_path), tmp_path)
    env["WH_CELERY_SOLAR"] = "1"
    done = subprocess.run([sys.executable, "-m", "workhorse", "worker", "-A",
                           "tests.apps.celery_beat:app"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "Celery beat_schedule 'sunrise': schedule: solar schedules are not supported" in \
        done.stderr
