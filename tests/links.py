"""A real BrokerLink with its broker thread, where the test is the loop thread: the
harness of the tests of what the loop thread does with the broker itself (SQLite's takes,
Redis's sent takes, RabbitMQ's acks at start)."""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kombu import Connection, Producer

from workhorse import App
from workhorse.broker import thread as broker_thread
from workhorse.broker.link import BrokerLink
from workhorse.broker.queues import ensure_queue
from workhorse.daemon.loop import Loop
from workhorse.protocol import build_message

from .conftest import BrokerEnv, make_broker, wait_until


class LinkHarness:
    """A BrokerLink on ``url`` consuming ``queue``, window 8; what it hands the loop is in
    ``received``."""

    def __init__(self, url: str, queue: str) -> None:
        self.url, self.queue = url, queue
        self.app = App("t", broker_url=url, result_backend="disabled")
        self.loop = Loop()
        self.received: list[Any] = []
        self.connected = threading.Event()
        self.link = BrokerLink(self.app, [queue], self.loop, self._received,
                               self.connected.set, lambda e: None, lambda e: None,
                               lambda: 8, None, True)

    def _received(self, queue: str, message: Any, deliveries: int) -> None:
        self.received.append(message)

    def publish(self, count: int) -> None:
        with Connection(self.url) as conn:
            ensure_queue(conn, self.queue)
            producer = Producer(conn)
            for n in range(count):
                msg = build_message("t.add", f"id-{n}", [n], {})
                producer.publish(msg.body, exchange="", routing_key=self.queue,
                                 serializer="json", headers=msg.headers)

    def start(self) -> None:
        """The broker thread started and connected."""
        self.link.start()
        self.turn_until(self.connected.is_set, "the broker thread to connect")

    def turn_until(self, condition: Any, what: str) -> None:
        """Turn the loop until ``condition()`` holds (10 s at most)."""
        def turned() -> object:
            self.loop.run_once(0.02)
            return condition()
        wait_until(turned, 10, what, interval=0)

    def parked(self) -> bool:
        """Is the broker thread parked with nothing submitted to it (the loop thread may
        borrow its consumer)?"""
        if self.link.thread.borrow() is None:
            return False
        self.link.thread.give_back()
        return True


class AmqpLinkHarness(LinkHarness):
    """The harness on RabbitMQ (``broker``)."""

    def __init__(self, broker: BrokerEnv) -> None:
        super().__init__(broker.url, broker.queue)
        self.broker = broker

    @property
    def transport(self) -> Any:
        return self.link.thread.consumer.connection.connection.transport

    def settled_at_the_server(self) -> None:
        """Once the connection is closed, nothing came back: every ack was taken."""
        self.link.close(5)
        wait_until(lambda: self.broker.queue_size() == 0, 5, "an empty queue")
        assert self.broker.drain(self.broker.queue) == []


H = TypeVar("H", bound=AmqpLinkHarness)


@contextlib.contextmanager
def on_rabbitmq(make: Callable[[BrokerEnv], H], tmp_path: Path,
                monkeypatch: pytest.MonkeyPatch) -> Iterator[H]:
    """``make(broker)`` on a RabbitMQ queue of its own, started, with a credit of 8."""
    # The loop thread reads and writes only while the broker thread is parked: its idle
    # turns would now and then be under way when a test acks or publishes.
    monkeypatch.setattr(broker_thread, "IDLE_TURN", 3600.0)
    broker = make_broker("amqp", tmp_path)
    it = make(broker)
    it.publish(0)                      # the queue exists before it connects
    it.start()
    it.link.set_credit(8)
    try:
        yield it
    finally:
        it.link.close(5)
        broker.cleanup()


class ShapedSocket:
    """A connection's socket that takes ``room`` bytes at most without waiting (None: as
    many as it takes), and gives ``size`` bytes at most a read (None: what it holds)."""

    def __init__(self, sock: Any, room: int | None = None, size: int | None = None) -> None:
        self.sock, self.room, self.size = sock, room, size

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)

    def send(self, data: bytes, flags: int = 0) -> int:
        if self.room is None:
            return int(self.sock.send(data, flags))
        if self.room == 0:
            raise BlockingIOError(11, "full")
        sent: int = self.sock.send(data[:self.room], flags)
        self.room -= sent
        return sent

    def recv(self, size: int, flags: int = 0) -> bytes:
        data: bytes = self.sock.recv(size if self.size is None else min(size, self.size),
                                     flags)
        return data
