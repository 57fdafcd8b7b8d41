"""Celery's control commands that change what a worker does (``celery control``,
``app.control.revoke``, ``workhorse control``), answered in Celery's reply formats.

Each command is a function of a ``Worker`` (the control thread: it runs what it is given
on the supervisor's loop thread, ``steer``, and reaches the shared result store) and the
command's arguments, which come off the wire: anything malformed raises ``ValueError``
naming it, and the asker gets that as an error reply.
"""
from __future__ import annotations

import logging
import signal as signals
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from .revoked import Revoked

log = logging.getLogger("workhorse.control")

#: A revoke leaves a task's state alone once another worker has started it (Celery's rule).
NOT_STARTED = frozenset({"PENDING", "RECEIVED", "RETRY", "REJECTED"})


@dataclass(frozen=True)
class RevokeResult:
    """What the loop thread did with a revoke."""

    held: frozenset[str] = frozenset()          # ids held here (any stage) when it came
    terminated: Sequence[str] = ()              # ids whose child was signalled


T = TypeVar("T")


class Steerable(Protocol):
    """The supervisor, on its loop thread."""

    def revoke(self, entries: Mapping[str, float], terminate: bool,
               sig: int) -> RevokeResult: ...
    def resize_pool(self, size: int, why: str) -> int:
        """Resize the pool (ValueError outside its bounds); returns the size before."""
    def pool_size(self) -> int: ...
    def set_time_limits(self, task: str, soft: float | None, hard: float | None) -> bool:
        """False: no such task."""
    def warm_shutdown(self, why: str) -> None: ...
    def set_task_events(self, on: bool) -> bool:
        """Switch task events on or off; returns whether they were on."""
    def heartbeat(self) -> None: ...
    def add_consumer(self, queue: str) -> threading.Event | None:
        """Consume ``queue`` too: set once the broker thread does; None if it did."""
    def cancel_consumer(self, queue: str) -> threading.Event | None:
        """Stop consuming ``queue``: set once the broker thread has; None if it did not."""


class Worker(Protocol):
    hostname: str

    def steer(self, function: Callable[[Steerable], T]) -> T:
        """Run ``function`` on the loop thread and wait for it."""
    def share_revoked(self, entries: Mapping[str, float]) -> None:
        """Keep the entries in the shared store, for workers that start later."""
    def state_of(self, task_id: str) -> str:
        """The task's state in the result store."""
    def mark_revoked(self, task_id: str, reason: str) -> None: ...


def signum(name: Any) -> int:
    """``TERM``, ``SIGTERM``, ``15`` -> 15; ValueError naming a signal that does not exist."""
    if name is None:
        return signals.SIGTERM
    if isinstance(name, int) and not isinstance(name, bool):
        try:
            return signals.Signals(name)
        except ValueError:
            raise ValueError(f"no such signal: {name}") from None
    if isinstance(name, str):
        text = name.strip().upper()
        if text.isdigit():
            return signum(int(text))
        try:
            return signals.Signals[text if text.startswith("SIG") else "SIG" + text]
        except KeyError:
            raise ValueError(f"no such signal: {name!r}") from None
    raise ValueError(f"signal must be a name or a number, not {name!r}")


def task_ids(task_id: Any) -> list[str]:
    ids = [task_id] if isinstance(task_id, str) else task_id
    if not isinstance(ids, (list, tuple)) or not ids or not all(
            isinstance(i, str) and i for i in ids):
        raise ValueError(f"task_id must be a task id or a list of them, not {task_id!r}")
    return list(dict.fromkeys(ids))


def stamped_headers(headers: Any) -> dict[str, Any]:
    if isinstance(headers, (list, tuple)):      # the command line's key=value words
        pairs = {}
        for word in headers:
            key, sep, value = str(word).partition("=")
            if not sep or not key:
                raise ValueError(f"a stamped header is key=value, not {word!r}")
            pairs[key] = value
        headers = pairs
    if not isinstance(headers, dict) or not headers or not all(
            isinstance(k, str) for k in headers):
        raise ValueError(f"headers must map stamp names to values, not {headers!r}")
    return headers


def revoke(worker: Worker, task_id: Any = None, terminate: Any = False, signal: Any = None,
           **_: Any) -> dict[str, str]:
    """Revoke ids: one held here and not started is settled REVOKED (acked) at once, one
    that arrives later never runs; with ``terminate`` a running one's child gets
    ``signal`` (TERM). REVOKED is stored at once for ids nobody has started."""
    ids = task_ids(task_id)
    sig = signum(signal)
    entries = Revoked().revoke_ids(ids)
    worker.share_revoked(entries)
    done = worker.steer(lambda s: s.revoke(entries, bool(terminate), sig))
    for one in ids:
        if one in done.held:
            continue        # settled here, or running here: the loop has it
        try:
            if worker.state_of(one) in NOT_STARTED:
                worker.mark_revoked(one, "revoked")
        except Exception as exc:  # noqa: BLE001 - the revoke holds; the state is a courtesy
            log.warning("remote control: could not mark %s revoked in the result store: %r",
                        one, exc)
    if terminate:
        if not done.terminated:
            return {"ok": "terminate: tasks unknown"}
        return {"ok": f"terminate: {', '.join(done.terminated)}"}
    log.info("Tasks flagged as revoked: %s", ", ".join(ids))
    return {"ok": f"tasks {set(ids)} flagged as revoked"}


