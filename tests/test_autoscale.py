"""Backlog signals and autoscaling, as pure logic: the autoscaler's rule, /scale's load,
the backlog thread's reading of what a broker tells, send-time stamps, the autoscale
setting, and the metrics server's /scale and queue families (on a real local port)."""
from __future__ import annotations

import json
import socket
import urllib.request
from datetime import datetime
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from workhorse.config import ConfigError
from workhorse.config.loader import load_settings
from workhorse.daemon.autoscale import Autoscaler, clamp, load
from workhorse.daemon.backlog import PROBE_INTERVAL, BacklogThread, QueueView, View
from workhorse.daemon.metrics import Metrics, MetricsServer, _Collector
from workhorse.transport.backlog import MS_HEADER, Backlog, sent_at, stamp_amqp

from .test_metrics import samples

pytestmark = pytest.mark.timeout(30)


def scaler(**kw: float) -> Autoscaler:
    return Autoscaler(int(kw.pop("low", 1)), int(kw.pop("high", 4)), kw.pop("target", 1.0),
                      kw.pop("idle", 30.0))


def test_the_pool_grows_one_child_a_second_while_the_oldest_message_is_past_the_target():
    a = scaler()
    assert a.decide(0.0, 1, 0, ready=10, oldest_age=3.0) == 2
    assert a.decide(0.5, 2, 0, ready=10, oldest_age=3.0) == 2      # a second between steps
    assert a.decide(1.0, 2, 0, ready=10, oldest_age=3.0) == 3
    assert a.decide(2.0, 3, 0, ready=10, oldest_age=3.0) == 4
    assert a.decide(3.0, 4, 0, ready=10, oldest_age=3.0) == 4      # at the most
    assert a.decide(4.0, 4, 0, ready=10, oldest_age=0.5) == 4


def test_a_backlog_younger_than_the_target_does_not_grow_the_pool():
    a = scaler(target=2.0)
    assert a.decide(0.0, 1, 0, ready=50, oldest_age=1.9) == 1
    assert a.decide(5.0, 1, 0, ready=50, oldest_age=2.1) == 2


def test_the_pool_shrinks_by_idle_children_only_after_the_idle_time_without_a_backlog():
    a = scaler(low=1, high=4, idle=10.0)
    assert a.decide(0.0, 3, 1, ready=5, oldest_age=2.0) == 4       # waiting past the target
    assert a.decide(5.0, 4, 3, ready=0, oldest_age=0.0) == 4       # quiet 5 s: not yet
    assert a.decide(10.0, 4, 2, ready=0, oldest_age=0.0) == 3
    assert a.decide(10.5, 3, 2, ready=0, oldest_age=0.0) == 3      # a second between steps
    assert a.decide(11.0, 3, 2, ready=0, oldest_age=0.0) == 2
    # One idle child at a look: one fewer would have left none spare; the quiet time
    # starts again.
    assert a.decide(12.0, 2, 1, ready=0, oldest_age=0.0) == 2
    assert a.decide(21.0, 2, 2, ready=0, oldest_age=0.0) == 2
    assert a.decide(22.0, 2, 2, ready=0, oldest_age=0.0) == 1
    assert a.decide(40.0, 1, 1, ready=0, oldest_age=0.0) == 1      # at the least


def test_a_look_with_every_child_busy_keeps_the_pool_for_another_idle_time():
    a = scaler(low=1, high=8, idle=10.0)
    assert a.decide(0.0, 6, 2, ready=0, oldest_age=0.0) == 6
    assert a.decide(9.0, 6, 0, ready=0, oldest_age=0.0) == 6       # all busy at this look
    assert a.decide(18.0, 6, 2, ready=2, oldest_age=0.05) == 6     # young messages: no backlog
    assert a.decide(19.0, 6, 2, ready=0, oldest_age=0.0) == 5


def test_a_backlog_getting_younger_is_being_caught_up_and_grows_nothing():
    a = scaler(high=8)
    assert a.decide(0.0, 2, 0, ready=90, oldest_age=2.0) == 3
    assert a.decide(1.0, 3, 0, ready=80, oldest_age=2.5) == 4
    assert a.decide(2.0, 4, 0, ready=40, oldest_age=1.8) == 4      # younger: catching up
    assert a.decide(3.0, 4, 0, ready=30, oldest_age=1.9) == 5      # older again


