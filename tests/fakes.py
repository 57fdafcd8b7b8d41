"""Fakes for tier-1 tests of the supervisor's parts: a clock, an OS that never forks, child
handles, a broker connection and a result store that record what is asked of them."""
from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from workhorse.backends import RetryPolicy
from workhorse.daemon.delivery import Delivery
from workhorse.daemon.loop import Loop
from workhorse.outcome import Policy
from workhorse.daemon.slots import Recycling, Slots
from workhorse.outcome import Outcome
from workhorse.pool.ipc import Done, Hello
from workhorse.protocol import parse_request


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0
        self.wall = datetime(2026, 1, 1, tzinfo=UTC)

    def __call__(self) -> float:
        return self.t

    def now(self) -> datetime:
        return self.wall + timedelta(seconds=self.t - 1000.0)

    def advance(self, loop: Loop, seconds: float) -> None:
        """Move time on and run the timers that fell due."""
        self.t += seconds
        loop.run_due()


class FakeHandle:
    """A child process that never existed: frames are queued by the test; setting ``code``
    makes it exit (a zombie until FakeOS.reap)."""

    def __init__(self, pid: int, trace: list[tuple[str, int]] | None = None) -> None:
        self.pid = pid
        # A real pipe nobody writes to, so a real Loop can watch it; frames come from inbox.
        self.read_fd, self._write_fd = os.pipe()
        self.trace = [] if trace is None else trace     # ("killpg"|"reap", pid), in order
        self.sent: list[object] = []
        self.inbox: list[object] = [Hello(pid)]
        self.at_eof = False
        self.code: int | None = None
        self.killed = 0
        self.closed = False
        self.reaped = False

    def send(self, frame: object) -> None:
        self.sent.append(frame)

    def receive(self) -> list[object]:
        frames, self.inbox = self.inbox, []
        return frames

    def kill_tree(self, sig: int = 9) -> None:
        self.killed += 1
        self.code = -sig

    def kill_group(self) -> None:
        self.trace.append(("killpg", self.pid))

    def close(self) -> None:
        if not self.closed:
            os.close(self.read_fd)
            os.close(self._write_fd)
        self.closed = True


class FakeOS:
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.handles: list[FakeHandle] = []
        self.signals: list[tuple[int, int]] = []
        self.memory: dict[int, int] = {}
        self.strays: dict[int, int] = {}       # exited processes not of the pool: pid → code
        self.trace: list[tuple[str, int]] = []

    def monotonic(self) -> float:
        return self.clock()

    def boottime(self) -> float:
        return self.clock()

    def now(self) -> datetime:
        return self.clock.now()

    def getpid(self) -> int:
        return 1

    def mark_fds(self) -> None:
        pass

    def guard_descendants(self) -> None:
        pass

    def close(self) -> None:
        pass

    def spawn(self, number: int, make_runtime: Callable[..., Any]) -> FakeHandle:
        handle = FakeHandle(100 + len(self.handles), self.trace)
        self.handles.append(handle)
        return handle

    def signal(self, pid: int, sig: int) -> None:
        self.signals.append((pid, sig))

    def rss(self, pid: int) -> int | None:
        return self.memory.get(pid)

    def exited(self) -> tuple[int, int] | None:
        for handle in self.handles:
            if handle.code is not None and not handle.reaped:
                return handle.pid, handle.code
        return next(iter(self.strays.items()), None)

    def reap(self, pid: int) -> None:
        self.trace.append(("reap", pid))
        self.strays.pop(pid, None)
        for handle in self.handles:
            if handle.pid == pid and handle.code is not None:
                handle.reaped = True


class FakeLoop(Loop):
    """A Loop whose readers are never selected (fake fds): tests call them directly."""

    def add_reader(self, fd: int, callback: Callable[[], None]) -> None:
        pass

    def remove_reader(self, fd: int) -> None:
        pass


