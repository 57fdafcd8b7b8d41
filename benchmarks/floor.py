"""The least a supervisor can cost a task on Redis, SQLite or RabbitMQ: a bare loop that
does only the part of a worker's work that no design of one can leave out, measured the
way workhorse is.

    python benchmarks/throughput.py --broker redis --broker sqlite --floor [--acks both]
    python benchmarks/throughput.py --broker amqp --floor

runs it beside workhorse, Celery and Dramatiq, as ``python -m benchmarks.floor -Q QUEUE
-c 2`` (the broker from $WORKHORSE_BROKER_URL, the ack mode from $BENCH_ACKS_LATE). It is
not a worker anyone should run. One process, one thread, and ``concurrency`` forked
children. For each task it does what a supervisor that holds the window and settles each
message itself must do, and nothing else:

- takes messages as workhorse does, with the acks due, a window of concurrency x 4 (x
  $BENCH_PREFETCH_MULTIPLIER where set): on Redis with workhorse's own take script
  (``_ACK_TAKE``: the lease, the delivery count and the owner mark) over a bare socket
  with hiredis's reader, one take in flight; on SQLite with workhorse's own transaction
  (``Store.lease_many``), on the loop; on RabbitMQ consumed with the window as the
  prefetch (less the children, with acks at start, so that what is held stays within it),
  read with workhorse's frame reader;
- reads each message's task name and id from its headers (Redis, SQLite: its JSON decoded
  and its body from base64; RabbitMQ: the headers table the frame reader decoded);
- writes the child a job (the name, the id, the body: ``marshal``) and reads its one-byte
  answer; the child decodes the body and calls the benchmark's task;
- late acks: held, and sent with the next take, which goes once half the window is free
  or nothing is buffered (RabbitMQ: written then); acks at start (``BENCH_ACKS_LATE=
  false``): each start's ack sent at once (with a take of the room), its job written once
  the answer is in (RabbitMQ, which answers no ack: once its frame is written, as
  workhorse does).

What it leaves out, where workhorse spends the rest: the time limits, the journal, the
delivery counts' checks and the dead letters, the task's options, events, results,
retries, revokes, renewing leases, reconnecting, a broker thread so that a hung broker
never stalls the loop, and everything a message that is not a well-formed Celery task
needs. Its CPU a task is a floor for a supervisor in CPython on this machine, not a
target: what workhorse costs above it pays for those promises.
"""
from __future__ import annotations

import argparse
import base64
import json
import marshal
import os
import selectors
import socket
import struct
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import hiredis
import redis

from benchmarks.task_bodies import TASKS
from workhorse.transport.rabbitmq import Connection as AmqpConnection
from workhorse.transport.redis import _ACK_TAKE
from workhorse.transport.store import Store, StoreBusy

_LENGTH = struct.Struct("!I")
#: A buffered message: its delivery tag, its task's name, its id, its body.
Message = tuple[str, str, str, bytes]
#: A job to write once its ack at start is answered: the child's answer fd, the message.
Start = tuple[int, Message]
#: kombu's priority lists behind a queue, in the order its takes read them.
PRIORITIES = (0, 3, 6, 9)


def child(jobs: int, answers: int) -> None:
    """Read job frames; run each; answer one byte. Exits when the pipe closes."""
    reader = os.fdopen(jobs, "rb", buffering=0)
    while True:
        head = reader.read(4)
        if len(head) < 4:
            os._exit(0)
        (size,) = _LENGTH.unpack(head)
        frame = b""
        while len(frame) < size:
            frame += reader.read(size - len(frame))
        name, _task_id, body = marshal.loads(frame)
        args, kwargs, _embed = json.loads(body)
        TASKS[name](*args, **kwargs)
        os.write(answers, b"d")


def envelope(tag: str, payload: bytes | str) -> Message:
    """A message stored as kombu's JSON (Redis, SQLite): its task's name and id read from
    its headers, its body decoded from base64."""
    message = json.loads(payload)
    headers = message["headers"]
    return tag, headers["task"], headers["id"], base64.b64decode(message["body"])


