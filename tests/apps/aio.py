"""Async tasks the integration tests run in a real worker. Settings come from WORKHORSE_* env.

Tasks that tests count record each start and each end as a line in the file named by
$WH_TEST_RUNLOG with ".aio" added: "<what> <task id> <pid> <time.time()>".
"""
from __future__ import annotations

import asyncio
import os
import time

from workhorse import App, SoftTimeLimitExceeded

app = App("aio")


def _record(what: str, task_id: str | None) -> None:
    path = os.environ.get("WH_TEST_RUNLOG")
    if path:
        with open(path + ".aio", "a") as f:
            f.write(f"{what} {task_id} {os.getpid()} {time.time():.6f}\n")


@app.task(bind=True)
async def nap(self, seconds: float = 1.0) -> str | None:
    """Sleep on the event loop; returns its own id, read after the sleep (per task)."""
    _record("start", self.request.id)
    await asyncio.sleep(seconds)
    _record("end", self.request.id)
    return self.request.id


@app.task(bind=True)
async def soft(self, seconds: float = 30.0) -> dict[str, float | str]:
    """Catches its soft limit and says when it came (monotonic, since it started)."""
    started = time.monotonic()
    try:
        await asyncio.sleep(seconds)
    except SoftTimeLimitExceeded:
        return {"soft_after": time.monotonic() - started, "id": self.request.id or ""}
    return {"soft_after": -1.0, "id": self.request.id or ""}


@app.task(bind=True)
async def block(self, seconds: float = 60.0) -> None:
    """Blocks its child's event loop (a sync sleep in async code)."""
    _record("block", self.request.id)
    time.sleep(seconds)


@app.task(bind=True)
async def stubborn(self, seconds: float = 60.0) -> None:
    """Swallows every cancellation, and goes on sleeping."""
    _record("stubborn", self.request.id)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            pass


@app.task(bind=True)
async def crash(self) -> None:
    """Takes its whole child down with it, from inside a step of its code."""
    _record("crash", self.request.id)
    await asyncio.sleep(0.2)
    os._exit(3)


@app.task(bind=True)
async def forker(self) -> int:
    """Forks, and both processes go on in the task's code: the copy must not get back to
    the loop (it would run the other tasks' code, and report this one)."""
    pid = os.fork()
    await asyncio.sleep(0.2)
    _record("forked-copy" if pid == 0 else "forked-parent", self.request.id)
    if pid:
        os.waitpid(pid, 0)
    return os.getpid()


@app.task(bind=True)
async def fan_out(self, n: int = 10) -> list[str | None]:
    """Sub-tasks on the loop: each sees its parent's request."""
    async def part() -> str | None:
        await asyncio.sleep(0.01)
        return self.request.id
    return list(await asyncio.gather(*(part() for _ in range(n))))


@app.task(bind=True, max_retries=2, default_retry_delay=0)
async def flaky(self) -> int:
    if self.request.retries < 2:
        raise self.retry()
    return self.request.retries


@app.task
async def add(x: int, y: int) -> int:
    await asyncio.sleep(0)
    return x + y


@app.task
def sync_add(x: int, y: int) -> int:
    """A sync task in the same app: never run beside async ones in one child."""
    _record("sync", str(os.getpid()))
    return x + y
