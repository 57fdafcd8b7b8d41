"""Claims in the result stores (SQLite and Redis), the storage side of idempotent tasks:
claim, hold, finish, expiry, renewal, release, a race between processes, the purge, and an
existing SQLite file gaining the claims table."""
from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from workhorse.backends import Backend, Claim, DisabledBackend, backend_from_url
from workhorse.backends.sqlite import SCHEMA_VERSION, SQLiteBackend

from .conftest import require_service, wait_until

pytestmark = pytest.mark.timeout(60)
REDIS_CLAIMS = "redis://127.0.0.1:6379/1"
#: Short enough to wait out in a test, long enough that a claim taken just before is live.
SHORT = 0.3
LONG = 30.0


def new_key() -> str:
    return f"test-claim-{uuid.uuid4().hex}"


@pytest.fixture(params=["sqlite", "redis"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "redis":
        require_service("Redis", 6379)
        return REDIS_CLAIMS
    return f"sqlite:///{tmp_path / 'results.sqlite3'}"


@pytest.fixture
def open_backend(url: str) -> Iterator[Callable[..., Backend]]:
    """Backends on the test's store; done keys expire after a minute unless told."""
    opened: list[Backend] = []

    def open_(expires: float | None = 60) -> Backend:
        backend = backend_from_url(url, expires=expires)
        opened.append(backend)
        return backend

    yield open_
    for backend in opened:
        backend.close()


@pytest.fixture
def backend(open_backend: Callable[..., Backend]) -> Backend:
    return open_backend()


def wait_for_lapse(backend: Backend) -> None:
    """Return once every claim taken before this call with ttl SHORT has lapsed: a control
    key claimed now with the same ttl can then be taken by another owner."""
    control = new_key()
    assert backend.claim(control, "clock", SHORT) is Claim.CLAIMED
    wait_until(lambda: backend.claim(control, "probe", LONG) is Claim.CLAIMED, 10,
               f"a {SHORT} s claim to lapse")


# ---------------------------------------------------------------- transitions
def test_claim_is_held_against_others_and_done_after_finish(backend: Backend) -> None:
    key = new_key()
    assert backend.claim(key, "a", LONG) is Claim.CLAIMED
    assert backend.claim(key, "b", LONG) is Claim.HELD
    assert backend.claim(key, "a", LONG) is Claim.CLAIMED      # same owner: still its own
    backend.finish_claim(key, "a")
    assert backend.claim(key, "b", LONG) is Claim.DONE
    assert backend.claim(key, "a", LONG) is Claim.DONE


def test_reclaim_by_the_same_owner_extends_the_claim(backend: Backend) -> None:
    key = new_key()
    assert backend.claim(key, "a", SHORT) is Claim.CLAIMED
    assert backend.claim(key, "a", LONG) is Claim.CLAIMED
    wait_for_lapse(backend)
    assert backend.claim(key, "b", LONG) is Claim.HELD


def test_unrenewed_claim_lapses_and_another_owner_takes_it(backend: Backend) -> None:
    key = new_key()
    assert backend.claim(key, "a", SHORT) is Claim.CLAIMED
    assert backend.claim(key, "b", LONG) is Claim.HELD
    wait_until(lambda: backend.claim(key, "b", LONG) is Claim.CLAIMED, 10,
               "b to take the lapsed claim")
    assert backend.claim(key, "a", LONG) is Claim.HELD


def test_renew_keeps_held_claims_and_reports_the_lost_ones(backend: Backend) -> None:
    kept, lapsed, taken, done, never = (new_key() for _ in range(5))
    for key in (kept, lapsed, taken, done):
        assert backend.claim(key, "a", SHORT) is Claim.CLAIMED
    assert backend.renew_claims({kept: "a", done: "a"}, LONG) == set()
    wait_for_lapse(backend)
    assert backend.claim(taken, "b", LONG) is Claim.CLAIMED
    backend.finish_claim(done, "a")

    lost = backend.renew_claims({kept: "a", lapsed: "a", taken: "a", done: "a", never: "a"},
                                LONG)

    assert lost == {lapsed, taken, done, never}
    assert backend.claim(kept, "b", LONG) is Claim.HELD         # renewed past its first ttl
    assert backend.claim(lapsed, "b", LONG) is Claim.CLAIMED    # not revived by the renewal
    assert backend.claim(taken, "a", LONG) is Claim.HELD        # still b's
    assert backend.claim(done, "b", LONG) is Claim.DONE
    assert backend.renew_claims({}, LONG) == set()


def test_release_drops_the_claim_only_for_its_owner(backend: Backend) -> None:
    key = new_key()
    assert backend.claim(key, "a", LONG) is Claim.CLAIMED
    backend.release_claim(key, "b")
    assert backend.claim(key, "b", LONG) is Claim.HELD
    backend.release_claim(key, "a")
    assert backend.claim(key, "b", LONG) is Claim.CLAIMED
    backend.release_claim(key, "a")                             # a no longer holds it
    assert backend.claim(key, "a", LONG) is Claim.HELD


def test_release_does_not_undo_a_finish(backend: Backend) -> None:
    key = new_key()
    assert backend.claim(key, "a", LONG) is Claim.CLAIMED
    backend.finish_claim(key, "a")
    backend.release_claim(key, "a")
    assert backend.claim(key, "b", LONG) is Claim.DONE


def test_finish_marks_done_whoever_holds_the_claim(backend: Backend) -> None:
    key = new_key()
    assert backend.claim(key, "a", SHORT) is Claim.CLAIMED
    wait_until(lambda: backend.claim(key, "b", LONG) is Claim.CLAIMED, 10,
               "b to take the lapsed claim")
    backend.finish_claim(key, "a")          # a's run finished late, after b took over
    assert backend.claim(key, "b", LONG) is Claim.DONE
    assert backend.claim(key, "c", LONG) is Claim.DONE
    unclaimed = new_key()
    backend.finish_claim(unclaimed, "a")
    assert backend.claim(unclaimed, "c", LONG) is Claim.DONE


def test_finished_claims_expire_with_result_expires(open_backend: Callable[..., Backend]) -> None:
    backend = open_backend(expires=1)       # Redis's EX counts whole seconds
    key = new_key()
    assert backend.claim(key, "a", LONG) is Claim.CLAIMED
    backend.finish_claim(key, "a")
    assert backend.claim(key, "b", LONG) is Claim.DONE
    wait_until(lambda: backend.claim(key, "b", LONG) is Claim.CLAIMED, 10,
               "the done mark to expire after 1 s")


# ---------------------------------------------------------------- a real race
def _claim_at_once(url: str, key: str, index: int, barrier: Any, results: Any) -> None:
    try:
        backend = backend_from_url(url)
        backend.get_task_meta("warm-up")    # connect first, so the claims meet at the store
        barrier.wait(20)
        results.put((index, backend.claim(key, f"owner-{index}", LONG).value))
        backend.close()
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        results.put((index, repr(exc)))


def test_one_of_eight_processes_claiming_at_once_gets_the_claim(url: str, fork_ctx) -> None:
    ctx = fork_ctx
    for attempt in range(3):        # a race is a matter of timing: give it several chances
        key = new_key()
        barrier, results = ctx.Barrier(8), ctx.Queue()
        procs = [ctx.Process(target=_claim_at_once, args=(url, key, i, barrier, results))
                 for i in range(8)]
        for proc in procs:
            proc.start()
        outcomes = dict(results.get(timeout=30) for _ in procs)
        for proc in procs:
            proc.join(30)
        assert sorted(outcomes.values()) == ["claimed"] + ["held"] * 7, (attempt, outcomes)
        assert all(proc.exitcode == 0 for proc in procs)


# ---------------------------------------------------------------- SQLite specifics
@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'results.sqlite3'}"


def test_purge_expired_removes_lapsed_and_expired_claims(sqlite_url: str) -> None:
    short_lived = SQLiteBackend(sqlite_url, expires=SHORT)
    kept_forever = SQLiteBackend(sqlite_url)
    lapsed, finished, live, finished_for_good = "lapsed", "finished", "live", "for-good"
    assert short_lived.claim(lapsed, "a", SHORT) is Claim.CLAIMED
    short_lived.finish_claim(finished, "a")         # done for SHORT seconds
    kept_forever.finish_claim(finished_for_good, "a")
    wait_for_lapse(short_lived)
    assert short_lived.claim(live, "a", LONG) is Claim.CLAIMED

    short_lived.purge_expired()

    rows = {key for (key,) in short_lived.conn.execute("SELECT key FROM claims")}
    assert {lapsed, finished}.isdisjoint(rows)
    assert {live, finished_for_good} <= rows
    assert kept_forever.claim(finished_for_good, "b", LONG) is Claim.DONE
    short_lived.close()
    kept_forever.close()


def test_a_file_from_before_claims_gains_the_table(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    old = SQLiteBackend(f"sqlite:///{path}")
    old.store_result("t1", 1, "SUCCESS")
    old.close()
    conn = sqlite3.connect(path)        # make it what schema version 2 wrote
    conn.executescript("DROP TABLE claims; PRAGMA user_version = 2;")
    conn.close()

    backend = SQLiteBackend(f"sqlite:///{path}")
    assert backend.claim("k", "a", LONG) is Claim.CLAIMED
    assert backend.get_task_meta("t1")["result"] == 1
    assert backend.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    backend.close()


# ---------------------------------------------------------------- Redis layout
def test_redis_claim_keys_hold_the_owner_then_done() -> None:
    require_service("Redis", 6379)
    import redis
    backend = backend_from_url(REDIS_CLAIMS, expires=60)
    client = redis.Redis.from_url(REDIS_CLAIMS)
    key = new_key()
    assert backend.claim(key, "a", LONG) is Claim.CLAIMED
    assert client.get(f"workhorse-claim-{key}") == b"a"
    assert 0 < client.pttl(f"workhorse-claim-{key}") <= LONG * 1000
    backend.finish_claim(key, "a")
    assert client.get(f"workhorse-claim-{key}") == b"done"
    assert 0 < client.ttl(f"workhorse-claim-{key}") <= 60
    client.delete(f"workhorse-claim-{key}")
    client.close()
    backend.close()


# ---------------------------------------------------------------- without a store
def test_disabled_results_refuse_claims_naming_result_backend() -> None:
    with pytest.raises(NotImplementedError, match="result_backend"):
        DisabledBackend("disabled").claim("k", "a", LONG)


def test_a_backend_without_claims_says_so() -> None:
    class Minimal(Backend):
        def _set(self, task_id: str, state: str, payload: str) -> None: ...
        def _get(self, task_id: str) -> str | None: ...
        def _forget(self, task_id: str) -> None: ...

    with pytest.raises(NotImplementedError, match="Minimal does not support claims"):
        Minimal("x").renew_claims({"k": "a"}, LONG)


@pytest.mark.parametrize("owner, ttl", [("done", LONG), ("", LONG), ("a", 0), ("a", -1)])
def test_reserved_owners_and_non_positive_ttls_are_refused(owner: str, ttl: float) -> None:
    with pytest.raises(ValueError):
        DisabledBackend("disabled").claim("k", owner, ttl)