def revoke_by_stamped_headers(worker: Worker, headers: Any = None, terminate: Any = False,
                              signal: Any = None, **_: Any) -> dict[str, str]:
    """Revoke every task stamped with one of the values (``{"monitoring_id": [...]}``)."""
    stamps = stamped_headers(headers)
    sig = signum(signal)
    entries = Revoked().revoke_stamps(stamps)
    worker.share_revoked(entries)
    done = worker.steer(lambda s: s.revoke(entries, bool(terminate), sig))
    if not terminate:
        return {"ok": f"headers {headers} flagged as revoked, but not terminated"}
    if not done.terminated:
        return {"ok": f"headers {headers} were not terminated"}
    return {"ok": f"headers {headers} revoked: terminated {', '.join(done.terminated)}"}


def children(n: Any) -> int:
    if isinstance(n, str) and n.strip().isdigit():
        n = int(n)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a whole number of children, at least 1, not {n!r}")
    return n


def pool_grow(worker: Worker, n: Any = 1, **_: Any) -> dict[str, str]:
    """Start ``n`` more children (the prefetch window follows)."""
    count = children(n)
    worker.steer(lambda s: s.resize_pool(s.pool_size() + count, "remote control pool_grow"))
    return {"ok": "pool will grow"}


def pool_shrink(worker: Worker, n: Any = 1, **_: Any) -> dict[str, str]:
    """Retire ``n`` children (idle ones first; busy ones once their task is done)."""
    count = children(n)
    worker.steer(lambda s: s.resize_pool(s.pool_size() - count, "remote control pool_shrink"))
    return {"ok": "pool will shrink"}


def limit(value: Any, name: str) -> float | None:
    if value is None:
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number of seconds, not {value!r}") from None
    if seconds < 0 or seconds != seconds:
        raise ValueError(f"{name} must be a number of seconds, not {value!r}")
    return seconds or None


def time_limit(worker: Worker, task_name: Any = None, hard: Any = None, soft: Any = None,
               **_: Any) -> dict[str, str]:
    """Set a task's time limits in this worker until it stops or reloads (as Celery's)."""
    if not isinstance(task_name, str) or not task_name:
        raise ValueError(f"task_name must name a task, not {task_name!r}")
    soft_s, hard_s = limit(soft, "soft"), limit(hard, "hard")
    if not worker.steer(lambda s: s.set_time_limits(task_name, soft_s, hard_s)):
        return {"error": f"unknown task {task_name}"}
    log.info("New time limits for tasks of type %s: soft=%s hard=%s", task_name, soft_s,
             hard_s)
    return {"ok": "time limits set successfully"}


def shutdown(worker: Worker, msg: Any = "Got shutdown from remote", **_: Any) -> dict[str, str]:
    """A warm shutdown, as SIGTERM's."""
    why = f"remote control: {msg}" if isinstance(msg, str) else "remote control"
    log.warning("%s", why)
    worker.steer(lambda s: s.warm_shutdown(why))
    return {"ok": "shutting down"}


def enable_events(worker: Worker, **_: Any) -> dict[str, str]:
    if worker.steer(lambda s: s.set_task_events(True)):
        return {"ok": "task events already enabled"}
    log.info("Events of group {task} enabled by remote.")
    return {"ok": "task events enabled"}


def disable_events(worker: Worker, **_: Any) -> dict[str, str]:
    if not worker.steer(lambda s: s.set_task_events(False)):
        return {"ok": "task events already disabled"}
    log.info("Events of group {task} disabled by remote.")
    return {"ok": "task events disabled"}


def heartbeat(worker: Worker, **_: Any) -> dict[str, str]:
    """Send a worker-heartbeat now."""
    worker.steer(lambda s: s.heartbeat())
    return {"ok": "heartbeat sent"}


#: How long add/cancel_consumer wait for the broker thread before they answer anyway.
BROKER_THREAD_WAIT = 5.0


def _wait(done: threading.Event, what: str) -> None:
    """The reply says it is done: wait (on the control thread) for the broker thread."""
    if not done.wait(BROKER_THREAD_WAIT):
        raise TimeoutError(f"the broker thread is not done {what} after "
                           f"{BROKER_THREAD_WAIT:g} s (is the broker reachable?); it will be")


def queue_name(queue: Any) -> str:
    if not isinstance(queue, str) or not queue.strip():
        raise ValueError(f"queue must name a queue, not {queue!r}")
    return queue.strip()


def add_consumer(worker: Worker, queue: Any = None, **_: Any) -> dict[str, str]:
    """Consume ``queue`` too (by name, as workhorse declares its queues; Celery's exchange
    and routing_key options are not used), until the worker stops."""
    return _switch(worker, queue, consume=True)


def cancel_consumer(worker: Worker, queue: Any = None, **_: Any) -> dict[str, str]:
    """Stop consuming ``queue``; what was taken from it runs and is settled as usual."""
    return _switch(worker, queue, consume=False)


def _switch(worker: Worker, queue: Any, *, consume: bool) -> dict[str, str]:
    name = queue_name(queue)
    done = worker.steer(lambda s: s.add_consumer(name) if consume else s.cancel_consumer(name))
    if done is None:
        return ({"ok": f"already consuming from {name!r}"} if consume
                else {"error": f"not consuming from {name!r}"})
    _wait(done, f"{'consuming' if consume else 'cancelling'} {name}")
    log.info("%s %s", "Started consuming from" if consume else "No longer consuming from", name)
    return {"ok": f"add consumer {name}" if consume else f"no longer consuming from {name}"}


Action = Callable[..., Any]

#: Every control command, by Celery's name.
ACTIONS: dict[str, Action] = {
    "revoke": revoke, "revoke_by_stamped_headers": revoke_by_stamped_headers,
    "pool_grow": pool_grow, "pool_shrink": pool_shrink, "time_limit": time_limit,
    "shutdown": shutdown, "enable_events": enable_events, "disable_events": disable_events,
    "heartbeat": heartbeat, "add_consumer": add_consumer, "cancel_consumer": cancel_consumer,
}
