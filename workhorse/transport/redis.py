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

The keys and the message layout are kombu's own, so Celery producers, Celery workers and
kombu's sweep all keep working with them.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from time import time
from typing import Any

from kombu.transport import redis, virtual
from kombu.utils.json import dumps, loads

log = logging.getLogger("workhorse.transport.redis")

# KEYS: unacked_index, unacked. ARGV: tag, score. Remove the entry if the score is ours.
_FORGET_IF_OURS = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) == tonumber(ARGV[2]) then
    redis.call('ZREM', KEYS[1], ARGV[1])
    redis.call('HDEL', KEYS[2], ARGV[1])
    return 1
end
return 0
"""
# KEYS: unacked_index. ARGV: new score, then (tag, our score) pairs. Returns the lost tags.
_RENEW_IF_OURS = """
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
"""


class QoS(redis.QoS):
    """kombu's Redis ack emulation, with every lease known by the score we gave it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: tag -> the score of our lease; None once the lease is lost (or put back).
        self._scores: dict[str, float | None] = {}
        #: tag -> its unacked entry, for messages popped from their list while Redis went
        #: away before the entry could be written: written by the next renew().
        self._unrecorded: dict[str, str] = {}

    def append(self, message: Any, delivery_tag: str) -> None:
        delivery = message.delivery_info
        score = time()
        entry = dumps([message._raw, delivery["exchange"], delivery["routing_key"]])
        self._scores[delivery_tag] = score
        try:
            self._record(delivery_tag, entry, score)
        except self.channel.connection_errors as exc:
            # BRPOP took it off its list already: dropping it here would lose it. Keep it
            # (it is delivered and runs) and record its lease once Redis answers again.
            log.warning("message %s: received, but its lease could not be recorded (%r); "
                        "recorded once Redis answers again", delivery_tag, exc)
            self._unrecorded[delivery_tag] = entry
        virtual.QoS.append(self, message, delivery_tag)

    def _record(self, tag: str, entry: str, score: float) -> None:
        with self.pipe_or_acquire() as pipe:
            pipe.zadd(self.unacked_index_key, {tag: score}).hset(
                self.unacked_key, tag, entry).execute()

    def _record_late(self) -> None:
        for tag, entry in list(self._unrecorded.items()):
            score = self._scores.get(tag)
            if score is not None:
                self._record(tag, entry, score)
            del self._unrecorded[tag]

    def ack(self, delivery_tag: str) -> None:
        self._forget_if_ours(delivery_tag)
        self._scores.pop(delivery_tag, None)
        virtual.QoS.ack(self, delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if requeue:
            self.restore_by_tag(delivery_tag, leftmost=True)
        else:
            self._forget_if_ours(delivery_tag)
        self._scores.pop(delivery_tag, None)
        virtual.QoS.ack(self, delivery_tag)

    def restore_unacked(self, client: Any = None) -> None:
        with self.channel.conn_or_acquire(client) as client:
            for tag in self._delivered:
                self.restore_by_tag(tag, client=client)
        self._delivered.clear()
        self._scores.clear()

    def restore_by_tag(self, tag: str, client: Any = None, leftmost: bool = False) -> None:
        """Put a message back, but only while the lease is ours. (kombu's sweep calls this
        for every abandoned message; those not delivered here are restored as kombu does.)"""
        if tag not in self._scores:
            super().restore_by_tag(tag, client, leftmost)
            return
        score = self._scores[tag]
        self._scores[tag] = None      # put back or found lost: this lease is over either way
        lost = score is None

        def restore(pipe: Any) -> None:
            nonlocal lost
            if pipe.zscore(self.unacked_index_key, tag) != score:
                lost = True
                return
            payload = pipe.hget(self.unacked_key, tag)
            pipe.multi()
            pipe.zrem(self.unacked_index_key, tag).hdel(self.unacked_key, tag)
            if payload:
                message, exchange, routing_key = loads(payload)
                self.channel._do_restore_message(message, exchange, routing_key, pipe, leftmost)

        if not lost:
            self._record_late()
            with self.channel.conn_or_acquire(client) as client:
                client.transaction(restore, self.unacked_key, self.unacked_index_key)
        if lost:
            log.warning("message %s: lease lost before it was put back; the copy now "
                        "delivered elsewhere is left alone", tag)

    def _forget_if_ours(self, tag: str) -> None:
        self._record_late()           # (an unrecorded lease is written, then removed)
        if tag not in self._scores:   # not delivered through this QoS: kombu's removal
            self._remove_from_indices(tag).execute()
            return
        score = self._scores[tag]
        removed = 0
        if score is not None:
            with self.channel.conn_or_acquire() as client:
                removed = client.eval(_FORGET_IF_OURS, 2, self.unacked_index_key,
                                      self.unacked_key, tag, repr(score))
        if not removed:
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
            with self.channel.conn_or_acquire() as client:
                gone = {t.decode() if isinstance(t, bytes) else t
                        for t in client.eval(_RENEW_IF_OURS, 1, self.unacked_index_key, *args)}
            for tag, _ in held:
                self._scores[tag] = None if tag in gone else now
            lost |= gone
        return sorted(lost)


class Channel(redis.Channel):
    QoS = QoS
    #: Run kombu's sweep of abandoned messages on every call: the worker calls it on its own
    #: schedule (a few seconds), so a dead worker's messages return soon after their lease.
    unacked_restore_throttle = 1
    #: The sweep's lock: kombu holds it for up to 5 minutes if its holder is killed mid-sweep,
    #: and no worker sweeps meanwhile. Sweeps are transactions per message (a second sweeper
    #: cannot restore a message twice), so the lock only saves work: keep its lapse short.
    unacked_mutex_expire = 10

    def renew(self, tags: Iterable[str]) -> list[str]:
        return self.qos.renew(tags)


class Transport(redis.Transport):
    Channel = Channel