def test_each_change_waits_for_a_reading_taken_after_the_last_one():
    a = scaler(high=8)
    assert a.decide(0.0, 2, 0, ready=90, oldest_age=2.0, read_at=0.0) == 3
    assert a.decide(1.0, 3, 0, ready=90, oldest_age=2.0, read_at=0.0) == 3   # the same one
    assert a.decide(2.0, 3, 0, ready=90, oldest_age=2.1, read_at=2.0) == 4


def test_young_ready_messages_neither_grow_the_pool_nor_stop_it_shrinking():
    a = scaler(low=1, high=8, idle=5.0)
    assert a.decide(0.0, 4, 2, ready=3, oldest_age=0.2) == 4
    assert a.decide(5.0, 4, 2, ready=3, oldest_age=0.2) == 3


def test_the_load_is_the_busy_share_plus_how_far_the_oldest_message_is_past_the_target():
    assert load(busy=2, slots=4, ready=0, oldest_age=0.0, target_age=1.0) == 0.5
    assert load(busy=4, slots=4, ready=10, oldest_age=3.0, target_age=1.0) == 4.0
    assert load(busy=4, slots=4, ready=10, oldest_age=0.5, target_age=2.0) == 1.25
    assert load(busy=4, slots=4, ready=8, oldest_age=None, target_age=1.0) == 3.0
    assert load(busy=0, slots=0, ready=0, oldest_age=None, target_age=1.0) == 0.0


def test_clamp_brings_a_size_within_the_bounds():
    assert clamp(8, (2, 4)) == 4 and clamp(1, (2, 4)) == 2 and clamp(3, (2, 4)) == 3
    assert clamp(7, None) == 7


@pytest.mark.parametrize(("raw", "bounds"), [("2,8", (2, 8)), ("8,2", (2, 8)),
                                             (" 3 , 3 ", (3, 3)), ("none", None)])
def test_autoscale_takes_two_sizes_in_either_order(raw, bounds):
    settings = load_settings(env={"WORKHORSE_AUTOSCALE": raw})
    assert settings.autoscale == bounds


@pytest.mark.parametrize("raw", ["8", "0,3", "2,3,4", "a,b", "2,2000"])
def test_a_bad_autoscale_is_refused_naming_the_setting(raw):
    with pytest.raises(ConfigError, match=r"WORKHORSE_AUTOSCALE = .*two integers from 1 "
                                          r"to 1024"):
        load_settings(env={"WORKHORSE_AUTOSCALE": raw})


def test_the_autoscale_bounds_come_from_toml_as_an_array(tmp_path):
    path = tmp_path / "w.toml"
    path.write_text("[worker]\nautoscale = [6, 2]\nautoscale_target_age = 0.5\n")
    settings = load_settings(config_file=path, env={})
    assert settings.autoscale == (2, 6) and settings.autoscale_target_age == 0.5


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_backlog_thread_reads_ages_from_send_times_and_bounds_them_where_unknown():
    clock = Clock()
    told = {"stamped": Backlog(5, 990.0), "empty": Backlog(0), "unstamped": Backlog(3, None, 2)}
    thread = BacklogThread(app=None, queues=lambda: list(told),  # type: ignore[arg-type]
                           clock=clock, monotonic=clock)
    view = thread.read(told.__getitem__, list(told))
    assert view.queues["stamped"] == QueueView(5, 10.0, False, None)
    assert view.queues["empty"] == QueueView(0, 0.0, False, None)
    # Never seen empty: counted from the first look.
    assert view.queues["unstamped"] == QueueView(3, 0.0, True, 2)
    clock.now += 4
    view = thread.read(told.__getitem__, list(told))
    assert view.queues["unstamped"].oldest_age == 4.0
    assert view.ready == 8 and view.oldest_age == 14.0
    told["unstamped"] = Backlog(0)
    thread.read(told.__getitem__, list(told))
    told["unstamped"] = Backlog(1)
    clock.now += 2
    assert thread.read(told.__getitem__, ["unstamped"]).queues["unstamped"].oldest_age == 2.0


