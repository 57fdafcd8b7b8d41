"""Results in Redis with Celery's key layout, so Celery clients read them unchanged.

Guarantees: what Redis guarantees (with persistence off, a Redis restart loses results).
``SETEX`` gives every result ``result_expires`` seconds (none/0: kept until forgotten).
Waiting clients subscribe to the result's channel, read it once, then wait for the publish;
after a lost connection they reconnect, resubscribe and read again.
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from typing import Any

import redis
from redis.sentinel import MasterNotFoundError, Sentinel

from ..control.revoked import REVOKES_MAX
from ..exceptions import TimeoutError
from ..states import READY_STATES
from ..urls import SENTINEL, scheme_of, sentinels, split_master_name
from ..transport import fenced
from ..transport.fenced import Record, Ticket
from ..transport.luascript import Direct, Script
from .base import CLAIM_DONE, Backend, ChordCompletion, ChordPart, Claim
from .encoding import dumps, loads

TASK_PREFIX = "celery-task-meta-"
GROUP_PREFIX = "celery-taskset-meta-"
#: ``workhorse-claim-<key>`` holds the owner while claimed, ``done`` once finished.
CLAIM_PREFIX = "workhorse-claim-"
#: The revoked entries every worker reads: a sorted set, scored by expiry (epoch seconds).
REVOKED_KEY = "workhorse-revoked"
#: How long the worker that completes a chord holds its claim while it dispatches the body.
CHORD_CLAIM_SECONDS = 30
#: How long a finished chord is remembered, so a late duplicate part cannot restart it.
CHORD_DONE_SECONDS = 300

# The chord keys are Celery's (celery-taskset-meta-<group>.j/.t/.s/.d/.c): a chord's parts
# may be counted by Celery and workhorse workers alike. The client stores the size in .s.
_PART_RETURN = """
local jkey, tkey, skey, dkey, ckey = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local task_id, value, score = ARGV[1], ARGV[2], ARGV[3]
local expires, claim_seconds, token = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
if redis.call('GET', ckey) == 'done' then
    return {-1, 0, 0}
end
if redis.call('SADD', dkey, task_id .. ':' .. score) == 1 then
    redis.call('ZADD', jkey, score, value)
end
local ready = redis.call('ZCARD', jkey)
if expires > 0 then
    for _, key in ipairs({jkey, tkey, skey, dkey}) do
        redis.call('EXPIRE', key, expires)
    end
end
local size = tonumber(redis.call('GET', skey) or '0')
local total = size + tonumber(redis.call('GET', tkey) or '0')
local claimed = 0
if size > 0 and ready == total then
    -- The claim is the completing part's task id, so that part's redelivery (its worker
    -- died before the body was sent) takes it again at once; any other part waits for it
    -- to lapse.
    if redis.call('SET', ckey, token, 'NX', 'EX', claim_seconds) then
        claimed = 1
    elseif redis.call('GET', ckey) == token then
        redis.call('EXPIRE', ckey, claim_seconds)
        claimed = 1
    end
end
return {ready, total, claimed}
"""
_FINISH = """
if redis.call('GET', KEYS[5]) == ARGV[1] then
    redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4])
    redis.call('SET', KEYS[5], 'done', 'EX', tonumber(ARGV[2]))
    return 1
end
return 0
"""

# Claims: GET-compare-SET in one script each, so no other client acts between the read and
# the write. ARGV[1] is the owner; 'done' is never an owner (base.check_claim).
_CLAIM = """
local value = redis.call('GET', KEYS[1])
if value == 'done' then
    return 'done'
end
if value and value ~= ARGV[1] then
    return 'held'
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 'claimed'
"""
# KEYS[i] is renewed for owner ARGV[i + 1]; returns the positions of the lost ones.
_RENEW = """
local lost = {}
for i, key in ipairs(KEYS) do
    if redis.call('GET', key) == ARGV[i + 1] then
        redis.call('PEXPIRE', key, ARGV[1])
    else
        table.insert(lost, i)
    end
