"""The benchmark's tasks for Celery (``-A benchmarks.celery_tasks:celery_app``), configured
as the benchmarks configure workhorse: prefetch multiplier 4 ($BENCH_PREFETCH_MULTIPLIER),
late acks unless $BENCH_ACKS_LATE is false, results only when $BENCH_RESULTS names a
store."""
from __future__ import annotations

import os

from celery import Celery

from benchmarks.task_bodies import TASKS

if os.environ.get("CELERY_BROKER_URL", "").startswith("sqlite:"):
    import workhorse  # noqa: F401 - registers its sqlite:// transport with kombu

celery_app = Celery("bench")
celery_app.conf.update(
    broker_url=os.environ.get("CELERY_BROKER_URL"),
    result_backend=os.environ.get("BENCH_RESULTS"),       # throughput runs store none
    task_ignore_result=not os.environ.get("BENCH_RESULTS"),
    task_acks_late=os.environ.get("BENCH_ACKS_LATE", "true") == "true",
    worker_prefetch_multiplier=int(os.environ.get("BENCH_PREFETCH_MULTIPLIER", "4")),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    # a quorum queue (benchmarks/throughput.py --broker quorum): Celery 5.5+ declares it so
    # and consumes it with a per-consumer prefetch
    task_default_queue_type=os.environ.get("BENCH_QUEUE_TYPE", "classic"),
    task_create_missing_queue_type=os.environ.get("BENCH_QUEUE_TYPE", "classic"))
if os.environ.get("BENCH_MASTER_NAME"):      # --broker sentinel: a sentinel list
    celery_app.conf.broker_transport_options = {"master_name": os.environ["BENCH_MASTER_NAME"]}
for _name, _body in TASKS.items():
    celery_app.task(name=_name)(_body)
