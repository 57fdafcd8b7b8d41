"""The result store interface every backend implements."""
from __future__ import annotations

import enum
import logging
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from ..sqlitedb import said
from ..transport.fenced import Record, Ticket
from ..exceptions import ResultEncodeError, TaskRevokedError, TimeoutError
from ..states import FAILURE, PENDING, READY_STATES, RETRY, REVOKED, STARTED, SUCCESS
from .encoding import build_meta, describe_exception, dumps, encode_exception, loads

RequestInfo = Mapping[str, Any]
T = TypeVar("T")
log = logging.getLogger("workhorse.results")


def pending_meta(task_id: str) -> dict[str, Any]:
    """What a task that has no stored result looks like (PENDING is never stored)."""
    return {"status": PENDING, "result": None, "traceback": None, "children": [],
            "date_done": None, "task_id": task_id}


def reply_of(properties: Mapping[str, Any] | None) -> dict[str, Any]:
    """The message properties a store needs in a request (rpc:// sends each state to
    ``reply_to``, with ``correlation_id``): only those set."""
    properties = properties or {}
    return {name: properties[name] for name in ("reply_to", "correlation_id")
            if properties.get(name)}


def encoded(task_id: str, state: str, encode: Callable[[], T]) -> T:
    """``encode()``: a task's value made storable. Any error in it is the value's, not the
    store's: not retried (the same value fails the same way again), raised as
    ResultEncodeError."""
    try:
        return encode()
    except Exception as exc:
        raise ResultEncodeError(
            f"the {state} result of task {task_id} cannot be encoded as JSON: "
            f"{describe_exception(exc)}") from exc


@dataclass(frozen=True)
class RetryPolicy:
    """How hard a store or fetch tries through errors the backend calls transient."""

    always_retry: bool = True
    max_retries: int = 20
    base_sleep: float = 0.01
    max_sleep: float = 10.0

    def delay(self, attempt: int) -> float:
        """Exponential back-off with full jitter."""
        return random.uniform(0, min(self.max_sleep, self.base_sleep * 2 ** attempt))


@dataclass(frozen=True)
class ChordPart:
    task_id: str
    state: str
    result: Any          # the value, or the encoded exception for FAILURE


@dataclass(frozen=True)
class ChordCompletion:
    """Handed to the one caller whose part completed the chord: it applies the body."""

    parts: list[ChordPart]    # in header order
    token: str                # pass to chord_finished() once the body is dispatched


class Claim(str, enum.Enum):
    """What :meth:`Backend.claim` found for a key."""

    CLAIMED = "claimed"   # the caller now holds the claim (or already held it)
    HELD = "held"         # another owner holds a live claim: do not run now
    DONE = "done"         # the key finished successfully before: never run again


#: Stored in place of an owner once a key is done, so no owner may be called that.
CLAIM_DONE = "done"


def check_claim(owner: str, ttl: float) -> None:
    """Refuse an owner or ttl that the stores could not tell apart from a done or free key."""
    if not owner or owner == CLAIM_DONE:
        raise ValueError(f"claim owner {owner!r} is reserved: use a unique non-empty string "
                         "such as the delivery's task id and worker name")
    if not ttl > 0:
        raise ValueError(f"claim ttl ({ttl}) must be a positive number of seconds")