@dataclass
class FakeBroker:
    """Records settle calls as (verb, task id header); ``fail`` makes the next calls raise."""

    calls: list[tuple[str, str | None]] = field(default_factory=list)
    fail: BaseException | None = None
    leased: bool = True
    lost: set[str] = field(default_factory=set)      # task ids whose lease is gone
    delayable: frozenset[str] = frozenset()
    #: task id -> when its lease was set (epoch seconds). Unlisted: no lease known.
    leases: dict[str, float] = field(default_factory=dict)
    alive_checks: int = 0

    def _do(self, verb: str, message: Any) -> None:
        if self.fail is not None:
            raise self.fail
        self.calls.append((verb, (message.headers or {}).get("id")))

    def ack(self, message: Any) -> None:
        self._do("ack", message)

    def requeue(self, queue: str, message: Any) -> None:
        self._do("requeue", message)

    def requeue_counted(self, queue: str, message: Any, deliveries: int) -> None:
        self._do(f"requeue_counted:{deliveries}", message)

    def hand_back(self, queue: str, message: Any) -> None:
        self._do("hand_back", message)

    def requeue_held_loss(self, queue: str, message: Any) -> None:
        self._do("requeue_held_loss", message)

    def hand_back_later(self, queue: str, message: Any, seconds: int) -> None:
        self._do(f"hand_back_later:{seconds}", message)

    def dead_letter(self, queue: str, message: Any, reason: str, task_id: str | None,
                    worker: str, *, acked: bool, or_requeue: bool = False) -> None:
        self._do("dead_letter", message)

    def republish(self, queue: str, message: Any, headers: Any) -> None:
        self._do("republish", message)

    def ack_then(self, message: Any, then: Callable[[BaseException | None], None]) -> None:
        """Acks at once and answers at once (the broker thread would answer later)."""
        try:
            self._do("ack", message)
        except Exception as exc:  # noqa: BLE001 - handed to ``then``, as the link does
            then(exc)
            return
        then(None)

    def forget(self, message: Any) -> None:
        self._do("forget", message)

    def renew(self, messages: list[Any], then: Callable[[list[Any]], None]) -> None:
        then([m for m in messages if m.headers["id"] in self.lost])

    def lease_set_at(self, message: Any) -> float | None:
        return self.leases.get(message.headers["id"])

    def check_alive(self, then: Callable[[], None]) -> None:
        """Answers at once (the broker thread would answer later); ``alive_checks`` counts."""
        self.alive_checks += 1
        then()

    def is_connection_error(self, exc: BaseException) -> bool:
        return isinstance(exc, ConnectionError)


class FakeBackend:
    """Records stored results as (state, task id, exception type name)."""

    def __init__(self) -> None:
        self.stored: list[tuple[str, str, str]] = []
        self.fail: BaseException | None = None
        self.released: list[str] = []

    def _store(self, state: str, task_id: str, exc: BaseException | None) -> None:
        if self.fail is not None:
            raise self.fail
        self.stored.append((state, task_id, type(exc).__name__ if exc else ""))

    def mark_as_failure(self, task_id: str, exc: BaseException, tb: Any, request: Any) -> None:
        self._store("FAILURE", task_id, exc)

    def mark_as_revoked(self, task_id: str, reason: str, request: Any) -> None:
        self._store("REVOKED", task_id, None)

    def exception_safe_to_retry(self, exc: BaseException) -> bool:
        return isinstance(exc, ConnectionError)

    def on_connection_error(self, exc: BaseException) -> None:
        pass

    def renew_claims(self, claims: dict[str, str], ttl: float) -> list[str]:
        return []

    def release_claim(self, key: str, owner: str) -> None:
        self.released.append(key)


def fake_app(*task_names: str, **options: Any) -> Any:
    tasks = {name: SimpleNamespace(name=name, time_limit=None, soft_time_limit=None,
                                   **options) for name in task_names}
    return SimpleNamespace(tasks=tasks, backend=FakeBackend(), celery_schedule=[])


