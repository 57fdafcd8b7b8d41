"""kombu's Redis transport, with leases a live worker renews and acks that touch only its own copy.

kombu keeps each unacknowledged message in the hash ``unacked`` (delivery tag → message)
and the sorted set ``unacked_index`` (delivery tag → when it was delivered); a sweep
(``restore_visible``) puts back every message delivered more than ``visibility_timeout``
ago, on the assumption that its consumer died. Two consequences for a worker that holds
messages for long (Celery's well-known duplicates):

1. A live worker's long task, or an ETA message it holds, is put back and run again once
   the timeout passes. Here the worker *renews* what it holds: ``Channel.renew`` moves the
   index entry's score forward, well before the sweep would pick it.
2. A message put back keeps its delivery tag. When its first holder acks late, kombu's ack
   deletes that tag from both keys: the bookkeeping of the copy another worker now holds,
   which is then never put back if that worker dies. Here each lease is the pair (tag,
   score it was given); ack, reject and renew act only while ``unacked_index`` still holds
   our score, so a lost lease is detected and never settles somebody else's copy.

3. kombu consumes with BRPOP: Redis pops the message and sends it; if the connection or
   the server dies between the pop and our writing the unacked entry (a Redis killed
   after logging the pop to its append-only file, before the reply left), the message is
   gone. Here a Lua script takes the message off its list *and* writes its unacked entry
   in one step (``Channel.take``), so a message is always either in its list or in
   ``unacked``. To wait without polling, one idle connection per list blocks in
   ``BLMOVE key key RIGHT RIGHT`` (a move onto itself, which changes nothing) until the
   list is non-empty (``ListWaiter``); Redis older than 6.2 has no BLMOVE, and is polled.
   The unacked entry names the queue the message was taken from (as the anonymous
   exchange's routing key), so a message put back goes there, once, whatever its
   delivery_info says; kombu's restore would route it again (into every queue a topic
   exchange's key matches), and drops or stops at one with no routing key.

4. kombu counts nothing: a message put back by the sweep after its worker died looks like
   any other. Here the take also counts the delivery, in the same script (``HINCRBY`` in
   the hash ``delivery_counts``, keyed by delivery tag, which kombu keeps when it puts a
   message back), and the count is handed over in ``delivery_info["delivery_count"]``
   (the message's JSON is never re-encoded in Lua: cjson would turn ``[]`` into ``{}``).
   A clean hand-back by a live worker (``reject(requeue=True)``) takes the count back in
   the transaction that restores the message, and so does ``Channel.forget`` for a lease
   lost by a live worker; kombu's sweep, or a channel closed holding messages, leaves
   them counted. Acking (or dead-lettering) removes the count with the lease; a counted
   message deleted from its list otherwise (a purge) leaves its entry behind.

5. An entry that is not kombu's JSON with a delivery tag (written by another program, or by
   hand) can be neither delivered nor put back. The take leaves it where it is and says
   so; the channel then replaces it, in one script that checks it is still there, by a
   readable envelope in ``<queue>.dead`` (``workhorse.transport.unreadable``). An entry
   the script could read but Python cannot (invalid UTF-8, a body that is not base64) is
   replaced by its envelope the same way, from its unacked entry, while the lease is ours.
   An unacked entry that cannot be read when it is put back (``Channel.put_back``) goes
   to ``unrouted.dead`` in its envelope: kombu's sweep raised on it, every sweep.

6. Celery *workers* consuming the same database renew nothing, so our short timeout says
   nothing about whether one holding a message is alive. Their leases have no delivery
   count (every lease of ours has one, ``take`` or ``_record``): the sweep leaves such a
   lease until the channel's ``foreign_visibility_timeout`` (the celery_visibility_timeout
   setting) and logs it once, instead of running a live Celery worker's long task twice.

The keys and the message layout are kombu's own: Celery producers feed these workers, and
kombu's sweep (run by every consumer) restores what a dead worker held. Scores are
wall-clock times: the hosts' clocks must agree to well within visibility_timeout/4.
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import ssl
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from datetime import UTC, datetime
from time import monotonic, time
from typing import Any, NamedTuple

import hiredis
from hiredis import pack_command
from kombu.transport import redis, virtual
from kombu.utils.json import dumps
from redis.exceptions import ConnectionError as RedisConnectionError

from ..protocol import (DEAD_AT_HEADER, DEAD_REASON_HEADER, Verdict, after_loss,
                        dead_letter_queue)
from . import fenced, unreadable
from .luascript import Direct, Script
from .backlog import Backlog, sent_at, stamp_properties
from .delivering import Delivering

log = logging.getLogger("workhorse.transport.redis")


#: A periodic task's fenced put (``transport.fenced``).
_FENCED_PUT = Script(fenced.REDIS_MOVE)

# A lease lost by a live worker: take back the delivery its take counted, unless the lease
# is still ours after all, or the message is gone (acked elsewhere: its count with it).
# KEYS: unacked_index, delivery_counts. ARGV: tag, our score ('' once we know it is lost).
_UNCOUNT_LOST = Script("""
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and ARGV[2] ~= '' and tonumber(score) == tonumber(ARGV[2]) then
    return 0
end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then
    redis.call('HINCRBY', KEYS[2], ARGV[1], -1)
    return 1