def test_an_unknown_age_is_bounded_by_the_last_message_taken_from_the_queue():
    clock = Clock()
    thread = BacklogThread(app=None, queues=lambda: ["q"],  # type: ignore[arg-type]
                           clock=clock, monotonic=clock)
    told = {"q": Backlog(4, None, 1)}
    thread.read(told.__getitem__, ["q"])                   # not empty from 1000.0 on
    clock.now += 30
    assert thread.read(told.__getitem__, ["q"]).queues["q"].oldest_age == 30.0
    thread.taken("q", SimpleNamespace(properties={"timestamp": 1027.5}, headers={}))
    thread.taken("other", SimpleNamespace(properties={}, headers={}))   # no stamp: nothing
    assert thread.read(told.__getitem__, ["q"]).queues["q"] == QueueView(4, 2.5, True, 1)


def test_a_view_goes_stale_when_the_broker_stops_answering():
    view = View({"q": QueueView(1, 1.0)}, taken_at=100.0)
    assert view.fresh(100.0 + PROBE_INTERVAL)
    assert not view.fresh(100.0 + 4 * PROBE_INTERVAL)
    assert not View({}, 0.0).fresh(1.0)


def test_send_times_come_from_the_milliseconds_header_or_the_timestamp_property():
    assert sent_at({"timestamp": 12}, {MS_HEADER: 12345}) == 12.345
    assert sent_at({"timestamp": 12.5}, {}) == 12.5
    assert sent_at({"timestamp": datetime(1970, 1, 1, 0, 0, 7)}, None) == 7.0
    assert sent_at({}, {}) is None and sent_at(None, None) is None
    assert sent_at({"timestamp": True}, {MS_HEADER: "x"}) is None


def test_an_amqp_stamp_keeps_the_callers_headers_and_a_copy_keeps_its_first_stamp():
    headers = {"id": "t1"}
    properties = {"application_headers": headers}
    stamp_amqp(properties)
    assert headers == {"id": "t1"}, "the caller's dict was changed"
    first = dict(properties)
    assert isinstance(first["timestamp"], int) and MS_HEADER in first["application_headers"]
    stamp_amqp(properties)
    assert properties == first


SCALE = {"worker": "w@x", "backlog_known": True, "ready": 7, "oldest_age": 2.5,
         "scheduled": 1, "slots": {"busy": 3, "total": 4}, "load": 3.25, "target_age": 1.0,
         "autoscale": [1, 4],
         "queues": {"q1": {"ready": 7, "oldest_age": 2.5, "oldest_age_estimated": False,
                           "consumers": None, "scheduled": 1}}}


def test_the_queue_and_slot_families_are_exposed():
    metrics = Metrics(lambda: {}, lambda: 0, lambda: SCALE)
    metrics.waited("sent", 0.02)
    metrics.waited("received", 4.0)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(metrics))
    found = samples(generate_latest(registry).decode())
    assert found[("workhorse_queue_ready_messages", (("queue", "q1"),))] == 7
    assert found[("workhorse_queue_oldest_ready_age_seconds", (("queue", "q1"),))] == 2.5
    assert found[("workhorse_queue_scheduled_messages", (("queue", "q1"),))] == 1
    assert found[("workhorse_slots", (("state", "busy"),))] == 3
    assert found[("workhorse_slots", (("state", "idle"),))] == 1
    assert found[("workhorse_task_wait_seconds_bucket", (("le", "0.025"), ("since", "sent")))
                 ] == 1
    assert found[("workhorse_task_wait_seconds_count", (("since", "received"),))] == 1


def test_no_queue_gauges_while_the_backlog_is_not_known():
    unknown = {**SCALE, "backlog_known": False}
    metrics = Metrics(lambda: {}, lambda: 0, lambda: unknown)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(metrics))
    text = generate_latest(registry).decode()
    assert "workhorse_queue_ready_messages{" not in text
    assert "workhorse_slots{" in text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_metrics_port_serves_scale_as_json_beside_the_exposition():
    port = _free_port()
    server = MetricsServer(Metrics(lambda: {}, lambda: 0, lambda: SCALE), port, "127.0.0.1")
    server.start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/scale", timeout=5) as answer:
            assert answer.headers["Content-Type"] == "application/json"
            assert json.loads(answer.read()) == SCALE
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            assert b"workhorse_slots" in answer.read()
    finally:
        server.stop()
