"""What a worker killed outright costs the messages it held, on every broker: its journal
says which it started, and whoever reads it (its restart, or any worker of the broker on
its host) charges a delivery only to those; the others count a held loss. On SQLite and
Redis they come back at once, without waiting for their leases to run out; RabbitMQ
gives them back itself, and its redeliveries are replaced by copies carrying the counts.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from workhorse.broker.consumer import BrokerConsumer
from workhorse.broker.journal import Journal, directory_for
from workhorse.protocol import DELIVERIES_HEADER, SUSPECT_HEADER, carried_held_losses

from .conftest import wait_until

pytestmark = pytest.mark.timeout(60)


def _journal_dir(tmp_path: Path, url: str) -> Path:
    return directory_for(tmp_path / "state", url)


def _consumer(app, broker, tmp_path: Path, name: str):  # type: ignore[no-untyped-def]
    received: list = []
    consumer = BrokerConsumer(app, [broker.queue], lambda q, m: received.append(m),
                              lambda exc: None)
    consumer.use_journal(Journal.create(_journal_dir(tmp_path, broker.url), name, lambda: ()))
    return consumer, received


def _receive(consumer: BrokerConsumer, received: list, count: int) -> list:
    """Poll until ``count`` messages are counted, as the broker thread hands them over."""
    counted: list = []

    def enough() -> bool:
        consumer.poll()
        while received:
            message = received.pop(0)
            deliveries = consumer.count_delivery(consumer.queues[0], message)
            if deliveries is not None:          # (None: replaced by a copy, which comes)
                counted.append((message, deliveries))
        return len(counted) >= count
    wait_until(enough, 20, f"{count} messages")
    return counted


def _hold_start_and_die(app, broker, tmp_path: Path, ready) -> None:  # type: ignore[no-untyped-def]
    """A worker that takes all four, starts 'a' and 'b' (b is over), and is killed."""
    consumer, received = _consumer(app, broker, tmp_path, "victim@test")
    consumer.connect(8, lambda: 8)
    counted = _receive(consumer, received, 4)
    if consumer.push:        # what the supervisor journals as messages arrive
        for message, _ in counted:
            consumer.journal.arrived(consumer.journal_key(message))
        consumer.journal.flush()
    by_id = {m.headers["id"]: m for m, _ in counted}
    consumer.journal.started(consumer.journal_key(by_id["a"]))
    consumer.journal.started(consumer.journal_key(by_id["b"]))
    consumer.journal.ended(consumer.journal_key(by_id["b"]))     # written with the next start
    consumer.journal.started(consumer.journal_key(by_id["c"]))
    ready.set()
    signal.pause()


def test_a_dead_workers_messages_are_charged_only_where_they_started(
        broker, client, tmp_path, fork_ctx):
    from tests.apps.basic import record
    for task_id in "abcd":
        record.apply_async(task_id=task_id)
    ready = fork_ctx.Event()
    victim = fork_ctx.Process(target=_hold_start_and_die,
                              args=(client, broker, tmp_path, ready))
    victim.start()
    assert ready.wait(30), "the victim did not take its messages"
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(10)

    consumer, received = _consumer(client, broker, tmp_path, "heir@test")
    try:
        consumer.connect(8, lambda: 8)      # reads the victim's journal at once
        counted = {m.headers["id"]: (m, n) for m, n in _receive(consumer, received, 4)}
        for task_id in "ac":                # running when it died: a delivery each, and
            message, deliveries = counted[task_id]          # each runs alone from now on
            assert deliveries == 2, task_id
            assert carried_held_losses(message.headers) == 0
            assert message.headers.get(SUSPECT_HEADER) == 1
        for task_id in "bd":                # over ('b') or only held ('d'): a held loss
            message, deliveries = counted[task_id]
            assert deliveries == 1, task_id
            assert carried_held_losses(message.headers) == 1
            assert not message.headers.get(SUSPECT_HEADER)
            assert (message.headers or {}).get(DELIVERIES_HEADER, 0) == 0
        # SQLite, Redis: acted on, and gone; RabbitMQ: kept for the redeliveries to come
        left = list(_journal_dir(tmp_path, broker.url).glob("victim*"))
        assert bool(left) == consumer.push
        for message, _ in counted.values():
            consumer.ack(message)
    finally:
        consumer.close()
        consumer.journal.close(remove=True)


@pytest.mark.parametrize("broker", ["amqp"], indirect=True)
def test_messages_only_buffered_when_a_live_workers_connection_was_lost_count_a_held_loss(
        broker, client, tmp_path):
    """RabbitMQ takes back what a lost connection held; the worker notes which of those it
    had not started (``Supervisor._broker_lost``): when they come back to it, marked
    redelivered, each counts a held loss, not a delivery."""
    from tests.apps.basic import record
    consumer, received = _consumer(client, broker, tmp_path, "live@test")
    try:
        record.apply_async(task_id="buffered")
        consumer.connect(4, lambda: 4)
        [(held, deliveries)] = _receive(consumer, received, 1)
        assert deliveries == 1
        consumer.journal.note_returned([consumer.journal_key(held)])
        consumer._lost(ConnectionError("lost in the test"))
        consumer.connect(4, lambda: 4)
        [(copy, deliveries)] = _receive(consumer, received, 1)
        assert deliveries == 1 and carried_held_losses(copy.headers) == 1
        assert not copy.delivery_info.get("redelivered")
        consumer.ack(copy)
    finally:
        consumer.close()
        consumer.journal.close(remove=True)
