"""The benchmark's tasks for workhorse (``-A benchmarks.bench_tasks:app``); the bodies are
in ``task_bodies.py``, shared with Celery's and Dramatiq's."""
from __future__ import annotations

from benchmarks.task_bodies import TASKS
from workhorse import App

app = App("bench")
for _name, _body in TASKS.items():
    app.task(name=_name)(_body)