end
return lost
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""


# KEYS[1] the revoked set; ARGV: now, limit, then entry, expiry pairs. An entry kept
# already keeps the later expiry; expired ones go, and the soonest to expire past the limit.
_SAVE_REVOKED = """
for i = 3, #ARGV, 2 do
    local old = redis.call('ZSCORE', KEYS[1], ARGV[i])
    if not old or tonumber(old) < tonumber(ARGV[i + 1]) then
        redis.call('ZADD', KEYS[1], ARGV[i + 1], ARGV[i])
    end
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -tonumber(ARGV[2]) - 1)
"""


def _milliseconds(ttl: float) -> int:
    """PX wants a whole number of milliseconds, at least one."""
    return max(1, math.ceil(ttl * 1000))


#: The fence's settling (``Backend.settle_fence``). KEYS: the record. ARGV: the ticket's
#: task id, the new nominal time, the new record.
_SETTLE_FENCE = """
local current = redis.call('HGET', KEYS[1], 'record')
if current and cjson.decode(current)['task_id'] == ARGV[1] then
    redis.call('HSET', KEYS[1], 'nominal', ARGV[2], 'record', ARGV[3])
end
if redis.call('HGET', KEYS[2], ARGV[4]) == ARGV[5] then
    redis.call('HDEL', KEYS[2], ARGV[4])
end
return 0
"""
#: A pending due time taken over. KEYS: the pending hash. ARGV: its nominal, old, new.
_TAKE_PENDING = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
    redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
    return 1
end
return 0
"""


#: A task's result, stored with its expiry (ARGV[2], seconds; '' for none) and published,
#: in one step, as Celery's MULTI/EXEC of SETEX and PUBLISH does: one command for four
#: (the child's CPU for a store, measured alone: 42 µs as a transaction, 21 µs as this).
_STORE = Script("""
if ARGV[2] == '' then
    redis.call('SET', KEYS[1], ARGV[1])
else
    redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
