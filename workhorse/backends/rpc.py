"""Celery's RPC result store: ``result_backend = "rpc://"``. Nothing is stored: each state
of a task (STARTED, RETRY, SUCCESS, FAILURE...) is a message sent to the queue the task's
message names in ``reply_to``, with its ``correlation_id``, as Celery's RPC backend sends
it, so the client that sent the task (Celery's or workhorse's) reads it there.

A client (the process that sends the task) names its reply queue on every task it sends
and declares that queue first: one queue per process, named by a fresh id, auto-deleted
and expiring after ``result_expires`` unused (RabbitMQ), as Celery declares it. It reads
the queue when asked for a state: every message there is this process's, kept (the last
state of each task) until read. Another process cannot read these results (it has no
queue they go to): it sees PENDING, as with Celery. What Celery's RPC backend cannot do is
refused with Celery's errors: chords, saving and restoring groups; nor can it hold claims
(idempotent tasks) or fences.

A worker sends a state to ``reply_to``. On RabbitMQ it first checks, once per reply queue
and process, that the queue exists: one that does not (the client is gone, its queue
expired) is said once in the log, and its task's states are not sent; the task is
settled as any other, neither blocked nor requeued. (Redis has no such check: a list
nobody reads is left there, as Celery leaves it.)
"""
from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from kombu import Connection, Exchange, Producer, Queue

from ..states import READY_STATES
from .base import Backend, ChordCompletion, RequestInfo, encoded, pending_meta
from .encoding import build_meta, dumps, loads

log = logging.getLogger("workhorse.results")

#: Celery's own words (celery/backends/rpc.py), so a Celery user recognises them.
NO_CHORDS = ('The "rpc" result backend does not support chords!\n\nNote that a group '
             "chained with a task is also upgraded to be a chord,\nas this pattern requires "
             "synchronization.\n\nResult backends that supports chords: Redis, Database, "
             "Memcached, and more.")
#: How many messages one read takes from the reply queue at most (Celery's backlog limit).
BACKLOG_LIMIT = 1000
PUBLISH_RETRY = {"max_retries": 3, "interval_start": 0.1, "interval_step": 0.5,
                 "interval_max": 1.0}


