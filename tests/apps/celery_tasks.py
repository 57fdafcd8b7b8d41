"""A plain Celery app, run by a real Celery worker in tests: workhorse's client must read
what a Celery worker stores."""
import os

from celery import Celery
from celery.contrib.testing import tasks as _testing  # noqa: F401 - registers celery.ping

app = Celery("celery_tasks", broker=os.environ.get("WH_CELERY_BROKER"),
             backend=os.environ.get("WH_CELERY_BACKEND"))
app.conf.update(task_default_queue=os.environ.get("WH_CELERY_QUEUE", "celery"),
                worker_hijack_root_logger=False, broker_connection_retry_on_startup=True,
                result_extended=os.environ.get("WH_CELERY_EXTENDED") == "1")


@app.task(name="celery_tasks.add")
def add(x, y):
    return x + y


@app.task(name="celery_tasks.fail")
def fail(message):
    raise ValueError(message)


# The same tasks as tests.apps.basic, under its names: a Celery worker consuming beside a
# workhorse worker (a fleet part-way through a migration) runs either's messages.
@app.task(name="tests.apps.basic.add")
def mirror_add(x, y):
    return x + y


@app.task(name="tests.apps.basic.collect", bind=True)
def mirror_collect(self, results):
    path = os.environ.get("WH_TEST_RUNLOG")
    if path:
        with open(path, "a") as f:
            f.write(f"collect {self.request.id} {os.getpid()}\n")
    return results


@app.task(name="tests.apps.basic.record", bind=True)
def mirror_record(self, seconds=0.0):
    import time
    path = os.environ.get("WH_TEST_RUNLOG")
    if path:
        with open(path, "a") as f:
            f.write(f"record {self.request.id} {os.getpid()}\n")
    time.sleep(seconds)
    return self.request.id


# Celery tasks that use Celery's own task API, for a workhorse worker running this app.
@app.task(name="celery_tasks.retry_once", bind=True)
def retry_once(self):
    if self.request.retries == 0:
        raise self.retry(countdown=0.1)
    return self.request.retries


@app.task(name="celery_tasks.whoami", bind=True)
def whoami(self):
    from celery import current_task
    return [self.request.id, self.request.delivery_info.get("routing_key"),
            current_task.request.id == self.request.id]


@app.task(name="celery_tasks.async_whoami", bind=True)
async def async_whoami(self, seconds=0.2):
    """An async def Celery task: its request is its own across the await."""
    import asyncio
    before = self.request.id
    await asyncio.sleep(seconds)
    return [before, self.request.id]


@app.task(name="celery_tasks.replaced", bind=True)
def replaced(self):
    raise self.replace(add.s(20, 22))


@app.task(name="celery_tasks.ignored")
def ignored():
    from celery.exceptions import Ignore
    raise Ignore()


def _note(task_id, label):
    import redis
    redis.Redis.from_url(os.environ["WH_CELERY_BACKEND"]).rpush(f"errback:{task_id}", label)


@app.task(name="celery_tasks.errback_old_style")
def errback_old_style(task_id, label):
    """Takes the failed task's id (one argument left once ``label`` is stored)."""
    _note(task_id, label)


@app.task(name="celery_tasks.errback_new_style")
def errback_new_style(request, exc, traceback, label):
    _note(request.id, f"{label}: {type(exc).__name__}")
