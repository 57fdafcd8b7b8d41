"""The embedded SQLite broker: leases, not deletes; shared by processes on one host."""
from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import time
from pathlib import Path
from queue import Empty

import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue

import workhorse  # noqa: F401 - registers the sqlite:// transport
from workhorse.transport.store import Store

from .conftest import wait_until


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'broker.sqlite3'}"


def conn(url: str, vt: float = 3600.0) -> Connection:
    return Connection(url, transport_options={"visibility_timeout": vt})


def test_url_forms(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with conn("sqlite:///rel/b.sqlite3") as c:
        c.SimpleQueue("q").put(1)
    assert (tmp_path / "rel" / "b.sqlite3").exists()
    with pytest.raises(ValueError, match="needs a file"):
        conn("sqlite://").connect()


def test_ack_deletes_the_row(url, tmp_path):
    with conn(url) as c:
        q = c.SimpleQueue("q")
        q.put({"n": 1})
        message = q.get(timeout=1)
        assert message.payload == {"n": 1}
        assert message.delivery_info["delivery_count"] == 1
        assert "redelivered" not in message.delivery_info
        assert Store(tmp_path / "broker.sqlite3").browse("q")[0][3] is True   # leased
        message.ack()
        assert Store(tmp_path / "broker.sqlite3").browse("q") == []


def test_requeue_puts_it_first_in_line_again_uncounted(url):
    with conn(url) as c:
        q = c.SimpleQueue("q")
        for n in range(3):
            q.put(n)
        first = q.get(timeout=1)
        first.requeue()
        again = q.get(timeout=1)
        assert again.payload == 0
        assert again.delivery_tag != first.delivery_tag
        # A clean hand-back by a live consumer is not a delivery that counts.
        assert again.delivery_info["delivery_count"] == 1
        assert "redelivered" not in again.delivery_info


def test_reject_drops(url):
    with conn(url) as c:
        q = c.SimpleQueue("q")
        q.put("x")
        q.get(timeout=1).reject()
        with pytest.raises(Empty):
            q.get(timeout=0.1)


def _hold_and_die(url: str, ready) -> None:
    with conn(url, vt=0.5) as c:
        message = c.SimpleQueue("q").get(timeout=5)
        ready.put(message.payload)
        time.sleep(60)   # killed long before this ends


def test_a_dead_consumers_lease_expires_and_the_message_comes_back(url, fork_ctx):
    with conn(url) as c:
        c.SimpleQueue("q").put("work")
    ctx = fork_ctx
    ready = ctx.Queue()
    proc = ctx.Process(target=_hold_and_die, args=(url, ready))
    proc.start()
    assert ready.get(timeout=10) == "work"
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    killed_at = time.time()
    with conn(url, vt=0.5) as c:
        q = c.SimpleQueue("q")
        with pytest.raises(Empty):          # still leased by the dead consumer
            q.get(timeout=0.05)
        message = q.get(timeout=5)
        assert time.time() - killed_at < 5
        assert message.payload == "work"
        assert message.delivery_info["delivery_count"] == 2 and message.headers["redelivered"]
        message.ack()


def test_a_late_ack_from_a_lost_lease_does_not_delete_the_new_lease(tmp_path):
    store = Store(tmp_path / "b.sqlite3")
    store.put("q", '{"x": 1}')
    old = store.lease("q", visibility_timeout=0.05)
    assert old is not None
    wait_until(lambda: store.size("q") == 1, 5, "the lease to expire")
    new = store.lease("q", visibility_timeout=60)
    assert new is not None and new[0] == old[0] and new[3] == 2
    assert store.ack((old[0], old[1])) is False       # lost lease: nothing deleted
    assert store.ack((new[0], new[1])) is True
    assert store.browse("q") == []


def test_acks_in_one_transaction_delete_only_leases_still_held(tmp_path, url):
    store = Store(tmp_path / "b.sqlite3")
    for n in range(3):
        store.put("q", f'{{"x": {n}}}')
    leases = [store.lease("q", visibility_timeout=60) for _ in range(3)]
    assert all(leases)
    held = [(lease[0], lease[1]) for lease in leases if lease]
    lost = (held[1][0], "another holder's token")
    assert store.ack_many([held[0], lost, held[2]]) == 2
    assert [row[0] for row in store.browse("q")] == [held[1][0]]     # the lost one stays
    with conn(url) as c:                                  # and through kombu's QoS
        q = c.SimpleQueue("r")
        for n in range(3):
            q.put(n)
        messages = [q.get(timeout=1) for _ in range(3)]
        messages[0].channel.qos.ack_many([m.delivery_tag for m in messages])
        assert Store(tmp_path / "broker.sqlite3").browse("r") == []


def test_one_take_leases_up_to_its_limit_in_order_and_delivers_them_all(tmp_path, url):
    """The worker's take: one transaction for a batch, by priority then age within a
    queue, queues in turn, each message its own lease and count; none held back unseen."""
    store = Store(tmp_path / "b.sqlite3")
    for n, priority in enumerate([0, 5, 0, 5]):
        store.put("a", f'{{"n": {n}}}', priority)
    store.put("b", '{"n": 9}')
    taken = store.lease_many(["a", "b"], 60, limit=3)
    assert [(queue, payload) for queue, _, _, payload, _ in taken] == [
        ("a", '{"n": 1}'), ("a", '{"n": 3}'), ("a", '{"n": 0}')]
    assert len({token for _, _, token, _, _ in taken}) == 3
    assert all(deliveries == 1 for *_, deliveries in taken)
    rest = store.lease_many(["a", "b"], 60, limit=5)
    assert [(queue, payload) for queue, _, _, payload, _ in rest] == [
        ("a", '{"n": 2}'), ("b", '{"n": 9}')]
    assert store.lease_many(["a", "b"], 60, limit=5) == []
    assert store.ack_many([(ident, token) for _, ident, token, _, _ in taken + rest]) == 5

    with conn(url) as c:
        got: list = []
        channel = c.channel()
        for name in ("x", "y"):
            Consumer(channel, [Queue(name)], on_message=got.append, no_ack=False).consume()
        producer = Producer(c)
        for name, n in (("x", 1), ("x", 2), ("y", 3), ("y", 4)):
            producer.publish({"n": n}, routing_key=name, exchange="")
        assert channel.take(3)
        assert [m.payload["n"] for m in got] == [1, 2, 3]       # x emptied, then y
        assert channel.take(3) and [m.payload["n"] for m in got] == [1, 2, 3, 4]
        assert not channel.take(3)
        for message in got:
            assert message.delivery_info["delivery_count"] == 1
            message.ack()
        assert Store(tmp_path / "broker.sqlite3").browse("x") == []
        # A turn's acks travel with its next take, in the same transaction; and alone.
        for n in (5, 6, 7):
            producer.publish({"n": n}, routing_key="x", exchange="")
        assert channel.take(2) == 2
        assert channel.take(2, acks=[m.delivery_tag for m in got[4:]]) == 1
        assert [m.payload["n"] for m in got[4:]] == [5, 6, 7]
        left = Store(tmp_path / "broker.sqlite3").browse("x")
        assert [(row[0], row[3]) for row in left] == [
            (int(got[6].delivery_tag.split(":")[0]), True)]       # 5 and 6 acked, 7 leased
        assert channel.take(0, acks=[got[6].delivery_tag]) == 0
        assert Store(tmp_path / "broker.sqlite3").browse("x") == []


def test_renew_extends_a_lease_and_reports_the_lost_ones(tmp_path):
    store = Store(tmp_path / "b.sqlite3")
    store.put("q", "a")
    store.put("q", "b")
    a = store.lease("q", 0.3)
    b = store.lease("q", 0.3)
    assert a and b
    store.ack((b[0], b[1]))
    alive = store.renew([(a[0], a[1]), (b[0], b[1])], visibility_timeout=60)
    assert alive == {(a[0], a[1])}
    time.sleep(0.4)   # past the original lease: only renewal keeps it from coming back
    assert store.lease("q", 60) is None


def test_closing_the_channel_releases_its_leases_at_once_still_counted(url):
    with conn(url) as c:
        q = c.SimpleQueue("q")
        q.put("held")
        q.get(timeout=1)     # never acked
    with conn(url) as c:
        message = c.SimpleQueue("q").get(timeout=0.5)
        assert message.payload == "held"
        assert message.delivery_info["delivery_count"] == 2     # not settled: it counts
        message.ack()


def test_a_delivery_is_counted_in_the_step_that_leases_it(tmp_path):
    """A consumer killed right after the lease has counted already: nothing is left to
    write by whoever dies."""
    store = Store(tmp_path / "b.sqlite3")
    store.put("q", "x")
    for expected in (1, 2, 3):
        leased = store.lease("q", visibility_timeout=0.05)
        assert leased is not None and leased[3] == expected
        assert store.browse("q")[0][2] == expected
        wait_until(lambda: store.size("q") == 1, 5, "the lease to expire")


def test_release_uncounted_takes_back_only_its_own_lease(tmp_path):
    store = Store(tmp_path / "b.sqlite3")
    store.put("q", "x")
    leased = store.lease("q", 60)
    assert leased is not None
    ident, token, _, _ = leased
    assert store.release([(ident, "not-ours")], uncount=True) == 0
    assert store.browse("q")[0][2] == 1
    assert store.release([(ident, token)], uncount=True) == 1
    assert store.browse("q")[0][2:] == (0, False)
    again = store.lease("q", 60)
    assert again is not None and again[3] == 1


def test_forgetting_a_lost_lease_takes_back_its_count_from_the_new_holder(tmp_path):
    """A live consumer's lease ran out (renewals failed) and another took the message:
    the lost delivery did not end in a loss, so it stops counting."""
    store = Store(tmp_path / "b.sqlite3")
    store.put("q", "x")
    old = store.lease("q", visibility_timeout=0.05)
    assert old is not None
    wait_until(lambda: store.size("q") == 1, 5, "the lease to expire")
    new = store.lease("q", visibility_timeout=60)
    assert new is not None and new[3] == 2
    assert store.forget((new[0], new[1])) is False      # a lease still held is left alone
    assert store.forget((old[0], old[1])) is True
    assert store.browse("q")[0][2:] == (1, True)        # still leased to the new holder
    assert store.ack((new[0], new[1])) is True


def test_a_lease_is_known_by_when_it_was_taken_or_last_renewed(url, tmp_path):
    """What the supervisor reads before it starts a buffered message (``lease_set_at``):
    when its lease was taken, then renewed; nothing once it is found lost."""
    store = Store(tmp_path / "broker.sqlite3")
    with conn(url, vt=0.2) as a, conn(url) as b:
        a.SimpleQueue("q").put("x")
        before = time.time()
        held = a.SimpleQueue("q").get(timeout=1)
        tag, channel = held.delivery_tag, held.channel
        taken_at = channel.lease_set_at(tag)
        assert taken_at is not None and before <= taken_at <= time.time()
        wait_until(lambda: time.time() > taken_at + 0.01, 1, "the clock to move")
        assert channel.renew([tag]) == []
        renewed_at = channel.lease_set_at(tag)
        assert renewed_at is not None and renewed_at > taken_at
        wait_until(lambda: store.size("q") == 1, 5, "the lease to expire")
        b.SimpleQueue("q").get(timeout=1)
        assert channel.renew([tag]) == [tag]
        assert channel.lease_set_at(tag) is None
        assert channel.lease_set_at("1:no-such-lease") is None


def test_forget_through_kombu_drops_the_message_and_uncounts_it(url, tmp_path):
    store = Store(tmp_path / "broker.sqlite3")
    with conn(url, vt=0.05) as a, conn(url) as b:
        a.SimpleQueue("q").put("x")
        lost = a.SimpleQueue("q").get(timeout=1)
        wait_until(lambda: store.size("q") == 1, 5, "the lease to expire")
        taken = b.SimpleQueue("q").get(timeout=1)
        assert taken.delivery_info["delivery_count"] == 2
        assert lost.channel.renew([lost.delivery_tag]) == [lost.delivery_tag]
        lost.channel.forget(lost.delivery_tag)
        assert store.browse("q")[0][2] == 1
        taken.requeue()                       # b's clean hand-back: uncounted too
    assert store.browse("q")[0][2:] == (0, False)   # closing a released nothing more


def test_priority_then_fifo(url):
    with conn(url) as c:
        producer = Producer(c)
        queue = Queue("p", Exchange("p"), routing_key="p")
        for name, priority in [("low1", 0), ("high", 9), ("low2", 0), ("mid", 5)]:
            producer.publish(name, exchange="", routing_key="p", priority=priority,
                             declare=[queue])
        q = c.SimpleQueue("p")
        got = []
        for _ in range(4):
            m = q.get(timeout=1)
            got.append(m.payload)
            m.ack()
    assert got == ["high", "mid", "low1", "low2"]


def test_prefetch_count_is_respected(url):
    with conn(url) as c:
        q = c.SimpleQueue("q")
        for n in range(5):
            q.put(n)
        got = []
        consumer = Consumer(c, [Queue("q")], callbacks=[lambda body, m: got.append(m)])
        consumer.qos(prefetch_count=2)
        with consumer:
            for _ in range(10):
                try:
                    c.drain_events(timeout=0.05)
                except TimeoutError:
                    pass
            assert len(got) == 2
            got[0].ack()
            c.drain_events(timeout=1)
            assert len(got) == 3


def test_drain_events_timeout_zero_returns_at_once(url):
    with conn(url) as c:
        with Consumer(c, [Queue("empty")], callbacks=[lambda *a: None]):
            took = []
            for _ in range(10):
                start = time.monotonic()
                with pytest.raises(socket.timeout):
                    c.drain_events(timeout=0)
                took.append(time.monotonic() - start)
            assert sorted(took)[5] < 0.02, took     # the median: one descheduling is noise


def test_routing_through_a_direct_exchange_works_across_processes(url):
    exchange = Exchange("ex", type="direct")
    with conn(url) as c:
        Queue("bound", exchange, routing_key="rk")(c.default_channel).declare()
    ctx = multiprocessing.get_context("spawn")   # a fresh process: no in-memory bindings
    proc = ctx.Process(target=_publish_via_exchange, args=(url,))
    proc.start()
    proc.join(30)
    assert proc.exitcode == 0
    with conn(url) as c:
        message = c.SimpleQueue("bound").get(timeout=1)
        assert message.payload == "routed"
        message.ack()


def _publish_via_exchange(url: str) -> None:
    with conn(url) as c:
        Producer(c).publish("routed", exchange="ex", routing_key="rk")


def _drain_into(url: str, out) -> None:
    with conn(url, vt=60) as c:
        q = c.SimpleQueue("shared")
        while True:
            try:
                m = q.get(timeout=0.5)
            except Empty:
                return
            out.put(m.payload)
            m.ack()


def test_two_consumer_processes_share_a_queue_without_duplicates_or_losses(url, fork_ctx):
    with conn(url) as c:
        q = c.SimpleQueue("shared")
        for n in range(500):
            q.put(n)
    ctx = fork_ctx
    out = ctx.Queue()
    procs = [ctx.Process(target=_drain_into, args=(url, out)) for _ in range(2)]
    for p in procs:
        p.start()
    got = [out.get(timeout=30) for _ in range(500)]
    for p in procs:
        p.join(30)
    assert sorted(got) == list(range(500))


# ---------------------------------------------------------------- wakeups
def test_a_publish_wakes_each_consuming_worker_and_a_dead_ones_registration_goes(tmp_path):
    """Tier 1. transport.wake: one byte per commit to every registered listener; a listener
    that is gone (a worker killed) is found out by the refused send and unregistered."""
    import select

    from workhorse.transport.wake import Listener, Notifier, wake_dir
    broker = tmp_path / "b.sqlite3"
    Notifier(broker).notify()                      # nobody registered: nothing to do
    first, second = Listener(broker), Listener(broker)
    dead = Listener(broker)
    dead.sock.close()                              # killed: its file stays behind
    notifier = Notifier(broker)
    notifier.notify()
    notifier.notify()
    for listener in (first, second):
        assert select.select([listener], [], [], 5)[0]
        assert listener.drain() == 2 and listener.drain() == 0
    assert sorted(os.listdir(wake_dir(broker))) == sorted([first.name, second.name])
    first.close()
    assert os.listdir(wake_dir(broker)) == [second.name]
    second.close()


def test_a_worker_on_the_sqlite_broker_is_woken_by_a_publish_not_by_polling(url, tmp_path):
    """Tier 3. The consumer's wakeup socket is what the broker thread watches: a message
    published makes it readable, and reading it takes the message. Between wakeups it polls
    only as a safety net."""
    import select

    from workhorse import App
    from workhorse.broker.consumer import BrokerConsumer
    from workhorse.broker.drivers import SAFETY_POLL
    app = App("t", broker_url=url, result_backend="disabled")
    received: list = []
    consumer = BrokerConsumer(app, ["wq"], lambda q, m: received.append(m), lambda e: None)
    consumer.connect(4, lambda: 4 - len(received))
    try:
        assert consumer.poll_interval == SAFETY_POLL
        [fd] = consumer.fds()
        assert not select.select([fd], [], [], 0)[0]
        with conn(url) as c:
            c.SimpleQueue("wq").put({"n": 1})
        assert select.select([fd], [], [], 5)[0], "the publish did not wake the consumer"
        consumer.on_readable(fd)
        assert [m.payload for m in received] == [{"n": 1}]
        assert not select.select([fd], [], [], 0)[0]
        received[0].ack()
    finally:
        consumer.close()
    assert not os.listdir(tmp_path / "broker.sqlite3.wake")     # unregistered on close


def test_without_wakeups_the_sqlite_consumer_polls_every_50_ms_and_says_so(
        url, monkeypatch, caplog):
    from workhorse import App
    from workhorse.broker import consumer as consumer_module
    from workhorse.broker.drivers import POLL_INTERVAL
    from workhorse.broker.drivers import sqlite as sqlite_driver

    def refuse(path):
        raise PermissionError(13, "read-only directory")
    monkeypatch.setattr(sqlite_driver, "Listener", refuse)
    app = App("t", broker_url=url, result_backend="disabled")
    consumer = consumer_module.BrokerConsumer(app, ["wq"], lambda q, m: None, lambda e: None)
    consumer.connect(4, lambda: 4)
    try:
        assert consumer.poll_interval == POLL_INTERVAL
        assert consumer.fds() == set()
        assert "publishers cannot wake this worker" in caplog.text
    finally:
        consumer.close()


def test_a_wakeup_that_fails_never_fails_the_publish(url, monkeypatch):
    """The message is committed before the wakeup: a publish that raised then would be
    sent again by a caller that retries."""
    from workhorse.transport import wake

    def broken(path):
        raise RuntimeError("anything at all")
    monkeypatch.setattr(wake.os, "listdir", broken)
    with conn(url) as c:
        q = c.SimpleQueue("nq")
        q.put({"n": 1})
        assert q.get(timeout=1).payload == {"n": 1}