end
redis.call('PUBLISH', KEYS[1], ARGV[1])
return 0
""")


class RedisBackend(Backend):
    """``SET … EX`` + ``PUBLISH`` in one script; waiting clients subscribe, then GET once."""

    def __init__(self, url: str, *, transport_options: Mapping[str, Any] | None = None,
                 **options: Any) -> None:
        super().__init__(url, **options)
        self.transport_options = dict(transport_options or {})
        self._client: redis.Redis | None = None
        self._pid = 0
        #: Results are stored on a connection of their own (one round trip, no pool).
        self._direct = Direct()

    @property
    def client(self) -> redis.Redis:
        if self._client is None or self._pid != os.getpid():
            # socket_timeout: a silent server fails a call (retried) rather than hanging it.
            timeouts: dict[str, Any] = {"socket_connect_timeout": 5, "socket_timeout": 10,
                                        "socket_keepalive": True, "health_check_interval": 30}
            if scheme_of(self.url) == SENTINEL:
                self._client = self._master(timeouts)
            else:
                self._client = redis.Redis.from_url(self.url, **timeouts)
            self._pid = os.getpid()
        return self._client

    def _master(self, timeouts: dict[str, Any]) -> redis.Redis:
        """A client of the master the sentinels name; its pool asks them again at each new
        connection, so a call retried after a failover goes to the new master."""
        _, master_name = split_master_name(self.url)
        master_name = master_name or self.transport_options.get("master_name")
        found = sentinels(self.url)
        sentinel = Sentinel(list(found.addresses),
                            sentinel_kwargs=self.transport_options.get("sentinel_kwargs"),
                            socket_connect_timeout=5, socket_timeout=5)
        return sentinel.master_for(str(master_name), db=found.db, password=found.password,
                                   **timeouts)

    def close(self) -> None:
        self._direct.close()
        if self._client is not None and self._pid == os.getpid():
            try:
                self._client.close()
            except redis.RedisError:
                pass
        self._client = None

    def exception_safe_to_retry(self, exc: BaseException) -> bool:
        # (a failover: no master known yet, or a write sent to the old master now a
        # replica, which refuses it)
        return isinstance(exc, (redis.ConnectionError, redis.TimeoutError,
                                redis.exceptions.BusyLoadingError, MasterNotFoundError,
                                redis.exceptions.ReadOnlyError))

    @staticmethod
    def key(task_id: str) -> str:
        return TASK_PREFIX + task_id

    def _ex(self) -> int | None:
        """``result_expires`` as SET's EX (whole seconds, at least one); None: no expiry."""
        return max(1, int(self.expires)) if self.expires else None

    # -- fences of periodic tasks
    def _move_fence(self, ticket: Ticket) -> tuple[bool, Record | None]:
        answer = self.client.eval(fenced.REDIS_MOVE, 3, fenced.redis_key(ticket.name), "",
                                  fenced.redis_pending_key(ticket.name),
                                  repr(ticket.record.nominal), ticket.record.dumps(),
                                  ticket.record.task_id, "")
        return fenced.redis_answer(ticket, answer)

    def _settle_fence(self, ticket: Ticket, record: Record) -> None:
        self.client.eval(_SETTLE_FENCE, 2, fenced.redis_key(ticket.name),
                         fenced.redis_pending_key(ticket.name), ticket.record.task_id,
                         repr(record.nominal), record.dumps(), repr(ticket.record.nominal),
                         ticket.record.dumps())

    def _pending_fences(self, name: str) -> list[Record]:
        found = self.client.hvals(fenced.redis_pending_key(name))
        records = [r for text in found if (r := fenced.record_or_none(text)) is not None]
        return sorted(records, key=lambda r: r.nominal)

    def _take_pending(self, name: str, old: Record, new: Record) -> bool:
        return bool(self.client.eval(_TAKE_PENDING, 1, fenced.redis_pending_key(name),
                                     repr(old.nominal), old.dumps(), new.dumps()))

    def _fence_records(self, names: list[str]) -> dict[str, Record]:
        texts = [self.client.hget(fenced.redis_key(name), "record") for name in names]
        return {name: record for name, text in zip(names, texts, strict=True)
                if text and (record := fenced.record_or_none(text)) is not None}

    # -- task results
    def _set(self, task_id: str, state: str, payload: str) -> None:
        ex = self._ex()
        self._direct.run(self.client.connection_pool, _STORE, (self.key(task_id),),
                         (payload, "" if ex is None else ex))

    def _get(self, task_id: str) -> str | None:
        value = self.client.get(self.key(task_id))
        return value.decode() if isinstance(value, bytes) else value

    def _forget(self, task_id: str) -> None:
        self.client.delete(self.key(task_id))

    def wait_for(self, task_id: str, timeout: float | None = None,
                 interval: float = 0.5) -> dict[str, Any]:
        """Subscribe, read once Redis has confirmed the subscription, then wait for the
        publish; no polling loop. (Read before the confirmation, a result stored between the
        read and the moment Redis takes the SUBSCRIBE would never be seen.)"""
        deadline = None if timeout is None else time.monotonic() + timeout
        channel = self.key(task_id)
        while True:
            pubsub = None
            try:
                pubsub = self.client.pubsub()
                pubsub.subscribe(channel)
                meta: dict[str, Any] | None = None      # not read yet
                while meta is None or meta["status"] not in READY_STATES:
                    wait = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
                    if wait <= 0:
                        raise TimeoutError(f"task {task_id} not ready after {timeout} s")
                    message = pubsub.get_message(timeout=wait)
                    if message is None:
                        continue
                    if message["type"] == "subscribe":
                        meta = self.get_task_meta(task_id)
                    elif message["type"] == "message":
                        meta = loads(message["data"])
                return meta
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                # Publishes sent while we were away are lost: reconnect and read again.
                self.on_connection_error(exc)
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"task {task_id} not ready after {timeout} s") from exc
                time.sleep(self.retry_policy.delay(2))
            finally:
                if pubsub is not None:
                    try:
                        pubsub.close()
                    except redis.RedisError:
                        pass

    # -- groups
    def _set_group(self, group_id: str, payload: str) -> None:
        self.client.set(GROUP_PREFIX + group_id, payload, ex=self._ex())

    def _get_group(self, group_id: str) -> str | None:
        value = self.client.get(GROUP_PREFIX + group_id)
        return value.decode() if isinstance(value, bytes) else value

    def _forget_group(self, group_id: str) -> None:
        self.client.delete(GROUP_PREFIX + group_id)

    # -- chords
    @staticmethod
    def _chord_keys(group_id: str) -> list[str]:
        base = GROUP_PREFIX + group_id
        return [base + ".j", base + ".t", base + ".s", base + ".d", base + ".c"]

    def set_chord_size(self, group_id: str, size: int) -> None:
        keys = self._chord_keys(group_id)

        def setup() -> None:
            with self.client.pipeline(transaction=True) as pipe:
                pipe.delete(keys[4])          # a re-applied chord is a new run
                pipe.set(keys[2], size, ex=self._ex())
                pipe.execute()
        self.retrying(f"setting up chord {group_id}", setup)

    def chord_part_return(self, group_id: str, task_id: str, index: int | None, state: str,
                          result: Any) -> ChordCompletion | None:
        value = dumps([1, task_id, state, self.encode_part(state, result)])
        token = task_id
        keys = self._chord_keys(group_id)
        score = "+inf" if index is None else str(index)

        def count() -> list[Any]:
            return self.client.eval(_PART_RETURN, 5, *keys, task_id, value, score,
                                    int(self.expires or 0), CHORD_CLAIM_SECONDS, token)
        ready, _total, claimed = self.retrying(f"counting chord {group_id}", count)
        if ready == -1 or not claimed:
            return None
        members = self.retrying(f"reading chord {group_id}",
                                lambda: self.client.zrange(keys[0], 0, -1))
        parts = [ChordPart(tid, st, res) for _, tid, st, res in (loads(m) for m in members)]
        return ChordCompletion(parts, token)

    def chord_finished(self, group_id: str, token: str) -> None:
        keys = self._chord_keys(group_id)
        self.retrying(f"finishing chord {group_id}", lambda: self.client.eval(
            _FINISH, 5, *keys, token, CHORD_DONE_SECONDS))

    # -- claims (retried by the base class's public methods)
    def _claim(self, key: str, owner: str, ttl: float) -> Claim:
        value = self.client.eval(_CLAIM, 1, CLAIM_PREFIX + key, owner, _milliseconds(ttl))
        return Claim(value.decode() if isinstance(value, bytes) else value)

    def _renew_claims(self, claims: Mapping[str, str], ttl: float) -> set[str]:
        keys = list(claims)
        lost = self.client.eval(_RENEW, len(keys), *(CLAIM_PREFIX + key for key in keys),
                                _milliseconds(ttl), *(claims[key] for key in keys))
        return {keys[position - 1] for position in lost}

    # -- revoked
    def _save_revoked(self, entries: Mapping[str, float]) -> None:
        pairs = [item for entry, until in entries.items() for item in (entry, repr(until))]
        self.client.eval(_SAVE_REVOKED, 1, REVOKED_KEY, repr(time.time()), REVOKES_MAX, *pairs)

    def _load_revoked(self) -> dict[str, float]:
        found: list[tuple[bytes, float]] = self.client.zrangebyscore(  # type: ignore[assignment]
            REVOKED_KEY, f"({time.time()!r}", "+inf", withscores=True)
        return {entry.decode(): float(until) for entry, until in found}

    def _release_claim(self, key: str, owner: str) -> None:
        self.client.eval(_RELEASE, 1, CLAIM_PREFIX + key, owner)

    def _finish_claim(self, key: str) -> None:
        self.client.set(CLAIM_PREFIX + key, CLAIM_DONE, ex=self._ex())
