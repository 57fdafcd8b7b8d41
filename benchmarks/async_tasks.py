"""The I/O-bound benchmark's tasks for workhorse (``-A benchmarks.async_tasks:app``,
``benchmarks/async_io.py``): ``aio.wait`` awaits ``asyncio.sleep`` on its child's event
loop, with the same records around it as the peers' tasks (``async_peers.py``)."""
from __future__ import annotations

from benchmarks.async_peers import async_wait
from workhorse import App

app = App("bench-aio")
app.task(name="aio.wait")(async_wait)
