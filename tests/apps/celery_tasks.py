"""A plain Celery app, run by a real Celery worker in tests: workhorse's client must read
what a Celery worker stores."""
import os

from celery import Celery

app = Celery("celery_tasks", broker=os.environ.get("WH_CELERY_BROKER"),
             backend=os.environ.get("WH_CELERY_BACKEND"))
app.conf.update(task_default_queue=os.environ.get("WH_CELERY_QUEUE", "celery"),
                worker_hijack_root_logger=False, broker_connection_retry_on_startup=True)


@app.task(name="celery_tasks.add")
def add(x, y):
    return x + y


@app.task(name="celery_tasks.fail")
def fail(message):
    raise ValueError(message)
