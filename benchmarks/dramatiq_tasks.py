"""The benchmark's tasks for Dramatiq, on the broker and queue the benchmark names.

Dramatiq binds an actor to its broker and queue when the module is imported, so the
worker (``dramatiq benchmarks.dramatiq_tasks``) reads them from the environment:
$DRAMATIQ_BROKER_URL (redis://, amqp://, or a sentinel:// list with ?master_name=) and
$BENCH_QUEUE. ``actors(url, queue)`` makes the same actors for the producer side. The
task bodies are those of the workhorse and Celery tasks (``task_bodies.py``).
"""
from __future__ import annotations

import os
from typing import Any

import dramatiq
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.brokers.redis import RedisBroker
from redis.sentinel import Sentinel

from workhorse.urls import sentinels, split_master_name

from benchmarks.task_bodies import TASKS


def make_broker(url: str) -> dramatiq.Broker:
    if url.startswith("redis://"):
        return RedisBroker(url=url)
    if url.startswith("sentinel://"):     # workhorse's form: the sentinels, ?master_name=
        found, name = sentinels(url), split_master_name(url)[1]
        return RedisBroker(client=Sentinel(list(found.addresses)).master_for(name, db=found.db))
    if url.startswith("amqp://"):
        # kombu reads "//" as the virtual host "/"; pika wants it escaped.
        return RabbitmqBroker(url=url[:-2] + "/%2F" if url.endswith("//") else url)
    raise ValueError(f"Dramatiq has no broker for {url!r}")


def actors(broker: dramatiq.Broker, queue: str) -> dict[str, Any]:
    return {name: dramatiq.actor(fn, actor_name=name, queue_name=queue, broker=broker,
                                 max_retries=0)
            for name, fn in TASKS.items()}


if "DRAMATIQ_BROKER_URL" in os.environ:       # the worker's import
    broker = make_broker(os.environ["DRAMATIQ_BROKER_URL"])
    dramatiq.set_broker(broker)
    ACTORS = actors(broker, os.environ["BENCH_QUEUE"])
