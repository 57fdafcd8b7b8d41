"""The I/O-bound benchmark's tasks for the peers (``benchmarks/async_io.py``), and the
record every system's task writes (workhorse's are in ``async_tasks.py``).

Each peer's objects are made only when asked for (the module imports none of the
systems), so a worker carries only its own system's modules (their memory is compared):

- Celery: ``celery -A benchmarks.async_peers:celery_app worker -P gevent|prefork``; its
  task is sync, ``time.sleep`` (under the gevent pool, which monkeypatches, a wait gives
  way to the other greenlets; under prefork it holds its process).
- Dramatiq: ``dramatiq benchmarks.async_peers:dramatiq_broker`` (its CLI calls the
  function, in each worker process too); the broker is Redis with the AsyncIO middleware,
  its actor ``async def``; $BENCH_NAMESPACE prefixes its keys.
- arq: ``python -m benchmarks.async_peers arq`` (arq's ``run_worker`` with arq's logging
  at WARNING, as the other workers run; its own CLI logs two lines at INFO per job);
  ``max_jobs`` from $BENCH_ARQ_MAX_JOBS, results not kept.

All take the queue from $BENCH_QUEUE and the broker from $BENCH_BROKER_URL (Redis).

Every task appends two fixed-size records to the file named by $BENCH_EVENTS: ``S`` and
the wall-clock time when it starts, ``E`` and the time when its wait ends. ``O_APPEND``
writes of one record are atomic, so the file is also the order of the events across
processes (for the peak in flight).
"""
from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Any

#: One record: kind, a space, time.time() in 17 characters, a newline.
RECORD_SIZE = 20
_fd: int | None = None


def record(kind: str) -> None:
    global _fd
    if _fd is None:
        _fd = os.open(os.environ["BENCH_EVENTS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(_fd, f"{kind} {time.time():17.6f}\n".encode())


def sync_wait(seconds: float) -> None:
    record("S")
    time.sleep(seconds)
    record("E")


async def async_wait(seconds: float) -> None:
    record("S")
    await asyncio.sleep(seconds)
    record("E")


async def arq_wait(ctx: dict[str, Any], seconds: float) -> None:
    await async_wait(seconds)


def max_connections() -> int:
    """The Redis connection pool's size for Celery's and Dramatiq's workers: one for each
    wait in flight and then some. Their defaults are too small for 1,000 waits at once:
    kombu's Redis channel allows 10 connections (Celery's gevent pool then fails acks with
    MaxConnectionsError, leaving the messages unacked), and redis-py 8's pool 100 (each of
    Dramatiq's 500 worker threads acks on its own connection, and its acks fail and wait 5
    s to be retried)."""
    return int(os.environ.get("BENCH_MAX_CONNECTIONS", "1100"))


def _celery_app() -> Any:
    from celery import Celery
    app = Celery("bench-aio")
    app.conf.update(
        broker_url=os.environ["BENCH_BROKER_URL"], task_ignore_result=True,
        task_acks_late=True, worker_prefetch_multiplier=4,
        broker_connection_retry_on_startup=True, worker_hijack_root_logger=False,
        worker_enable_remote_control=False,       # no pidbox keys in the shared database
        broker_transport_options={"max_connections": max_connections()})
    app.task(name="aio.wait")(sync_wait)
    return app


def dramatiq_broker(url: str | None = None, queue: str | None = None,
                    namespace: str | None = None) -> Any:
    """The Redis broker with the AsyncIO middleware and the actor ``aio.wait`` on the
    queue; the worker's from the environment, the producer's from the arguments."""
    import dramatiq
    from dramatiq.brokers.redis import RedisBroker
    from dramatiq.middleware.asyncio import AsyncIO
    import redis
    pool = redis.ConnectionPool.from_url(url or os.environ["BENCH_BROKER_URL"],
                                         max_connections=max_connections())
    broker = RedisBroker(connection_pool=pool,
                         namespace=namespace or os.environ["BENCH_NAMESPACE"])
    broker.add_middleware(AsyncIO())
    dramatiq.set_broker(broker)
    dramatiq.actor(actor_name="aio.wait", broker=broker, max_retries=0,
                   queue_name=queue or os.environ["BENCH_QUEUE"])(async_wait)
    return broker


def arq_settings() -> dict[str, Any]:
    from arq import func
    from arq.connections import RedisSettings
    return {"functions": [func(arq_wait, name="aio.wait", keep_result=0, max_tries=1)],
            "queue_name": os.environ["BENCH_QUEUE"],
            "redis_settings": RedisSettings.from_dsn(os.environ["BENCH_BROKER_URL"]),
            "max_jobs": int(os.environ.get("BENCH_ARQ_MAX_JOBS", "1000")),
            "keep_result": 0}


_celery: Any = None


def __getattr__(name: str) -> Any:
    """``celery_app``, for Celery's ``-A module:attribute``, made on first use."""
    global _celery
    if name == "celery_app":
        if _celery is None:
            _celery = _celery_app()
        return _celery
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main() -> int:
    if sys.argv[1:] != ["arq"]:
        print("usage: python -m benchmarks.async_peers arq", file=sys.stderr)
        return 2
    import logging

    from arq import run_worker
    logging.basicConfig(level=logging.WARNING)
    run_worker(arq_settings())
    return 0


if __name__ == "__main__":
    sys.exit(main())