class Backend(ABC):
    """Stores task results in Celery's layout and reads them back.

    Subclasses hold the storage (``_set``, ``_get``, ``_forget`` on encoded JSON text, the
    group and chord hooks) and say which of their errors are worth retrying. A backend
    object is used from one process; each process opens its own connection.
    """

    def __init__(self, url: str, *, expires: float | None = None, extended: bool = False,
                 retry: RetryPolicy | None = None) -> None:
        self.url = url
        self.expires = expires or None
        self.extended = extended
        self.retry_policy = retry or RetryPolicy()

    # -- storage, per backend
    @abstractmethod
    def _set(self, task_id: str, state: str, payload: str) -> None: ...

    @abstractmethod
    def _get(self, task_id: str) -> str | None: ...

    @abstractmethod
    def _forget(self, task_id: str) -> None: ...

    def _set_group(self, group_id: str, payload: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not store groups")

    def _get_group(self, group_id: str) -> str | None:
        raise NotImplementedError(f"{type(self).__name__} does not store groups")

    def _forget_group(self, group_id: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not store groups")

    def exception_safe_to_retry(self, exc: BaseException) -> bool:
        """Is ``exc`` a passing trouble (connection lost, database busy) worth retrying?"""
        return False

    def on_connection_error(self, exc: BaseException) -> None:
        """Drop the connection after an error, so the next attempt opens a new one."""
        self.close()

    def close(self) -> None:  # noqa: B027 - a default: a backend may hold no connections
        """Release connections; the backend reconnects on next use."""

    # -- resilience
    def retrying(self, what: str, function: Callable[[], T]) -> T:
        """Call ``function``, retrying transient errors with back-off and jitter."""
        policy = self.retry_policy
        attempt = 0
        while True:
            try:
                return function()
            except Exception as exc:
                if (not policy.always_retry or attempt >= policy.max_retries
                        or not self.exception_safe_to_retry(exc)):
                    raise
                delay = policy.delay(attempt)
                attempt += 1
                # A file's trouble said once already (sqlitedb.troubles) is not said again.
                (log.debug if said(exc) else log.warning)(
                    "result store: %s failed (%r); retry %d of %d in %.2f s", what, exc,
                    attempt, policy.max_retries, delay)
                self.on_connection_error(exc)
                time.sleep(delay)

    # -- writing
    def store_result(self, task_id: str, result: Any, state: str,
                     traceback: str | None = None, request: RequestInfo | None = None,
                     extra: Mapping[str, Any] | None = None) -> None:
        def encode() -> str:
            meta = build_meta(task_id, state, result, traceback, request=request,
                              extended=self.extended)
            if extra:
                meta.update(extra)
            return dumps(meta)
        payload = encoded(task_id, state, encode)
        self.retrying(f"storing {state} for {task_id}", lambda: self._set(task_id, state, payload))

    def mark_as_started(self, task_id: str, request: RequestInfo | None = None) -> None:
        self.store_result(task_id, {"pid": None, "hostname": (request or {}).get("hostname")},
                          STARTED, request=request)

    def mark_as_done(self, task_id: str, result: Any, request: RequestInfo | None = None) -> None:
        self.store_result(task_id, result, SUCCESS, request=request)

    def mark_as_failure(self, task_id: str, exc: BaseException, traceback: str | None = None,
                        request: RequestInfo | None = None) -> None:
        self.store_result(task_id, exc, FAILURE, traceback, request=request)

    def mark_as_retry(self, task_id: str, exc: BaseException, traceback: str | None = None,
                      request: RequestInfo | None = None, *, retries: int | None = None,
                      eta: datetime | None = None) -> None:
        """RETRY, with the retry's number and when it is due (extra keys Celery ignores)."""
        self.store_result(task_id, exc, RETRY, traceback, request=request,
                          extra={"retries": retries, "eta": eta.isoformat() if eta else None})

    def mark_as_revoked(self, task_id: str, reason: str,
                        request: RequestInfo | None = None) -> None:
        self.store_result(task_id, TaskRevokedError(reason), REVOKED, request=request)

    def forget(self, task_id: str) -> None:
        self.retrying(f"forgetting {task_id}", lambda: self._forget(task_id))

    # -- reading
    def get_task_meta(self, task_id: str) -> dict[str, Any]:
        payload = self.retrying(f"reading {task_id}", lambda: self._get(task_id))
        return loads(payload) if payload else pending_meta(task_id)

    def wait_for(self, task_id: str, timeout: float | None = None,
                 interval: float = 0.5) -> dict[str, Any]:
        """Poll until the result is ready, starting fast and backing off to ``interval``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = min(0.005, interval)
        while True:
            meta = self.get_task_meta(task_id)
            if meta["status"] in READY_STATES:
                return meta
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"task {task_id} not ready after {timeout} s")
                delay = min(delay, remaining)
            time.sleep(delay)
            delay = min(delay * 2, interval)

    # -- groups (Celery's layout: {"result": <GroupResult.as_tuple()>})
    def save_group(self, group_id: str, as_tuple: Any) -> None:
        payload = dumps({"result": as_tuple})
        self.retrying(f"saving group {group_id}", lambda: self._set_group(group_id, payload))

    def restore_group(self, group_id: str) -> Any | None:
        payload = self.retrying(f"reading group {group_id}", lambda: self._get_group(group_id))
        return loads(payload)["result"] if payload else None

    def forget_group(self, group_id: str) -> None:
        self.retrying(f"forgetting group {group_id}", lambda: self._forget_group(group_id))

    # -- chords: counted in the store, so exactly one header task applies the body
    def set_chord_size(self, group_id: str, size: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support chords")

    def chord_part_return(self, group_id: str, task_id: str, index: int | None, state: str,
                          result: Any) -> ChordCompletion | None:
        """Record one header task's outcome, once per part however often it is reported.
        The caller whose part completes the chord (and who claims it) gets the parts in
        order; everyone else gets None. The claim is ``task_id``'s: reported again by that
        part (redelivered after its worker died before sending the body), the completion
        is handed out again; by another part, only after the claim has lapsed."""
        encoded = dumps(self.encode_part(state, result))
        return self.retrying(f"counting chord {group_id}", lambda: self._part_return(
            group_id, task_id, -1 if index is None else index, state, encoded))

    def _part_return(self, group_id: str, task_id: str, index: int, state: str,
                     encoded: str) -> ChordCompletion | None:
        """``chord_part_return`` in one transaction: ``index`` -1 for none, ``encoded``
        the part's value as JSON."""
        raise NotImplementedError(f"{type(self).__name__} does not support chords")

    def chord_finished(self, group_id: str, token: str) -> None:
        """The body is dispatched: drop the chord's state, remember it is done."""
        raise NotImplementedError(f"{type(self).__name__} does not support chords")

    # -- claims: at most one live run of an idempotent task's key, and none after a success.
    # Each call is idempotent for its owner (a re-claim by the same owner is CLAIMED), so
    # retrying one whose reply was lost with the connection is safe.
    def claim(self, key: str, owner: str, ttl: float) -> Claim:
        """Atomically take ``key`` for ``owner`` for ``ttl`` seconds: CLAIMED if it was free,
        expired or already ``owner``'s (its expiry is pushed on), HELD if another owner's
        claim is live, DONE if the key finished successfully."""
        check_claim(owner, ttl)
        return self.retrying(f"claiming {key}", lambda: self._claim(key, owner, ttl))

    def renew_claims(self, claims: Mapping[str, str], ttl: float) -> set[str]:
        """Push each claim (key -> owner) still held by its owner to ``ttl`` seconds from
        now, in one round trip; returns the keys whose claim was lost (expired, taken by
        another owner, or done)."""
        for owner in claims.values():
            check_claim(owner, ttl)
        if not claims:
            return set()
        return self.retrying(f"renewing {len(claims)} claims",
                             lambda: self._renew_claims(claims, ttl))

    def release_claim(self, key: str, owner: str) -> None:
        """Drop the claim on ``key`` if ``owner`` still holds it (the run failed or stopped)."""
        self.retrying(f"releasing claim {key}", lambda: self._release_claim(key, owner))

    def finish_claim(self, key: str, owner: str) -> None:
        """Mark ``key`` done for ``expires`` seconds (None: for good), whoever holds it now:
        the run did succeed. ``owner`` names the finisher in logs only."""
        self.retrying(f"finishing claim {key} for {owner}", lambda: self._finish_claim(key))

    def _claim(self, key: str, owner: str, ttl: float) -> Claim:
        raise NotImplementedError(self._no_claims())

    def _renew_claims(self, claims: Mapping[str, str], ttl: float) -> set[str]:
        raise NotImplementedError(self._no_claims())

    def _release_claim(self, key: str, owner: str) -> None:
        raise NotImplementedError(self._no_claims())

    def _finish_claim(self, key: str) -> None:
        raise NotImplementedError(self._no_claims())

    def _no_claims(self) -> str:
        return (f"{type(self).__name__} does not support claims, which idempotent tasks "
                "need: use a result_backend that does (sqlite://, redis:// or db+…)")

    # -- the fences of periodic tasks (``workhorse.transport.fenced``), where the broker
    # cannot hold them in the step that publishes (RabbitMQ): moved here, then published.
    def move_fence(self, ticket: Ticket) -> tuple[bool, Record | None]:
        """Move ``ticket``'s fence if its record is older: (True, None). Refused: (False,
        holder); moved by this ticket before (a retried call): (True, holder)."""
        return self.retrying(f"moving the fence of schedule {ticket.name}",
                             lambda: self._move_fence(ticket))

    def settle_fence(self, ticket: Ticket, record: Record) -> None:
        """Replace ``ticket``'s record by ``record`` (its publish done, or failed: the
        fence goes back to ``record``) if the fence still holds ``ticket``'s; and drop
        ``ticket`` from the pending due times if it is still there as it was."""
        self.retrying(f"settling the fence of schedule {ticket.name}",
                      lambda: self._settle_fence(ticket, record))

    def fence_records(self, names: Iterable[str]) -> dict[str, Record]:
        names = list(names)
        return self.retrying("reading the fences of schedules",
                             lambda: self._fence_records(names))

    def pending_fences(self, name: str) -> list[Record]:
        """``name``'s due times moved by ``move_fence`` and not settled yet."""
        return self.retrying(f"reading the pending due times of schedule {name}",
                             lambda: self._pending_fences(name))

    def take_pending(self, name: str, old: Record, new: Record) -> bool:
        """Replace the pending ``old`` by ``new`` (another worker takes over its publish),
        if it is still there as it was."""
        return self.retrying(f"taking over a due time of schedule {name}",
                             lambda: self._take_pending(name, old, new))

    def _pending_fences(self, name: str) -> list[Record]:
        raise NotImplementedError(self._no_fences())

    def _take_pending(self, name: str, old: Record, new: Record) -> bool:
        raise NotImplementedError(self._no_fences())

    def _move_fence(self, ticket: Ticket) -> tuple[bool, Record | None]:
        raise NotImplementedError(self._no_fences())

    def _settle_fence(self, ticket: Ticket, record: Record) -> None:
        raise NotImplementedError(self._no_fences())

    def _fence_records(self, names: list[str]) -> dict[str, Record]:
        raise NotImplementedError(self._no_fences())

    def _no_fences(self) -> str:
        return (f"{type(self).__name__} cannot hold the fences of periodic tasks: use a "
                "result_backend that can (sqlite:// or redis://)")

    # -- revoked tasks, shared by every worker on this store (remote control's revoke):
    # entries (``workhorse.control.revoked``) with their expiry in epoch seconds.
    def save_revoked(self, entries: Mapping[str, float]) -> None:
        """Keep ``entries`` until they expire (an entry kept already gets the later expiry);
        at most ``REVOKES_MAX`` are kept, the soonest to expire dropped first."""
        if entries:
            self.retrying(f"keeping {len(entries)} revoked entries",
                          lambda: self._save_revoked(entries))

    def load_revoked(self) -> dict[str, float]:
        """Every entry kept and not yet expired."""
        return self.retrying("reading revoked entries", self._load_revoked)

    def _save_revoked(self, entries: Mapping[str, float]) -> None:  # noqa: B027 - a default
        """A store that cannot keep them: revokes reach only the workers online."""

    def _load_revoked(self) -> dict[str, float]:
        return {}

    @staticmethod
    def encode_part(state: str, result: Any) -> Any:
        if state != SUCCESS and isinstance(result, BaseException):
            return encode_exception(result)
        return result


class DisabledBackend(Backend):
    """``result_backend = "disabled"``: results are not stored and cannot be read."""

    def _set(self, task_id: str, state: str, payload: str) -> None:
        return None

    def _get(self, task_id: str) -> str | None:
        raise NotImplementedError(
            "results are disabled (result_backend = \"disabled\"): set result_backend "
            "to read task results")

    def _forget(self, task_id: str) -> None:
        return None

    def _no_claims(self) -> str:
        return ("idempotent tasks need a result store to claim their keys in, and results "
                "are disabled (result_backend = \"disabled\"): set result_backend to a "
                "sqlite://, redis:// or db+ URL, or drop idempotent=True")
