"""Example tasks: ``workhorse worker -A workhorse.examples.tasks``.

With no settings this app uses the embedded SQLite broker and result store in the per-user
state directory, so ``python -m workhorse.examples.send`` (same user) reaches the worker.
"""
from __future__ import annotations

import time

from workhorse import App

app = App("examples")


@app.task
def add(x: float, y: float) -> float:
    return x + y


@app.task
def slow(seconds: float) -> float:
    """Sleep, then return how long it slept."""
    time.sleep(seconds)
    return seconds


@app.task(bind=True)
def whoami(self) -> dict[str, object]:
    """What a bound task sees of its own request."""
    return {"id": self.request.id, "retries": self.request.retries,
            "hostname": self.request.hostname}


@app.task
def fail(message: str) -> None:
    raise ValueError(message)