end
return 0
""")
# Ack, then take: one round trip for a turn's acks and the next messages. First the acks:
# for each (tag, score) pair in ARGV[5 .. 4 + 2 * ARGV[4]], remove the lease (its delivery
# count and owner mark with it) if the score is ours; a lease lost meanwhile is left to its
# new holder. Then take up to ARGV[2] (0: acks alone) messages off the lists, in order (a
# list is emptied before the next is read), each recorded as unacked, its delivery counted
# and, when ARGV[3] is not empty, marked as leased by that owner (the worker's journal
# names its owner: a worker that finds it dead puts back what it held), in the same step.
# KEYS: unacked_index, unacked, delivery_counts, lease_owners, then the lists in order.
# ARGV: the score, the limit, the owner, the number of ack pairs, the pairs. Returns the
# number of lost acks and their tags, then {position of the list, message, delivery count,
# delivery tag} for each message taken, flattened. The unacked entry names the message's
# way home as the anonymous exchange and the queue it was taken from (its list's key, the
# priority suffix cut off): whatever its delivery_info says (or lacks: another program's
# producer), it is put back where it was, once. An entry that is not kombu's JSON with a
# delivery tag cannot be acked or put back: it is left in place, and returned last, with
# its list's position negated.
_ACK_TAKE = Script("""
local out = {0}
local acks = tonumber(ARGV[4])
for i = 5, 4 + 2 * acks, 2 do
    local score = redis.call('ZSCORE', KEYS[1], ARGV[i])
    if score and tonumber(score) == tonumber(ARGV[i + 1]) then
        redis.call('ZREM', KEYS[1], ARGV[i])
        redis.call('HDEL', KEYS[2], ARGV[i])
        redis.call('HDEL', KEYS[3], ARGV[i])
        redis.call('HDEL', KEYS[4], ARGV[i])
    else
        table.insert(out, ARGV[i])
        out[1] = out[1] + 1
    end
end
local limit = tonumber(ARGV[2])
local owner = ARGV[3]
local taken = 0
local i = 5
local home_of, home = 0, ''
while i <= #KEYS and taken < limit do
    local payload = redis.call('LINDEX', KEYS[i], -1)
    if not payload then
        i = i + 1
    else
        local ok, message = pcall(cjson.decode, payload)
        local props = ok and type(message) == 'table' and message['properties']
        local tag = type(props) == 'table' and props['delivery_tag']
        if type(tag) ~= 'string' then
            table.insert(out, 4 - i)
            table.insert(out, payload)
            table.insert(out, 0)
            table.insert(out, '')
            return out
        end
        redis.call('RPOP', KEYS[i])
        if home_of ~= i then
            home_of = i
            home = ',"",' .. cjson.encode(string.match(KEYS[i], '^(.*)\\6\\22') or KEYS[i]) .. ']'
        end
        redis.call('ZADD', KEYS[1], ARGV[1], tag)
        redis.call('HSET', KEYS[2], tag, '[' .. payload .. home)
        local count = redis.call('HINCRBY', KEYS[3], tag, 1)
        if owner ~= '' then
            redis.call('HSET', KEYS[4], tag, owner)
        end
        table.insert(out, i - 4)
        table.insert(out, payload)
        table.insert(out, count)
        table.insert(out, tag)
        taken = taken + 1
    end
end
return out
""")
# Replace an unreadable entry, still next in its list, by its envelope in the dead-letter
# list. KEYS: the list, the dead-letter list. ARGV: the entry, its envelope.
_BURY_NEXT = Script("""
if redis.call('LINDEX', KEYS[1], -1) == ARGV[1] then
    redis.call('RPOP', KEYS[1])
    redis.call('LPUSH', KEYS[2], ARGV[2])
    return 1
end
return 0
""")
# Replace a taken message Python cannot read by its envelope, while the lease is ours.
# KEYS: unacked_index, unacked, delivery_counts, lease_owners, the dead-letter list. ARGV:
# tag, our score, the envelope.
_BURY_TAKEN = Script("""
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) == tonumber(ARGV[2]) then
    redis.call('ZREM', KEYS[1], ARGV[1])
    redis.call('HDEL', KEYS[2], ARGV[1])
    redis.call('HDEL', KEYS[3], ARGV[1])
    redis.call('HDEL', KEYS[4], ARGV[1])
    redis.call('LPUSH', KEYS[5], ARGV[3])
    return 1
end
return 0
""")
# KEYS: unacked_index. ARGV: new score, then (tag, our score) pairs. Returns the lost tags.
_RENEW_IF_OURS = Script("""
local lost = {}
for i = 2, #ARGV, 2 do
    local score = redis.call('ZSCORE', KEYS[1], ARGV[i])
    if score and tonumber(score) == tonumber(ARGV[i + 1]) then
        redis.call('ZADD', KEYS[1], ARGV[1], ARGV[i])
    else
        table.insert(lost, ARGV[i])
    end
