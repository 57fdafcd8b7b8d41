"""The benchmark's task bodies, registered alike by workhorse (``bench_tasks.py``), Celery
(``celery_tasks.py``) and Dramatiq (``dramatiq_tasks.py``) under the same names. This
module imports none of them, so no worker carries another's modules (their memory is
compared too).

Each run appends one byte to the file named by $BENCH_COUNTER: the benchmark counts
finished tasks by that file's size (cheap, and identical for every worker).
"""
from __future__ import annotations

import os
import time

_fd: int | None = None


def count() -> None:
    global _fd
    if _fd is None:
        _fd = os.open(os.environ["BENCH_COUNTER"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(_fd, b".")


def noop() -> None:
    count()


def short_sleep(seconds: float) -> None:
    time.sleep(seconds)
    count()


def hold(seconds: float) -> None:
    """Note when it started (wall clock) in $BENCH_STARTS, then sleep."""
    with open(os.environ["BENCH_STARTS"], "a") as f:
        f.write(f"{time.time()}\n")
    time.sleep(seconds)


def add(x: int, y: int) -> int:
    return x + y


def stamp(sent: float) -> None:
    """Note how long after ``sent`` (wall clock) it started, in $BENCH_STARTS."""
    started = time.time()
    with open(os.environ["BENCH_STARTS"], "a") as f:
        f.write(f"{started - sent}\n")


#: Registered name → body, for every worker's tasks module.
TASKS = {"bench.noop": noop, "bench.sleep": short_sleep, "bench.hold": hold,
         "bench.add": add, "bench.stamp": stamp}
