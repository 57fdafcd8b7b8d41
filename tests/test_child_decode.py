"""Tier 1: what a child makes of the message it is given to run (no fork, no broker): a v1
body runs like v2, a body it cannot read is reported MALFORMED and nothing is stored (the
supervisor stores the failure as it dead-letters the message)."""
from __future__ import annotations

import contextlib
import json
import logging
import uuid
from datetime import UTC, datetime

import pytest
from kombu.serialization import registry
from kombu.utils import json as kombu_json

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


def test_a_json_body_reads_the_types_kombu_writes(app):
    seen = {}

    @app.task(name="t.when")
    def when(at, ident):
        seen.update(at=at, ident=ident)
    at, ident = datetime(2026, 11, 28, 12, 30, tzinfo=UTC), uuid.uuid4()
    msg = build_message("t.when", "typed-id", [at, ident])
    finished = execute(app, job("t.when", kombu_json.dumps(msg.body).encode(), msg.headers))
    assert finished.outcome is Outcome.SUCCEEDED
    assert seen == {"at": at, "ident": ident}


@pytest.mark.parametrize("body, why", [
    # kombu's own decoders raise more than ValueError: decimal's InvalidOperation here
    (b'[[{"__type__": "decimal", "__value__": "not a number"}], {}, {}]', "not valid"),
    (b'[[{"__type__": "no such type", "__value__": 1}], {}, {}]', "Unsupported type"),
    (b"[" * 100_000, "not valid"),                   # too deep to decode
    (b'[[], {}, {}]\xff', "not valid"),              # not UTF-8
])
def test_a_json_body_kombu_cannot_read_is_malformed(app, body, why):
    @app.task(name="t.add")
    def add(*args):
        raise AssertionError("ran")
    headers = build_message("t.add", "bad-json-id", []).headers
    finished = execute(app, job("t.add", body, headers))
    assert finished.outcome is Outcome.MALFORMED and why in (finished.detail or "")


def test_a_json_decoder_registered_in_kombus_place_is_used(app):
    seen = []

    @app.task(name="t.add")
    def add(x, y):
        seen.append(x + y)
    headers = build_message("t.add", "own-json-id", []).headers
    previous = registry._decoders["application/json"]
    registry._decoders["application/json"] = lambda data: [[40, 2], {}, {}]
    try:
        finished = execute(app, job("t.add", b"not json at all", headers))
    finally:
        registry._decoders["application/json"] = previous
    assert finished.outcome is Outcome.SUCCEEDED and seen == [42]


class Shown:
    """A return value that counts how often it is shown."""

    def __init__(self) -> None:
        self.shown = 0

    def __repr__(self) -> str:
        self.shown += 1
        return "<shown>"


@pytest.mark.parametrize("events, level, shown", [
    (False, logging.WARNING, 0),    # neither logged nor sent: not made
    (False, logging.INFO, 1),       # logged
    (True, logging.WARNING, 1),     # sent with the task-succeeded event
])
def test_a_return_values_repr_is_made_only_where_it_is_read(app, events, level, shown):
    value = Shown()

    @app.task(name="t.value")
    def give():
        return value
    headers = build_message("t.value", f"repr-{events}-{level}", [], ignore_result=True).headers
    child_log = logging.getLogger("workhorse.child")
    previous = child_log.level
    child_log.setLevel(level)
    try:
        finished = execute(app, job("t.value", b"[[], {}, {}]", headers)._replace(events=events))
    finally:
        child_log.setLevel(previous)
    assert finished.outcome is Outcome.SUCCEEDED and value.shown == shown
    assert finished.result == ("<shown>" if events else None)
