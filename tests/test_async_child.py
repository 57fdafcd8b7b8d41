"""Tier 1: a child's event loop for async tasks (``pool.aio``), in this process: many jobs
at once, each with its own request; its soft limit raised inside it, its hard limit and a
terminate cancelling it alone; the heart naming whose code runs."""
from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from workhorse import App, SoftTimeLimitExceeded
from workhorse._state import clear_contexts
from workhorse.outcome import Outcome
from workhorse.pool.aio import AsyncSession
from workhorse.pool.heart import Heart
from workhorse.pool.ipc import Cancel, FrameStream, Job, Stop, encode
from workhorse.protocol import build_message

pytestmark = pytest.mark.timeout(30)


class Runtime:
    """What a session needs of its ChildRuntime; the supervisor's frames come through a
    real pipe."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.hostname = "w@test"
        self.index = 1
        self.read_fd, self.write_fd = os.pipe()
        self.stream = FrameStream(self.read_fd)
        self.sent: list[object] = []
        self.finished: dict[int, object] = {}

    def send(self, frame: object) -> None:
        self.sent.append(frame)

    def done(self, job: Job, finished: object) -> object:
        self.finished[job.seq] = finished
        return ("done", job.seq)

    def pending_frames(self) -> list[object]:
        return self.stream.pending()

    def read_available(self) -> list[object] | None:
        return self.stream.read_available()

    def set_title(self, what: str) -> None:
        pass

    def exit_forked_copy(self, exc: BaseException | None) -> None:
        os._exit(0)

    def supervisor_sends(self, *frames: object) -> None:
        for frame in frames:
            os.write(self.write_fd, encode(frame))

    def close(self) -> None:
        os.close(self.read_fd)
        os.close(self.write_fd)


@pytest.fixture
def app(tmp_path):
    app = App("aio-child", broker_url="memory://",
              result_backend=f"sqlite:///{tmp_path / 'r.sqlite3'}", state_dir=str(tmp_path))
    app.configure()
    yield app
    app.close()
    clear_contexts()


@pytest.fixture
def runtime(app):
    runtime = Runtime(app)
    yield runtime
    runtime.close()


def job(seq: int, task: str, args: tuple = (), *, soft: float | None = None,
        hard: float | None = None) -> Job:
    message = build_message(task, f"id-{seq}", args, {})
    headers, body = message.headers, json.dumps(message.body).encode()
    return Job(seq, task, body, "application/json", "utf-8", headers, {"routing_key": "q"},
               track_started=False, queue="q", asynchronous=True, soft_limit=soft,
               hard_limit=hard)


def run(runtime: Runtime, first: Job, *more: Job) -> tuple[AsyncSession, list[object]]:
    runtime.supervisor_sends(*more)
    session = AsyncSession(runtime, Heart())   # type: ignore[arg-type]
    leftover = session.run(first)
    return session, list(leftover)


def test_many_jobs_run_at_once_each_with_its_own_request(app, runtime):
    @app.task(bind=True, name="t.nap")
    async def nap(self, seconds):
        before = self.request.id
        await asyncio.sleep(seconds)
        return [before, self.request.id]
    started = time.monotonic()
    _, leftover = run(runtime, job(1, "t.nap", (0.5,)), *(job(n, "t.nap", (0.5,))
                                                           for n in range(2, 51)))
    assert time.monotonic() - started < 5       # 50 half-second naps, one after another: 25 s
    assert leftover == [] and len(runtime.sent) == 50
    assert {f.outcome for f in runtime.finished.values()} == {Outcome.SUCCEEDED}
    for n in range(1, 51):
        assert app.backend.get_task_meta(f"id-{n}")["result"] == [f"id-{n}"] * 2


def test_the_soft_limit_is_raised_where_the_coroutine_waits(app, runtime):
    @app.task(name="t.soft")
    async def soft():
        started = time.monotonic()
        try:
            await asyncio.sleep(10)
        except SoftTimeLimitExceeded:
            await asyncio.sleep(0.05)               # it may clean up, awaiting
            return round(time.monotonic() - started, 1)
        return None
    run(runtime, job(1, "t.soft", soft=0.3))
    assert runtime.finished[1].outcome is Outcome.SUCCEEDED
    assert app.backend.get_task_meta("id-1")["result"] == 0.4


def test_the_hard_limit_cancels_one_job_and_spares_the_others(app, runtime):
    @app.task(name="t.nap")
    async def nap(seconds):
        await asyncio.sleep(seconds)
        return seconds
    run(runtime, job(1, "t.nap", (30,), hard=0.2), job(2, "t.nap", (0.5,)))
    assert runtime.finished[1].outcome is Outcome.TIME_LIMIT
    assert "hard time limit (0.2 s) exceeded" in runtime.finished[1].detail
    assert app.backend.get_task_meta("id-1")["status"] == "PENDING"   # the supervisor's
    assert runtime.finished[2].outcome is Outcome.SUCCEEDED


def test_a_cancel_frame_terminates_one_job(app, runtime):
    @app.task(name="t.nap")
    async def nap(seconds):
        await asyncio.sleep(seconds)
    cancel = Cancel(1, Outcome.TERMINATED.value, "revoked with terminate (SIGTERM)")
    run(runtime, job(1, "t.nap", (30,)), job(2, "t.nap", (0.3,)), cancel)
    assert runtime.finished[1].outcome is Outcome.TERMINATED
    assert runtime.finished[2].outcome is Outcome.SUCCEEDED


def test_the_heart_names_the_job_whose_code_runs_and_its_subtasks_too(app, runtime):
    heart_seen: dict[str, int] = {}
    session_box: list[AsyncSession] = []

    @app.task(name="t.look")
    async def look(label):
        heart_seen[label] = session_box[0].heart.read()[1]

        async def part():
            await asyncio.sleep(0)
            heart_seen[label + "/part"] = session_box[0].heart.read()[1]
        await asyncio.gather(part())
    runtime.supervisor_sends(job(8, "t.look", ("b",)))
    session = AsyncSession(runtime, Heart())   # type: ignore[arg-type]
    session_box.append(session)
    session.run(job(7, "t.look", ("a",)))
    assert heart_seen == {"a": 7, "a/part": 7, "b": 8, "b/part": 8}
    assert session.heart.read()[1] == 0 and session.heart.read()[0] >= 1


def test_frames_for_after_the_async_jobs_are_handed_back_in_order(app, runtime):
    @app.task(name="t.quick")
    async def quick():
        await asyncio.sleep(0.1)
    sync_job = job(3, "t.quick")._replace(asynchronous=False)
    _, leftover = run(runtime, job(1, "t.quick"), sync_job, job(2, "t.quick"), Stop())
    assert leftover == [sync_job, job(2, "t.quick"), Stop()]
    assert set(runtime.finished) == {1}