end
return lost
""")


class QoS(redis.QoS):
    """kombu's Redis ack emulation, with every lease known by the score we gave it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: tag -> the score of our lease; None once the lease is lost (or put back).
        self._scores: dict[str, float | None] = {}
        #: tag -> its unacked entry, for messages popped from their list while Redis went
        #: away before the entry could be written: written by the next renew().
        self._unrecorded: dict[str, str] = {}
        #: tag -> score, for messages Channel.take recorded, until append() sees them.
        self._taken: dict[str, float] = {}
        #: Tags whose delivery we counted (Channel.take, or _record for a basic_get), while
        #: we hold them: a clean hand-back takes the count back.
        self._counted: set[str] = set()
        #: Leases of other consumers (not workhorse workers) the sweep has logged.
        self._foreign_seen: set[str] = set()
        #: score -> its text for the scripts (``score_text``).
        self._score_texts: dict[float, str] = {}

    def score_text(self, score: float) -> str:
        """``repr(score)``, as the scripts compare it: made once a take rather than once
        for every message acked (a float's repr costs as much as a dozen dict lookups)."""
        texts = self._score_texts
        text = texts.get(score)
        if text is None:
            if len(texts) >= 64:
                texts.clear()
            text = texts[score] = repr(score)
        return text

    def append(self, message: Any, delivery_tag: str) -> None:
        if delivery_tag in self._taken:    # recorded (and counted) by the script that took it
            self._scores[delivery_tag] = self._taken.pop(delivery_tag)
            self._counted.add(delivery_tag)
            virtual.QoS.append(self, message, delivery_tag)
            return
        score = time()
        # The way home, as a take writes it: the queue it came from (basic_get's); else
        # (kombu's own delivery) its exchange and routing key, as kombu writes them.
        queue = self.channel._getting_from
        delivery = message.delivery_info if isinstance(message.delivery_info, dict) else {}
        entry = dumps([message._raw, "", queue] if queue else [
            message._raw, _text_or_empty(delivery.get("exchange")),
            _text_or_empty(delivery.get("routing_key"))])
        self._scores[delivery_tag] = score
        try:
            self._record(delivery_tag, entry, score)
            self._counted.add(delivery_tag)
        except self.channel.connection_errors as exc:
            # BRPOP took it off its list already: dropping it here would lose it. Keep it
            # (it is delivered and runs) and record its lease once Redis answers again.
            log.warning("message %s: received, but its lease could not be recorded (%r); "
                        "recorded once Redis answers again", delivery_tag, exc)
            self._unrecorded[delivery_tag] = entry
        virtual.QoS.append(self, message, delivery_tag)

    def _record(self, tag: str, entry: str, score: float) -> None:
        """The lease of a message fetched without ``take`` (``basic_get``), counted as a
        delivery as a take counts it: a lease with no count is another kind of
        consumer's (``_foreign_and_fresh``)."""
        with self.pipe_or_acquire() as pipe:
            pipe.zadd(self.unacked_index_key, {tag: score}).hset(
                self.unacked_key, tag, entry).hincrby(
                self.channel.delivery_counts_key, tag, 1).execute()

    def _record_late(self) -> None:
        if not self._unrecorded:        # (as nearly always: before every take)
            return
        for tag, entry in list(self._unrecorded.items()):
            score = self._scores.get(tag)
            if score is not None:
                self._record(tag, entry, score)
                self._counted.add(tag)
            del self._unrecorded[tag]

    def ack(self, delivery_tag: str) -> None:
        self.ack_many((delivery_tag,))

    def ack_many(self, tags: Sequence[str]) -> None:
        """Ack several messages in one round trip (the broker thread's acks of one turn;
        ``Channel.take`` carries them with the next messages instead)."""
        self._forget_if_ours(tags)
        self._acked(tags, ())

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if requeue:       # a clean hand-back: not a delivery that counts
            self.restore_by_tag(delivery_tag, leftmost=True, uncount=True)
        else:
            self._forget_if_ours((delivery_tag,))
        self._scores.pop(delivery_tag, None)
        self._counted.discard(delivery_tag)
        virtual.QoS.ack(self, delivery_tag)

    def forget(self, delivery_tag: str) -> None:
        """Our lease was lost, though we live: drop it, and take back the count our take
        added (the message is waiting, or held by another worker, and keeps the rest)."""
        if delivery_tag in self._counted:
            self._uncount_lost(delivery_tag, self._scores.get(delivery_tag))
        self._scores.pop(delivery_tag, None)
        self._counted.discard(delivery_tag)
        virtual.QoS.ack(self, delivery_tag)

    def _uncount_lost(self, tag: str, score: float | None) -> None:
        self.channel.run(_UNCOUNT_LOST, (self.unacked_index_key,
                                         self.channel.delivery_counts_key),
                         (tag, "" if score is None else repr(score)))

    def restore_unacked(self, client: Any = None) -> None:
        """On close: what is still held goes back, counted (it was not settled)."""
        with self.channel.conn_or_acquire(client) as client:
            for tag in self._delivered:
                self.restore_by_tag(tag, client=client)
        self._delivered.clear()
        self._scores.clear()
        self._counted.clear()

    def restore_by_tag(self, tag: str, client: Any = None, leftmost: bool = False,
                       uncount: bool = False) -> None:
        """Put a message back, but only while the lease is ours; ``uncount``: a clean
        hand-back, which takes back the delivery our take counted, in the same transaction.
        (kombu's sweep calls this for every abandoned message; those not delivered here are
        restored as kombu does, and stay counted.) Its entry is decoded and encoded again
        with room to spare (``unreadable.headroom``)."""
        with unreadable.headroom():
            self._restore_by_tag(tag, client, leftmost, uncount)

    def _restore_by_tag(self, tag: str, client: Any, leftmost: bool, uncount: bool) -> None:
        if tag not in self._scores:
            if not self._foreign_and_fresh(tag, client):
                self._restore_unheld(tag, client, leftmost)
            return
        score = self._scores[tag]
        self._scores[tag] = None      # put back or found lost: this lease is over either way
        lost = score is None
        uncount = uncount and tag in self._counted
        self._counted.discard(tag)

        def restore(pipe: Any) -> None:
            nonlocal lost
            if pipe.zscore(self.unacked_index_key, tag) != score:
                lost = True
                return
            payload = pipe.hget(self.unacked_key, tag)
            pipe.multi()
            pipe.zrem(self.unacked_index_key, tag).hdel(self.unacked_key, tag).hdel(
                self.channel.lease_owners_key, tag)
            if uncount:
                pipe.hincrby(self.channel.delivery_counts_key, tag, -1)
            if payload:
                self.channel.put_back(pipe, tag, payload, leftmost)

        if not lost:
            self._record_late()
            with self.channel.conn_or_acquire(client) as client:
                client.transaction(restore, self.unacked_key, self.unacked_index_key)
        if lost:
            log.warning("message %s: lease lost before it was put back; the copy now "
                        "delivered elsewhere is left alone", tag)
            if uncount:
                self._uncount_lost(tag, None)

    def _restore_unheld(self, tag: str, client: Any, leftmost: bool) -> None:
        """kombu's restore, of a message not delivered here (the sweep's: its worker is
        gone), its entry read by ``Channel.put_back``."""
        def restore(pipe: Any) -> None:
            payload = pipe.hget(self.unacked_key, tag)
            pipe.multi()
            self._remove_from_indices(tag, pipe)
            if payload:
                self.channel.put_back(pipe, tag, payload, leftmost)

        with self.channel.conn_or_acquire(client) as client:
            client.transaction(restore, self.unacked_key)

    def _foreign_and_fresh(self, tag: str, client: Any) -> bool:
        """Is ``tag`` a lease no workhorse worker took (a take counts every delivery; a
        Celery worker's BRPOP counts none), younger than the channel's
        ``foreign_visibility_timeout``? Its holder renews nothing, so our short timeout
        says nothing about whether it is alive: sweeping it would run a live Celery
        worker's long task twice. Logged once per message."""
        with self.channel.conn_or_acquire(client) as client:
            counted, score = (client.pipeline().hexists(self.channel.delivery_counts_key, tag)
                              .zscore(self.unacked_index_key, tag).execute())
        if counted or score is None:
            return False
        age = time() - float(score)
        if age >= self.channel.foreign_visibility_timeout:
            return False
        if tag not in self._foreign_seen:
            if len(self._foreign_seen) > 10_000:
                self._foreign_seen.clear()
            self._foreign_seen.add(tag)
            log.warning(
                "message %s: held for %.0f s by a consumer that is not a workhorse worker (a "
                "Celery worker on this Redis database?), which renews nothing; not put back "
                "before celery_visibility_timeout (%.0f s). Celery and workhorse workers "
                "sharing a Redis broker is not supported: see docs/celery.md", tag, age,
                self.channel.foreign_visibility_timeout)
        return True

    def _forget_if_ours(self, tags: Sequence[str]) -> None:
        """Remove the leases of ``tags`` (and their delivery counts) where they are still
        ours, in one round trip; a lease lost meanwhile is left to its new holder."""
        args, lost = self._ours(tags)
        if args:        # _ACK_TAKE with nothing to take
            channel = self.channel
            reply = channel.run(_ACK_TAKE, (self.unacked_index_key, self.unacked_key,
                                            channel.delivery_counts_key,
                                            channel.lease_owners_key),
                                ("0", 0, "", len(args) // 2, *args))
            lost += _texts(reply[1:])
        self._lost_before_settled(lost)

    def _ours(self, tags: Sequence[str]) -> tuple[list[str], list[str]]:
        """For a script that removes leases: the (tag, our score) pairs of ``tags``, and
        the tags whose lease we know is lost. A tag not delivered through this QoS is
        removed here as kombu removes it."""
        self._record_late()           # (an unrecorded lease is written, then removed)
        args: list[str] = []
        lost: list[str] = []
        for tag in tags:
            if tag not in self._scores:   # not delivered through this QoS: kombu's removal
                self._remove_from_indices(tag).hdel(
                    self.channel.delivery_counts_key, tag).hdel(
                    self.channel.lease_owners_key, tag).execute()
                continue
            score = self._scores[tag]
            if score is None:
                lost.append(tag)
            else:
                args += (tag, self.score_text(score))
        return args, lost

    def _acked(self, tags: Sequence[str], lost: Sequence[str]) -> None:
        """The leases of ``tags`` are removed (or were lost): forget them here too."""
        self._lost_before_settled(lost)
        for tag in tags:
            self._scores.pop(tag, None)
            self._counted.discard(tag)
            virtual.QoS.ack(self, tag)

    @staticmethod
    def _lost_before_settled(lost: Sequence[str]) -> None:
        for tag in lost:
            log.warning("message %s: lease lost before it was settled; the copy now delivered "
                        "elsewhere is left alone", tag)

    def renew(self, tags: Iterable[str]) -> list[str]:
        """Move our leases' scores to now; return the tags whose lease is lost."""
        self._record_late()
        held = [(tag, self._scores.get(tag)) for tag in tags]
        lost = {tag for tag, score in held if score is None}
        held = [(tag, score) for tag, score in held if score is not None]
        if held:
            now = time()
            args: list[Any] = [repr(now)]
            for tag, score in held:
                args += [tag, repr(score)]
            gone = {t.decode() if isinstance(t, bytes) else t
                    for t in self.channel.run(_RENEW_IF_OURS, (self.unacked_index_key,), args)}
            for tag, _ in held:
                self._scores[tag] = None if tag in gone else now
            lost |= gone
        return sorted(lost)


class Channel(Delivering, redis.Channel):
    """kombu's Redis channel, consumed with ``take`` instead of BRPOP."""

    QoS = QoS
    #: Run kombu's sweep of abandoned messages on every call: the worker calls it on its own
    #: schedule (a few seconds), so a dead worker's messages return soon after their lease.
    unacked_restore_throttle = 1
    #: The sweep's lock: kombu holds it for up to 5 minutes if its holder is killed mid-sweep,
    #: and no worker sweeps meanwhile. Sweeps are transactions per message (a second sweeper
    #: cannot restore a message twice), so the lock only saves work: keep its lapse short.
    unacked_mutex_expire = 10

    #: The hash of delivery counts (delivery tag -> deliveries counted), beside kombu's keys.
    delivery_counts_key = "delivery_counts"
    #: The hash of lease owners (delivery tag -> the owner mark of the worker holding it).
    lease_owners_key = "lease_owners"
    #: The mark this channel's takes give their leases ('' : none); the worker sets it to
    #: its journal's owner, so a worker that finds its journal dead puts back what it held.
    lease_owner = ""
    #: How long the sweep leaves a lease no workhorse worker took (QoS._foreign_and_fresh):
    #: the celery_visibility_timeout setting.
    foreign_visibility_timeout = 3600.0
    # kombu types its tuple by its exact length; one more name is still a tuple of names.
    from_transport_options = (  # type: ignore[assignment]
        *redis.Channel.from_transport_options, "foreign_visibility_timeout")

    #: The queue ``basic_get`` is reading, for the lease ``QoS.append`` records.
    _getting_from = ""

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        self._getting_from = queue
        try:
            return super().basic_get(queue, no_ack, **kwargs)
        finally:
            self._getting_from = ""

    def put_back(self, pipe: Any, tag: str, raw: bytes | str, leftmost: bool = False,
                 edit: Callable[[dict[str, Any]], None] | None = None) -> None:
        """Put the message of unacked entry ``raw`` back home, on ``pipe`` (in the
        transaction that removes the entry), ``edit`` applied to it first. An entry that
        cannot be read (written by another program or by hand: kombu's sweep raised on it
        every time, and the entries behind it never came back) goes to ``unrouted.dead``
        in its envelope, logged."""
        entry, why = _read_entry(raw)
        if entry is None:
            dead = dead_letter_queue(UNROUTED)
            pipe.lpush(dead, unreadable.envelope(raw, why, UNROUTED))
            log.error("message %s: its unacked entry cannot be read (%s): moved to %s in an "
                      "envelope: %.200r", tag, why, dead, raw)
            return
        message, exchange, routing_key = entry
        if edit is not None:
            edit(message)
        self._do_restore_message(message, exchange, routing_key, pipe, leftmost)

    def _do_restore_message(self, payload: dict[str, Any], exchange: str, routing_key: str,
                            pipe: Any, leftmost: bool = False) -> None:
        """Put an unacked entry's message back on its way home (the queue it was taken
        from, as the take records it; kombu's exchange and routing key in entries others
        wrote). kombu's own logs and drops a message whose headers or delivery_info are
        null, and stops every later sweep at one with no way home: here the first are
        marked where they can be, and the second (an entry written before takes recorded
        the queue, of a message whose producer gave no routing key) goes to
        ``unrouted.dead``, logged, so nothing is lost and the sweep goes on."""
        properties = payload.get("properties")
        for part in (payload.get("headers"),
                     properties.get("delivery_info") if isinstance(properties, dict) else None):
            if isinstance(part, dict):
                part["redelivered"] = True
        queues = [queue for queue in self._lookup(exchange, routing_key) if queue] if (
            exchange or routing_key) else []
        if not queues:
            queues = [dead_letter_queue(UNROUTED)]
            headers = payload.get("headers")
            if not isinstance(headers, dict):
                headers = payload["headers"] = {}
            headers.update({DEAD_REASON_HEADER: f"{UNROUTED}: {NO_WAY_HOME}",
                            DEAD_AT_HEADER: datetime.now(UTC).isoformat()})
            log.error("message %s: put back, but %s: moved to %s", _tag_of(payload),
                      NO_WAY_HOME, queues[0])
        priority = self._get_message_priority(payload, reverse=False)
        text = dumps(payload)
        push = pipe.lpush if leftmost else pipe.rpush
        for queue in queues:
            push(self._q_for_pri(queue, priority), text)

    def renew(self, tags: Iterable[str]) -> list[str]:
        return self.qos.renew(tags)

    def lease_set_at(self, tag: str) -> float | None:
        """When the lease behind ``tag`` was taken or last renewed: its score (epoch
        seconds, as the sweep reads it); None if this channel holds no such lease."""
        qos = self._qos     # (kombu's property makes one where there is none: not here)
        return None if qos is None else qos._scores.get(tag)

    def forget(self, delivery_tag: str) -> None:
        """Drop a message whose lease ``renew`` reported lost, uncounting our delivery."""
        self.qos.forget(delivery_tag)

    def recover(self, owners: Iterable[str], judge: Callable[[str], Verdict]) -> int:
        """Put back at once what a worker that is gone held: the leases marked with one of
        ``owners`` (its journal's), each as ``judge(delivery tag)`` says: a start keeps the
        delivery its take counted; a message only held gets it back, and its headers count
        the held loss (``protocol.after_loss``). First in line again, as kombu's sweep
        puts a message back. Returns how many."""
        names = set(owners)
        with self.conn_or_acquire() as client:
            tags = [_text(tag) for tag, owner in client.hscan_iter(self.lease_owners_key,
                                                                   count=1000)
                    if _text(owner) in names]
            with unreadable.headroom():
                return sum(self._recover_one(client, tag, names, judge(tag)) for tag in tags)

    def _recover_one(self, client: Any, tag: str, owners: set[str], verdict: Verdict) -> bool:
        """One transaction: only while the lease is still the dead owner's."""
        done = False

        def recover(pipe: Any) -> None:
            nonlocal done
            owner = pipe.hget(self.lease_owners_key, tag)
            if owner is None or _text(owner) not in owners or pipe.zscore(
                    self.unacked_index_key, tag) is None:
                return
            entry = pipe.hget(self.unacked_key, tag)
            counted = int(pipe.hget(self.delivery_counts_key, tag) or 0)
            pipe.multi()
            pipe.zrem(self.unacked_index_key, tag).hdel(self.unacked_key, tag).hdel(
                self.lease_owners_key, tag)
            if not verdict.started and counted > 0:
                pipe.hincrby(self.delivery_counts_key, tag, -1)
            if entry:
                self.put_back(pipe, tag, entry, edit=partial(_after_loss, verdict=verdict))
            done = True
        client.transaction(recover, self.unacked_key, self.unacked_index_key,
                           self.lease_owners_key, self.delivery_counts_key)
        return done

    def backlog(self, queue: str) -> Backlog:
        """``queue``'s ready messages (its lists' lengths) and when the oldest was sent: the
        earliest stamp of the messages next to be taken from each priority's list (None if
        one of them carries no stamp)."""
        keys = self.list_keys([queue])
        with self.client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.llen(key).lindex(key, -1)
            answers = pipe.execute()
        ready, oldest, known = 0, None, True
        for length, payload in zip(answers[::2], answers[1::2], strict=True):
            ready += int(length)
            if payload is None:
                continue
            message, _ = unreadable.decode(payload)
            try:
                sent = sent_at(message.get("properties"), message.get("headers"))
            except (TypeError, AttributeError):     # not kombu's layout (None: unreadable)
                sent = None
            if sent is None:
                known = False
            else:
                oldest = sent if oldest is None else min(oldest, sent)
        return Backlog(ready, oldest if known else None)

    def _inplace_augment_message(self, message: dict[str, Any], exchange: str,
                                 routing_key: str) -> None:
        super()._inplace_augment_message(message, exchange, routing_key)
        stamp_properties(message["properties"])

    def list_keys(self, queues: Iterable[str]) -> tuple[str, ...]:
        """The Redis lists behind ``queues``: by priority first, as kombu's BRPOP reads them.
        (Worked out once per order of the queues: every take asks.)"""
        queues = tuple(queues)
        keys = self._list_keys.get(queues)
        if keys is None:
            if len(self._list_keys) > 64:       # queues added and cancelled many times
                self._list_keys.clear()
            keys = self._list_keys[queues] = tuple(
                self._q_for_pri(queue, pri) for pri in self.priority_steps for queue in queues)
        return keys

    #: At most this many messages per take (one round trip), whatever the room.
    MAX_TAKE = 64

    _sync_client: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._direct = Direct()
        self._unburied: list[Callable[[], None]] = []
        self._list_keys: dict[tuple[str, ...], tuple[str, ...]] = {}
        super().__init__(*args, **kwargs)

    def _put(self, queue: str, message: Any, **kwargs: Any) -> None:
        ticket = fenced.current()
        if ticket is None:
            super()._put(queue, message, **kwargs)
            return
        # A periodic task's due time: put only if its fence moves, in one script with it.
        key = self._q_for_pri(queue, self._get_message_priority(message, reverse=False))
        answer = self.run(_FENCED_PUT, [fenced.redis_key(ticket.name), key],
                          [repr(ticket.record.nominal), ticket.record.dumps(),
                           ticket.record.task_id, dumps(message)])
        put, holder = fenced.redis_answer(ticket, answer)
        if not put:
            raise fenced.FenceClosed(ticket, holder)

    def fence_records(self, names: Iterable[str]) -> dict[str, fenced.Record]:
        """The periodic tasks' records (``transport.fenced``) for ``names``."""
        names = list(names)
        with self.conn_or_acquire() as client:
            texts = [client.hget(fenced.redis_key(name), "record") for name in names]
        return {name: record for name, text in zip(names, texts, strict=True)
                if text and (record := fenced.record_or_none(text)) is not None}

    def run(self, script: Script, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """Run one of our scripts on a connection of the channel's own, outside kombu's
        pool (``luascript.Direct``). (A reply lost after the script ran: the scripts act
        only on leases still ours and entries still there, so a second run finds nothing
        more to do; a take's leases whose reply was lost are swept back, counted.)"""
        return self._direct.run(self.pool, script, keys, args)

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._direct.close()

    @contextlib.contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        """kombu builds a new ``redis.Redis`` for every call made without a client (a fifth
        of the supervisor's time once); one per pool does, and is safe across threads."""
        if client:
            yield client
            return
        cached = self._sync_client
        if cached is None or cached.connection_pool is not self.pool:
            cached = self._sync_client = self._create_client()
        yield cached

    def take(self, limit: int = 1, acks: Sequence[str] = ()) -> int:
        """Ack ``acks``, then take up to ``limit`` messages from the queues consumed here
        (in their order, each list emptied before the next), each recorded as unacked in
        the same step, and deliver them to their consumers: one round trip. Returns how
        many were taken (an unreadable entry dead-lettered counts): 0 when the queues are
        all empty, or ``limit`` is 0."""
        call = self._take_call(limit, acks)
        if call is None:
            return 0
        return self._take_reply(call, self.run(_ACK_TAKE, call.keys, call.args))

    def _take_call(self, limit: int, acks: Sequence[str]) -> _TakeCall | None:
        """The take script's keys and arguments (None: nothing to ask)."""
        # (The cycle holds the queues consumed, ``active_queues``, which kombu's property
        # builds anew for every call: it is kept in step with them by kombu.)
        cycle = self._queue_cycle
        queues = cycle.consume(len(cycle.items)) if limit > 0 else []
        if not queues and not acks:
            return None
        lists = self.list_keys(queues)
        qos = self.qos
        pairs, lost = qos._ours(acks)
        score = time()
        return _TakeCall(acks, lost, lists, score,
                         (self.unacked_index_key, self.unacked_key, self.delivery_counts_key,
                          self.lease_owners_key, *lists),
                         (qos.score_text(score), min(limit, self.MAX_TAKE) if lists else 0,
                          self.lease_owner, len(pairs) // 2, *pairs))

    def _take_reply(self, call: _TakeCall, reply: Any, bury_later: bool = False) -> int:
        """Settle the acks and deliver the messages of a take script's ``reply``; the
        unreadable entries it met are dead-lettered (a round trip each), or with
        ``bury_later`` kept for ``bury_unburied``."""
        keys, score = call.lists, call.score
        nlost = int(reply[0])
        self.qos._acked(call.acks, [*call.lost, *_texts(reply[1:1 + nlost])])
        reply = reply[1 + nlost:]
        if not reply:
            return 0
        unreadable_next: tuple[str, bytes] | None = None
        taken: list[tuple[str, Any, int, str]] = []
        for n in range(0, len(reply), 4):
            position, payload, count, tag = reply[n:n + 4]
            if position < 0:
                unreadable_next = (keys[-position - 1], payload)
            else:
                taken.append((self._queue_of(keys[position - 1]), payload, count,
                              tag.decode() if isinstance(tag, bytes) else tag))
        if taken:
            self._queue_cycle.rotate(taken[-1][0])
        unreadable_taken = []
        for queue, payload, count, tag in taken:    # delivered first, buried after
            message, why = unreadable.read(payload, tagged=True)
            if message is None:
                unreadable_taken.append((queue, tag, payload, why or ""))
                continue
            properties = message["properties"]
            info = properties.get("delivery_info")
            if not isinstance(info, dict):
                info = properties["delivery_info"] = {}
            info["delivery_count"] = int(count)
            self.qos._taken[properties["delivery_tag"]] = score
            self.deliver_taken(message, queue)
        burials: list[Callable[[], None]] = [
            partial(self._bury_taken, queue, tag, score, payload, why)
            for queue, tag, payload, why in unreadable_taken]
        if unreadable_next is not None:
            burials.append(partial(self._bury_next, *unreadable_next))
        if bury_later:
            self._unburied += burials
        else:
            for bury in burials:
                bury()
        return len(taken) + (unreadable_next is not None)

    def bury_unburied(self) -> None:
        """Dead-letter what a take sent by ``take_send`` met unreadable (it leaves them,
        leased or in their list, to a thread that may wait)."""
        burials, self._unburied = self._unburied, []
        for bury in burials:
            bury()

    # -- takes sent by the loop thread, their answers read when the socket is readable
    def take_send(self, limit: int, acks: Sequence[str],
                  pipe: TakePipe | None = None) -> SentTake | None:
        """``take``'s request, sent on the channel's own connection without waiting for
        the answer: on ``pipe`` (after the takes sent on it before), or on a new one, which
        has the connection to itself until every answer on it is read (``TakePipe``).
        None, with nothing sent and nothing changed, where that cannot be done without
        waiting: no connection of ours is up (connecting waits), it is TLS, a lease of
        ours is not recorded yet, an ack is of a message this QoS did not deliver (both
        call Redis first), the socket would not take the request at once, or there is
        nothing to ask."""
        qos = self.qos
        if qos._unrecorded or any(tag not in qos._scores for tag in acks):
            return None
        if pipe is None:
            connection = self._direct.connection
            sock = getattr(connection, "_sock", None)
            if (sock is None or self._direct.pool is not self.pool
                    or isinstance(sock, ssl.SSLSocket) or sock.gettimeout() is None):
                return None         # (a timeout makes the socket non-blocking underneath)
            if not self._direct.lock.acquire(blocking=False):
                return None
            pipe = TakePipe(self, connection, sock)
        elif pipe.closed:
            return None
        try:
            call = self._take_call(limit, acks)
        except BaseException:
            pipe.release_if_idle()
            raise
        if call is None:
            pipe.release_if_idle()
            return None
        data = pack_command(("EVALSHA", _ACK_TAKE.sha, len(call.keys), *call.keys,
                             *call.args))
        try:
            written = os.write(pipe.fd, data)
        except BlockingIOError:
            written = 0
        except BaseException:
            pipe.close()
            raise
        if written < len(data):
            if written:
                pipe.close()    # a part is sent: the connection is out of step
                raise RedisConnectionError("a take was sent in part")
            pipe.release_if_idle()
            return None
        sent = SentTake(pipe, call, limit)
        pipe.out.append(sent)
        return sent

    def _queue_of(self, key: str) -> str:
        return key.rsplit(self.sep, 1)[0]

    def _bury_next(self, key: str, payload: bytes) -> None:
        """Dead-letter the unreadable entry next in ``key``, in its envelope."""
        queue = self._queue_of(key)
        _, why = unreadable.read(payload, tagged=True)
        dead = dead_letter_queue(queue)
        buried = self.run(_BURY_NEXT, (key, dead),
                          (payload, unreadable.envelope(payload, why or "", queue)))
        if buried:     # (else another worker took it first)
            log.error("an unreadable entry on %s (%s) was dead-lettered to %s in an "
                      "envelope: %.200r", queue, why, dead, payload)

    def _bury_taken(self, queue: str, tag: str, score: float, payload: bytes,
                    why: str) -> None:
        """Dead-letter a message taken but unreadable here, in its envelope."""
        dead = dead_letter_queue(queue)
        buried = self.run(_BURY_TAKEN, (self.unacked_index_key, self.unacked_key,
                                        self.delivery_counts_key, self.lease_owners_key, dead),
                          (tag, repr(score), unreadable.envelope(payload, why, queue)))
        if buried:     # (else the lease was lost already: whoever holds it now decides)
            log.error("an unreadable message on %s (%s) was dead-lettered to %s in an "
                      "envelope: %.200r", queue, why, dead, payload)


#: Where a message put back with no way home goes, with the dead letters' suffix.
UNROUTED = "unrouted"
NO_WAY_HOME = "it has no way home (no exchange or routing key, and no queue recorded)"


def _text_or_empty(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _read_entry(raw: bytes | str) -> tuple[tuple[dict[str, Any], str, str] | None, str]:
    """An unacked entry as (message, exchange, routing key), or None and why not."""
    entry, why = unreadable.decode(raw)
    if why is not None:
        return None, why
    if not (isinstance(entry, list) and len(entry) == 3):
        return None, "not kombu's [message, exchange, routing key]"
    message, exchange, routing_key = entry
    if not isinstance(message, dict):
        return None, f"its message is JSON {type(message).__name__}, not an object"
    if not (isinstance(exchange, str) and isinstance(routing_key, str)):
        return None, "its exchange or routing key is not a string"
    return (message, exchange, routing_key), ""


def _after_loss(message: dict[str, Any], verdict: Verdict) -> None:
    message["headers"] = after_loss(message.get("headers"), verdict)


def _tag_of(payload: dict[str, Any]) -> Any:
    properties = payload.get("properties")
    return properties.get("delivery_tag") if isinstance(properties, dict) else None


class _TakeCall(NamedTuple):
    acks: Sequence[str]
    #: Acks whose lease we knew was lost before asking.
    lost: list[str]
    #: The lists taken from, in order (a reply names them by position).
    lists: tuple[str, ...]
    score: float
    keys: tuple[Any, ...]
    args: tuple[Any, ...]


class SentTake:
    """A take sent by ``Channel.take_send``: ``took`` is None until its answer is read."""

    def __init__(self, pipe: TakePipe, call: _TakeCall, limit: int) -> None:
        self.pipe, self.call, self.limit = pipe, call, limit
        self.took: int | None = None


class TakePipe:
    """Takes sent one after another on the channel's own connection, never waiting: their
    answers come in the order they were sent, and ``read`` reads what the socket holds
    when it is readable. The connection is the pipe's alone (the channel's lock is held)
    until every answer is read, or it is closed."""

    def __init__(self, channel: Channel, connection: Any, sock: socket.socket) -> None:
        #: ``sock``, the connection's socket as the pipe began: another one (a reconnect)
        #: may have the same number, never the same object.
        self.channel, self.connection, self.sock = channel, connection, sock
        self.fd = sock.fileno()
        self.reader = hiredis.Reader()
        self.out: deque[SentTake] = deque()
        self.closed = False

    def read(self) -> list[SentTake]:
        """The takes answered by what the socket holds now, in order, each with ``took``
        (its messages delivered, as ``take`` delivers them). Raises ConnectionError if the
        connection closed, or an answer is an error (NOSCRIPT after a restart: nothing
        ran); the pipe is closed then, and the acks of the takes not answered are to be
        made again (a second run acks only leases still ours)."""
        try:
            chunk = os.read(self.fd, 65536)
        except BlockingIOError:
            return []
        except OSError as exc:
            self.close()
            raise RedisConnectionError(f"reading a take's answer: {exc!r}") from exc
        if not chunk:
            self.close()
            raise RedisConnectionError("Redis closed the connection before a take's answer")
        self.reader.feed(chunk)
        answered = []
        while self.out and (reply := self.reader.gets()) is not False:
            if isinstance(reply, hiredis.ReplyError):
                self.close()
                raise RedisConnectionError(f"a take's answer: {reply}")
            sent = self.out.popleft()
            sent.took = self.channel._take_reply(sent.call, reply, bury_later=True)
            answered.append(sent)
        self.release_if_idle()
        return answered

    def release_if_idle(self) -> None:
        """Nothing more to read: the connection is the channel's again."""
        if not self.out and not self.closed:
            self.closed = True
            self.channel._direct.lock.release()

    def close(self) -> None:
        """Given up (no answer in time, or it failed): the connection is closed (an answer
        may still come to it); what its takes may have leased returns to its list by the
        sweep, once the lease runs out, counted."""
        if not self.closed:
            self.closed = True
            self.connection.disconnect()
            self.channel._direct.lock.release()


def _texts(values: Iterable[Any]) -> list[str]:
    return [_text(v) for v in values]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else value


class ListWaiter:
    """One idle connection blocking until a Redis list is non-empty, without taking from
    it: ``BLMOVE key key RIGHT RIGHT`` moves the last element onto itself."""

    def __init__(self, channel: Channel, key: str) -> None:
        pool = channel.client.connection_pool
        self.key = key
        self.connection = pool.connection_class(**pool.connection_kwargs)
        self.sent_at: float | None = None     # monotonic, while a BLMOVE is pending

    def arm(self, timeout: int) -> None:
        if self.sent_at is None:
            self.connection.connect()       # (the master, under Sentinel: see _run_once)
            self.connection.send_command("BLMOVE", self.key, self.key, "RIGHT", "RIGHT",
                                         timeout)
            self.sent_at = monotonic()

    def fileno(self) -> int | None:
        sock = self.connection._sock
        return sock.fileno() if sock is not None and self.sent_at is not None else None

    def read(self) -> None:
        """The list has something (or the wait timed out): the reply itself is not used."""
        self.sent_at = None
        self.connection.read_response()

    def close(self) -> None:
        self.sent_at = None
        self.connection.disconnect()


class Transport(redis.Transport):
    Channel = Channel


class SentinelChannel(Channel, redis.SentinelChannel):
    """This channel on the master that Redis Sentinel names (kombu's sentinel pool): the
    pool asks the sentinels for the master at each new connection, so a reconnect after a
    failover lands on the new master."""

    from_transport_options = (  # type: ignore[assignment]
        *Channel.from_transport_options, "master_name", "min_other_sentinels",
        "sentinel_kwargs", "sentinel_fanout_compat")


class SentinelTransport(Transport):
    """``sentinel://h1:26379;sentinel://h2:26379`` with ``master_name``."""

    Channel = SentinelChannel
    default_port = 26379  # type: ignore[assignment]
