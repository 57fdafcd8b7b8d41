"""Tier 1: what a child makes of the message it is given to run (no fork, no broker): a v1
body runs like v2, a body it cannot read is reported MALFORMED and nothing is stored (the
supervisor stores the failure as it dead-letters the message)."""
from __future__ import annotations

import contextlib
import json

import pytest

from workhorse import App
from workhorse._state import clear_contexts
from workhorse.outcome import Outcome
from workhorse.pool.execute import TaskExecution
from workhorse.pool.ipc import Job
from workhorse.protocol import build_message

pytestmark = pytest.mark.timeout(10)


@pytest.fixture
def app(tmp_path):
    app = App("decode", broker_url="memory://",
              result_backend=f"sqlite:///{tmp_path / 'r.sqlite3'}", state_dir=str(tmp_path))
    app.configure()
    yield app
    app.close()
    clear_contexts()


def job(task: str, body: bytes, headers: dict, content_type: str = "application/json") -> Job:
    return Job(1, task, body, content_type, "utf-8", headers, {"routing_key": "q"},
               track_started=False, queue="q")


def execute(app: App, the_job: Job):
    return TaskExecution(app, the_job, "w@test", contextlib.nullcontext, lambda frame: None).run()


def test_a_v1_body_runs_with_the_request_it_stands_for(app):
    seen = {}

    @app.task(bind=True, name="t.add")
    def add(self, x, y):
        seen.update(id=self.request.id, group=self.request.group, retries=self.request.retries)
        return x + y
    body = json.dumps({"task": "t.add", "id": "v1-id", "args": [2, 3], "kwargs": {},
                       "retries": 1, "eta": None, "expires": None, "utc": True,
                       "callbacks": None, "errbacks": None, "chord": None, "taskset": "g",
                       "timelimit": [None, None]}).encode()
    finished = execute(app, job("t.add", body, {}))
    assert finished.outcome is Outcome.SUCCEEDED
    assert seen == {"id": "v1-id", "group": "g", "retries": 1}
    assert app.backend.get_task_meta("v1-id")["result"] == 5


@pytest.mark.parametrize("body, content_type, why", [
    (b"this is not json", "application/json", "not valid"),
    (b"\x80\x04K\x01.", "application/x-python-serialize", "not accepted"),
    (b'{"args": [1]}', "application/json", "triple"),
])
def test_a_body_the_child_cannot_read_is_reported_malformed_and_nothing_stored(
        app, body, content_type, why):
    ran = []

    @app.task(name="t.add")
    def add(x, y):
        ran.append((x, y))
    headers = build_message("t.add", "bad-id", [1, 2]).headers
    finished = execute(app, job("t.add", body, headers, content_type))
    assert finished.outcome is Outcome.MALFORMED and why in (finished.detail or "")
    assert ran == [] and app.backend.get_task_meta("bad-id")["status"] == "PENDING"
