"""A Celery app with a beat_schedule, run by workhorse workers with -A (no beat)."""
import os
from datetime import timedelta

from celery import Celery
from celery.schedules import crontab, solar

app = Celery("celery_beat")
app.conf.update(timezone="Europe/Berlin", worker_hijack_root_logger=False,
                task_default_queue=os.environ.get("WH_CELERY_QUEUE", "celery"))
app.conf.beat_schedule = {
    "stamp every second": {"task": "celery_beat.stamp", "schedule": 1.0, "args": ("n",)},
    "stamp every 2 s": {"task": "celery_beat.stamp", "schedule": timedelta(seconds=2),
                        "args": ("td",), "options": {"expires": 30}},
    "office hours": {"task": "celery_beat.stamp", "args": ("cron",),
                     "schedule": crontab(minute="*/15", hour="9-17", day_of_week="mon-fri")},
}
if os.environ.get("WH_CELERY_SOLAR"):
    # (Celery's solar needs the ephem package to be built; its class is what counts here)
    app.conf.beat_schedule["sunrise"] = {"task": "celery_beat.stamp",
                                         "schedule": object.__new__(solar)}


@app.task(name="celery_beat.stamp", bind=True)
def stamp(self, label):
    with open(os.environ["WH_TEST_RUNLOG"], "a") as f:
        f.write(f"{label} {self.request.nominal_time.isoformat()} {self.request.schedule}\n")
    return label
