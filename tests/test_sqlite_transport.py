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


def test_a_dead_consumers_lease_expires_and_the_message_comes_back(url):
    with conn(url) as c:
        c.SimpleQueue("q").put("work")
    ctx = multiprocessing.get_context("fork")
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
            start = time.monotonic()
            for _ in range(10):
                with pytest.raises(socket.timeout):
                    c.drain_events(timeout=0)
            assert (time.monotonic() - start) / 10 < 0.02


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


def test_two_consumer_processes_share_a_queue_without_duplicates_or_losses(url):
    with conn(url) as c:
        q = c.SimpleQueue("shared")
        for n in range(500):
            q.put(n)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_drain_into, args=(url, out)) for _ in range(2)]
    for p in procs:
        p.start()
    got = [out.get(timeout=30) for _ in range(500)]
    for p in procs:
        p.join(30)
    assert sorted(got) == list(range(500))