class RPCBackend(Backend):
    """States as messages to the sender's reply queue."""

    def __init__(self, url: str, *, connection: Callable[[], Connection] | None = None,
                 **options: Any) -> None:
        super().__init__(url, **options)
        if connection is None:
            raise ValueError("rpc:// sends results through the broker: the backend needs "
                             "the app's broker connection (App.new_backend gives it)")
        self._connect = connection
        self._lock = threading.Lock()
        self._conn: Connection | None = None
        self._producer: Producer | None = None
        self._pid = 0
        self._oid: str | None = None          # this process's reply queue, once declared
        self._latest: dict[str, dict[str, Any]] = {}
        self._known: dict[str, bool] = {}     # reply queue -> it exists (RabbitMQ)

    #: A send may wait on a broker that stops answering: the supervisor makes its own
    #: off its loop (see the database store).
    calls_block = True

    # -- the connection, one a process
    def _connection(self) -> Connection:
        if self._conn is None or self._pid != os.getpid():
            if self._pid != os.getpid():      # inherited across fork: not ours to use
                self._oid, self._latest, self._known = None, {}, {}
            self._producer = None
            self._conn = self._connect()
            self._pid = os.getpid()
        return self._conn

    def close(self) -> None:
        if self._conn is not None and self._pid == os.getpid():
            try:
                self._conn.release()
            except Exception:   # closing a broken connection: said, and dropped
                log.debug("rpc:// result connection: close failed", exc_info=True)
        self._conn = self._producer = None

    def exception_safe_to_retry(self, exc: BaseException) -> bool:
        conn = self._conn
        errors = (conn.connection_errors + conn.channel_errors) if conn is not None else ()
        return isinstance(exc, (*errors, ConnectionError, TimeoutError))

    # -- the client's side
    def _queue(self, name: str) -> Queue:
        arguments = {"x-expires": int(self.expires * 1000)} if self.expires else None
        return Queue(name, Exchange(""), name, durable=True, auto_delete=True,
                     queue_arguments=arguments)

    def reply_to(self) -> str:
        """The reply queue tasks sent from this process name: declared on first use."""
        with self._lock:
            conn = self._connection()
            if self._oid is None:
                oid = str(uuid.uuid4())
                conn.ensure_connection(**PUBLISH_RETRY)
                self._queue(oid)(conn.default_channel).declare()
                self._oid = oid
            return self._oid

    def get_task_meta(self, task_id: str) -> dict[str, Any]:
        return self.retrying(f"reading {task_id}", lambda: self._read(task_id))

    def _read(self, task_id: str) -> dict[str, Any]:
        with self._lock:
            if self._oid is None or self._pid != os.getpid():
                # This process sent no task naming a reply queue: nothing can come to it.
                return self._latest.get(task_id) or pending_meta(task_id)
            queue = self._queue(self._oid)(self._connection().default_channel)
            for _ in range(BACKLOG_LIMIT):
                message = queue.get(no_ack=True, accept=["json"])
                if message is None:
                    break
                meta = message.payload
                if isinstance(meta, str):
                    meta = loads(meta)
                if not isinstance(meta, dict):
                    log.warning("rpc:// reply queue %s: a message that is not a state, "
                                "dropped: %.200r", self._oid, meta)
                    continue
                key = (message.properties or {}).get("correlation_id") or meta.get("task_id")
                if not isinstance(key, str):
                    continue
                # A ready state is final: a late STARTED never hides it.
                if self._latest.get(key, {}).get("status") not in READY_STATES:
                    self._latest[key] = meta
            return self._latest.get(task_id) or pending_meta(task_id)

    def forget(self, task_id: str) -> None:
        with self._lock:
            self._latest.pop(task_id, None)

    def _forget(self, task_id: str) -> None:
        return None

    # -- the worker's side
    def store_result(self, task_id: str, result: Any, state: str,
                     traceback: str | None = None, request: RequestInfo | None = None,
                     extra: Mapping[str, Any] | None = None) -> None:
        reply_to = (request or {}).get("reply_to")
        if not reply_to:
            return          # sent with no reply queue (or by a client on another store)
        correlation_id = (request or {}).get("correlation_id") or task_id
        payload = encoded(task_id, state, lambda: dumps(build_meta(
            task_id, state, result, traceback, request=request, extended=self.extended)))
        self.retrying(f"sending {state} for {task_id} to {reply_to}",
                      lambda: self._send(reply_to, correlation_id, payload))

    def _send(self, reply_to: str, correlation_id: str, payload: str) -> None:
        with self._lock:
            conn = self._connection()
            if self._producer is None or self._producer.channel is not conn.default_channel:
                conn.ensure_connection(**PUBLISH_RETRY)
                self._producer = Producer(conn.default_channel)
            if not self._exists(conn, reply_to):
                return
            # Not retried here: a failed send is retried by the store's policy (retrying),
            # on a new connection.
            self._producer.publish(
                payload, exchange="", routing_key=reply_to, correlation_id=correlation_id,
                content_type="application/json", content_encoding="utf-8", delivery_mode=1)

    def _exists(self, conn: Connection, reply_to: str) -> bool:
        known = self._known.get(reply_to)
        if known is not None:
            return known
        if conn.transport.driver_type != "amqp":
            exists = True
        else:
            from ..broker.queues import amqp_queue_exists
            exists = amqp_queue_exists(conn, reply_to)
            if not exists:
                log.warning("rpc:// results: the reply queue %s is gone (its client has "
                            "stopped, or the queue expired): the states of the tasks it sent "
                            "are not sent", reply_to)
        if len(self._known) > 10000:
            self._known.clear()
        self._known[reply_to] = exists
        return exists

    def _set(self, task_id: str, state: str, payload: str) -> None:
        raise NotImplementedError("rpc:// sends states: see store_result")

    def _get(self, task_id: str) -> str | None:
        raise NotImplementedError("rpc:// reads states: see get_task_meta")

    # -- what Celery's RPC backend refuses
    def set_chord_size(self, group_id: str, size: int) -> None:
        raise NotImplementedError(NO_CHORDS)

    def _part_return(self, group_id: str, task_id: str, index: int, state: str,
                     encoded: str) -> ChordCompletion | None:
        raise NotImplementedError(NO_CHORDS)

    def save_group(self, group_id: str, as_tuple: Any) -> None:
        raise NotImplementedError("save_group is not supported by this backend.")

    def restore_group(self, group_id: str) -> Any | None:
        raise NotImplementedError("restore_group is not supported by this backend.")

    def forget_group(self, group_id: str) -> None:
        raise NotImplementedError("delete_group is not supported by this backend.")

    def _no_claims(self) -> str:
        return ("rpc:// stores nothing, so it cannot hold the claims idempotent tasks need: "
                "use a result_backend that can (sqlite://, redis:// or db+…)")

