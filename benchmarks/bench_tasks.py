"""The same two tasks for workhorse and for Celery, under the same names.

Each run appends one byte to the file named by $BENCH_COUNTER: the benchmark counts
finished tasks by that file's size (cheap, and identical for both workers).
"""
from __future__ import annotations

import os
import time

from celery import Celery

from workhorse import App

_fd: int | None = None


def _count() -> None:
    global _fd
    if _fd is None:
        _fd = os.open(os.environ["BENCH_COUNTER"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(_fd, b".")


app = App("bench")
celery_app = Celery("bench")
celery_app.conf.update(
    broker_url=os.environ.get("CELERY_BROKER_URL"),
    result_backend=os.environ.get("BENCH_RESULTS"),       # throughput runs store none
    task_ignore_result=not os.environ.get("BENCH_RESULTS"),
    task_acks_late=os.environ.get("BENCH_ACKS_LATE", "true") == "true",
    worker_prefetch_multiplier=4, broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False)


def noop() -> None:
    _count()


def short_sleep(seconds: float) -> None:
    time.sleep(seconds)
    _count()


for fun, name in ((noop, "bench.noop"), (short_sleep, "bench.sleep")):
    app.task(name=name)(fun)
    celery_app.task(name=name)(fun)


@app.task(name="bench.hold")
def hold(seconds: float) -> None:
    """Note when it started (wall clock) in $BENCH_STARTS, then sleep."""
    with open(os.environ["BENCH_STARTS"], "a") as f:
        f.write(f"{time.time()}\n")
    time.sleep(seconds)


def add(x: int, y: int) -> int:
    return x + y


app.task(name="bench.add")(add)
celery_app.task(name="bench.add")(add)


def stamp(sent: float) -> None:
    """Note how long after ``sent`` (wall clock) it started, in $BENCH_STARTS."""
    started = time.time()
    with open(os.environ["BENCH_STARTS"], "a") as f:
        f.write(f"{started - sent}\n")


app.task(name="bench.stamp")(stamp)
celery_app.task(name="bench.stamp")(stamp)
