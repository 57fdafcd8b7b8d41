"""A real BrokerLink with its broker thread, where the test is the loop thread: the
harness of the tests of what the loop thread does with the broker itself (SQLite's takes,
Redis's sent takes, RabbitMQ's acks at start)."""
from __future__ import annotations

import threading
from typing import Any

from kombu import Connection, Producer

from workhorse import App
from workhorse.broker.link import BrokerLink
from workhorse.broker.queues import ensure_queue
from workhorse.daemon.loop import Loop
from workhorse.protocol import build_message

from .conftest import wait_until


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