def retry_policy(max_retries: int = 3) -> RetryPolicy:
    return RetryPolicy(always_retry=True, max_retries=max_retries, base_sleep=0.5, max_sleep=1.0)


def message(task: str = "t.add", **headers: Any) -> Any:
    """A received message as kombu hands it over (only what the supervisor reads)."""
    all_headers = {"lang": "py", "task": task, "id": str(uuid.uuid4()), **headers}
    return SimpleNamespace(headers=all_headers, body=b'[[], {}, {}]',
                           content_type="application/json", content_encoding="utf-8",
                           delivery_info={"routing_key": "q"}, properties={})


def delivery(seq: int = 1, policy: Policy | None = None, task: str = "t.add",
             **headers: Any) -> Delivery:
    m = message(task, **headers)
    return Delivery(seq, "q", m, parse_request(m.headers), SimpleNamespace(name=task),
                    policy or Policy())


class FakeLink(FakeBroker):
    """The supervisor's handle on its broker thread: records credit, room and cancels."""

    def __init__(self) -> None:
        super().__init__()
        self.credits: list[int] = []
        self.rooms: list[int] = []
        self.starved: list[bool] = []
        self.cancelled = False
        self.push = False
        self.leased = False
        self.room_read_before_wait = False
        self.connected = True
        self.where = "memory://"
        self.queues = ["q"]
        self.journal: Any = None

    def set_credit(self, count: int) -> None:
        if not self.credits or self.credits[-1] != count:
            self.credits.append(count)

    def set_room(self, free: int, starved: bool = True) -> None:
        self.rooms.append(free)
        self.starved.append(starved)

    def cancel(self) -> None:
        self.cancelled = True

    def start(self) -> None:
        pass

    def use_journal(self, journal: Any) -> None:
        self.journal = journal

    def say_troubles(self) -> None:
        pass

    def close(self, timeout: float) -> None:
        self.connected = False

    def healthy(self) -> bool:
        return True

    def parked(self) -> Any:
        import contextlib
        return contextlib.nullcontext(True)

    def describe(self) -> str:
        return "fake broker"


#: Where a supervisor built from fake settings writes its health file.
FAKE_STATE_DIR = Path(tempfile.gettempdir()) / f"workhorse-fake-state-{os.getuid()}"


def fake_settings(**overrides: Any) -> Any:
    """Settings as the supervisor reads them: every declared default, then ``overrides``."""
    from workhorse.config import SETTINGS, Settings
    values = {s.name: s.default for s in SETTINGS if not s.derived}
    values.update({"hostname": "w@test", "concurrency": 2, "state_dir": FAKE_STATE_DIR,
                   "broker_url": "memory://", "result_backend": "disabled", **overrides})
    return Settings(values, dict.fromkeys(values, "test"), ())


class Events:
    def __init__(self) -> None:
        self.done: list[tuple[str, str]] = []
        self.lost: list[tuple[str, Outcome, str]] = []
        self.cannot_boot: list[str] = []

    def job_done(self, d: Delivery, done: Done) -> None:
        self.done.append((d.request.id, done.outcome))

    def job_lost(self, d: Delivery, outcome: Outcome, detail: str) -> None:
        self.lost.append((d.request.id, outcome, detail))

    def children_cannot_boot(self, reason: str) -> None:
        self.cannot_boot.append(reason)


def make_slots(clock: FakeClock, size: int = 1, recycling: Recycling | None = None,
               max_boot_failures: int = 5):
    os_ = FakeOS(clock)
    loop = FakeLoop(clock)
    events = Events()
    accepting = [True]
    slots = Slots(size, os_, loop, lambda *a: None, events, recycling or Recycling(),
                  lambda: accepting[0], max_boot_failures=max_boot_failures)
    slots.spawn_all()
    for slot in slots.slots.values():
        assert slot.child is not None
        slots.on_readable(slot.child)          # Hello
    return slots, os_, loop, events, accepting
