"""The supervisor loop's own CPU per task, without a broker, a fork or a pipe.

    python benchmarks/loop_cost.py [--tasks 20000] [--repeat 5] [--profile]

Drives a real ``Supervisor`` (its holding, intake, dispatch, slots and settlement) with the
fakes of the tier-1 tests: messages as the broker thread hands them over (the headers a
Celery client sends), children that answer each job with ``Done`` at once. Frames are
pickled and unpickled as on a real pipe. What it leaves out: the broker thread and its
round trips, the system calls of the pipes and the selector. So it measures the Python
the loop thread runs per task, repeatably (CPU time, median of ``--repeat``), for
comparing commits; ``--profile`` prints where that time goes (cProfile, by own time).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fakes import FakeClock, FakeHandle, FakeLink, FakeOS, fake_app, fake_settings
from workhorse.daemon.supervisor import Phase, Supervisor
from workhorse.outcome import Outcome
from workhorse.pool import ipc
from workhorse.protocol import build_message


class PipeHandle(FakeHandle):
    """A fake child whose frames cross a (pretend) pipe: pickled one way, unpickled back."""

    def send(self, frame: object) -> None:
        self.sent.append(ipc.encode(frame))

    def answer(self) -> bool:
        """Answer the jobs sent since the last call with Done; True if there were any."""
        jobs, self.sent = self.sent, []
        for data in jobs:
            for frame in [ipc.decode(data[4:])]:     # (a job, as a child reads it)
                if isinstance(frame, ipc.Job):
                    done = ipc.Done(self.pid, frame.seq, Outcome.SUCCEEDED.value, None,
                                    40_000_000, 0.0001)
                    reader = ipc.FrameReader.__new__(ipc.FrameReader)
                    reader.broken, reader._buffer = False, bytearray(ipc.encode(done))
                    self.inbox.extend(reader._frames())
        return bool(jobs)


class PipeOS(FakeOS):
    def spawn(self, number: int, make_runtime: object) -> PipeHandle:
        handle = PipeHandle(100 + len(self.handles), self.trace)
        self.handles.append(handle)
        return handle


def messages(count: int) -> list[SimpleNamespace]:
    out = []
    for _ in range(count):
        built = build_message("t.add", str(uuid.uuid4()), [1, 2], {}, ignore_result=True)
        out.append(SimpleNamespace(
            headers=built.headers, body=b'[[1, 2], {}, {"callbacks": null}]',
            content_type="application/json", content_encoding="utf-8",
            delivery_info={"exchange": "", "routing_key": "q", "delivery_count": 1},
            properties={"correlation_id": built.headers["id"], "delivery_mode": 2,
                        "priority": 0, "delivery_tag": str(uuid.uuid4()),
                        "body_encoding": "base64"},
            delivery_tag=str(uuid.uuid4())))
    return out


def run(count: int) -> float:
    """CPU seconds the loop spends per task, draining ``count`` tasks."""
    clock = FakeClock()
    os_ = PipeOS(clock)
    link = FakeLink()
    link.leased = True
    state = tempfile.TemporaryDirectory()
    supervisor = Supervisor(fake_app("t.add"), fake_settings(concurrency=2,
                                                            remote_control=False,
                                                            heartbeat_events=False,
                                                            state_dir=Path(state.name)),
                            system=os_, link=link)
    opened = getattr(supervisor, "_open_journal", None)
    if opened is not None:      # as a worker does (its journal: starts and ends)
        opened()
    supervisor.slots.spawn_all()
    for child in list(supervisor.slots.children()):
        supervisor.slots.on_readable(child)          # Hello
    supervisor.phase = Phase.RUNNING
    pending = messages(count)
    window = supervisor.holding.window
    started = time.process_time()
    while pending or supervisor.holding.held:
        room = window - supervisor.holding.held
        for message in pending[:room]:
            supervisor.receive("q", message, 1)
        del pending[:room]
        supervisor._after_events()
        for handle, child in zip(os_.handles, list(supervisor.slots.children()), strict=True):
            if handle.answer():
                supervisor.slots.on_readable(child)
                supervisor._after_events()
        supervisor.loop.wait(0)         # its before-wait callbacks (the journal's flush)
    spent = (time.process_time() - started) / count
    state.cleanup()
    return spent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if args.profile:
        profiler = cProfile.Profile()
        profiler.runcall(run, args.tasks)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
        return 0
    costs = [run(args.tasks) for _ in range(args.repeat)]
    print(f"loop CPU per task: median {statistics.median(costs) * 1e6:.1f} µs "
          f"(min {min(costs) * 1e6:.1f}, max {max(costs) * 1e6:.1f}; {args.tasks} tasks, "
          f"{args.repeat} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