class RedisTaker:
    """Takes on Redis: each request written at once, its answer read when the socket is."""

    pushes = False

    def __init__(self, url: str, queue: str, answered: Callable[[object, list], None]) -> None:
        parts = urlsplit(url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 6379
        db = int((parts.path or "/0").strip("/") or 0)
        client = redis.Redis(host=host, port=port, db=db)
        client.script_load(_ACK_TAKE.text)
        client.close()
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(hiredis.pack_command(("SELECT", db)))
        self.reader = hiredis.Reader()
        while self.reader.gets() is False:      # SELECT's +OK
            self.reader.feed(self.sock.recv(65536))
        self.sock.setblocking(False)
        self.keys = ("unacked_index", "unacked", "delivery_counts", "lease_owners",
                     *(queue if p == 0 else f"{queue}\x06\x16{p}" for p in PRIORITIES))
        self.owner = f"floor-{os.getpid()}"
        self.answered = answered
        self.out: deque[tuple[object, str]] = deque()   # each request's context, score
        self.scores: dict[str, str] = {}        # a leased message's tag -> its take's score

    def send(self, acks: list[str], limit: int, context: object) -> None:
        score = repr(time.time())
        pairs = [x for tag in acks for x in (tag, self.scores.pop(tag))]
        self.sock.sendall(hiredis.pack_command(
            ("EVALSHA", _ACK_TAKE.sha, len(self.keys), *self.keys, score, limit,
             self.owner, len(acks), *pairs)))
        self.out.append((context, score))

    def readable(self) -> None:
        self.reader.feed(self.sock.recv(65536))
        while (reply := self.reader.gets()) is not False:
            context, score = self.out.popleft()
            lost = int(reply[0])
            assert lost == 0, f"{lost} acks found their lease gone"
            taken = reply[1 + lost:]
            messages = []
            for n in range(0, len(taken), 4):
                tag = taken[n + 3].decode()
                self.scores[tag] = score
                messages.append(envelope(tag, taken[n + 1]))
            self.answered(context, messages)

    def buffered(self) -> bool:
        return False        # (readable() leaves no whole answer in the reader)


class SqliteTaker:
    """Takes on SQLite: each one a transaction, carried out at once, on the loop."""

    sock = None
    pushes = False

    def __init__(self, url: str, queue: str, answered: Callable[[object, list], None]) -> None:
        self.store = Store(Path(url.removeprefix("sqlite:///")))
        self.queues = [queue]
        self.answered = answered
        self.leases: dict[str, tuple[int, str]] = {}

    def send(self, acks: list[str], limit: int, context: object) -> None:
        leases = [self.leases.pop(tag) for tag in acks]
        try:
            taken = self.store.lease_many(self.queues, 60.0, limit, leases, wait=False)
        except StoreBusy:
            taken = self.store.lease_many(self.queues, 60.0, limit, leases)
        for _queue, ident, token, _payload, _count in taken:
            self.leases[token] = (ident, token)
        self.answered(context, [envelope(token, payload) for _q, _i, token, payload, _c in taken])

    def readable(self) -> None:
        raise AssertionError("no socket")

    def buffered(self) -> bool:
        return False


class AmqpTaker:
    """RabbitMQ pushes what the prefetch (the window) allows; deliveries are read when the
    socket is (workhorse's frame reader), acks written at once, one write for a batch."""

    pushes = True

    def __init__(self, url: str, queue: str, answered: Callable[[object, list], None],
                 prefetch: int) -> None:
        parts = urlsplit(url)
        self.conn = AmqpConnection(
            host=f"{parts.hostname or '127.0.0.1'}:{parts.port or 5672}",
            userid=unquote(parts.username or "guest"),
            password=unquote(parts.password or "guest"),
            virtual_host=unquote(parts.path[1:]) or "/")
        self.conn.connect()
        self.channel = self.conn.channel()
        self.channel.basic_qos(0, prefetch, False)
        self.channel.basic_consume(queue, callback=self._delivered)
        self.sock = self.conn.sock
        self.answered = answered
        self.arrived: list[Message] = []

    def _delivered(self, message: Any) -> None:
        headers = message.properties["application_headers"]
        body = message.body
        self.arrived.append((message.delivery_tag, headers["task"], headers["id"],
                             body.encode() if isinstance(body, str) else body))

    def send(self, acks: list[str], limit: int, context: object) -> None:
        self.channel.ack_tags(acks)         # (an ack at start: written whole, as workhorse)
        self.answered(context, [])

    def readable(self) -> None:
        self.conn.deliver_ready()
        self.hand_over()

    def buffered(self) -> bool:
        """Frames read ahead whole (by a read that waited: at the start, or an ack's write)
        that select() cannot see are handed over here."""
        transport = self.conn.transport
        if not transport.frame_buffered():
            return False
        on_frame = self.conn.on_inbound_frame
        while (frame := transport.take_frame()) is not None:
            on_frame(frame)
        self.hand_over()
        return True

    def hand_over(self) -> None:
        arrived, self.arrived = self.arrived, []
        self.answered((None, False), arrived)


class Floor:
    def __init__(self, url: str, queue: str, concurrency: int, acks_late: bool) -> None:
        self.window = concurrency * int(os.environ.get("BENCH_PREFETCH_MULTIPLIER", "4"))
        self.broker: RedisTaker | SqliteTaker | AmqpTaker
        if url.startswith("amqp://"):
            self.broker = AmqpTaker(url, queue, self.answered,
                                    self.window if acks_late else self.window - concurrency)
        elif url.startswith("sqlite://"):
            self.broker = SqliteTaker(url, queue, self.answered)
        else:
            self.broker = RedisTaker(url, queue, self.answered)
        self.acks_late = acks_late
        self.buffer: deque[Message] = deque()
        self.held_acks: list[str] = []
        self.running: dict[int, str] = {}       # child's answer fd -> its message's tag
        self.acking = 0                          # acks at start sent, not answered
        self.takes_out = 0
        self.empty_until = 0.0
        self.selector = selectors.DefaultSelector()
        if self.broker.sock is not None:
            self.selector.register(self.broker.sock, selectors.EVENT_READ, None)
        self.idle: list[int] = []
        self.job_fds: dict[int, int] = {}        # answer fd -> job fd
        for _ in range(concurrency):
            jobs_r, jobs_w = os.pipe()
            answers_r, answers_w = os.pipe()
            if os.fork() == 0:
                os.close(jobs_w)
                os.close(answers_r)
                child(jobs_r, answers_w)
            os.close(jobs_r)
            os.close(answers_w)
            self.job_fds[answers_r] = jobs_w
            self.idle.append(answers_r)
            self.selector.register(answers_r, selectors.EVENT_READ, answers_r)

    def room(self) -> int:
        """What a take may ask for (RabbitMQ pushes: nothing)."""
        if self.broker.pushes:
            return 0
        return self.window - len(self.buffer) - len(self.running) - self.acking

    def send(self, acks: list[str], limit: int, start: Start | None = None) -> None:
        """One take: ``acks`` settled, up to ``limit`` messages taken; ``start``: the job
        its answer lets start (an ack at start)."""
        if limit > 0:
            self.takes_out += 1
        self.broker.send(acks, limit, (start, limit > 0))

    def answered(self, context: object, taken: list[Message]) -> None:
        start, took = context  # type: ignore[misc]
        if took:
            self.takes_out -= 1
            if not taken:
                self.empty_until = time.monotonic() + 0.001     # the queue is dry (the end)
        self.buffer += taken
        if start is not None:
            self.acking -= 1
            self.write_job(*start)

    def write_job(self, answers: int, message: Message) -> None:
        tag, name, task_id, body = message
        frame = marshal.dumps((name, task_id, body))
        os.write(self.job_fds[answers], _LENGTH.pack(len(frame)) + frame)
        self.running[answers] = tag

    def dispatch(self) -> None:
        while self.idle and self.buffer:
            answers, message = self.idle.pop(), self.buffer.popleft()
            if self.acks_late:
                self.write_job(answers, message)
            else:
                self.acking += 1
                self.send([message[0]], self.room() if not self.takes_out else 0,
                          (answers, message))

    def before_wait(self) -> None:
        room = self.room()
        if self.empty_until and time.monotonic() >= self.empty_until:
            self.empty_until = 0.0      # (looked again below: a poll a millisecond, no spin)
        if self.takes_out or self.empty_until:
            room = 0
        if self.held_acks and (room >= self.window // 2 or not self.buffer or (
                self.broker.pushes and len(self.held_acks) >= self.window // 2)):
            acks, self.held_acks = self.held_acks, []
            self.send(acks, room)
        elif room >= self.window // 2 or (room and not self.buffer):
            self.send([], room)

    def run(self) -> None:
        while True:
            self.dispatch()
            self.before_wait()
            if (self.buffer and self.idle) or self.broker.buffered():
                continue            # (SQLite: the take just now filled the buffer)
            timeout = None if not self.empty_until else max(
                0.0, self.empty_until - time.monotonic())
            for key, _ in self.selector.select(timeout):
                if key.data is None:
                    self.broker.readable()
                else:
                    answers = key.data
                    os.read(answers, 1)
                    tag = self.running.pop(answers)
                    self.idle.append(answers)
                    if self.acks_late:
                        self.held_acks.append(tag)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-Q", "--queue", required=True)
    parser.add_argument("-c", "--concurrency", type=int, default=2)
    args = parser.parse_args()
    url = os.environ.get("WORKHORSE_BROKER_URL", "redis://127.0.0.1:6379/0")
    if not url.startswith(("redis://", "sqlite:///", "amqp://")):
        parser.error(f"the floor runs on redis://, sqlite:/// and amqp:// brokers only, "
                     f"not {url!r}")
    acks_late = os.environ.get("BENCH_ACKS_LATE", "true") != "false"
    Floor(url, args.queue, args.concurrency, acks_late).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
