"""Prometheus metrics, served by the supervisor on ``metrics_bind:metrics_port``.

Counting is the loop thread's, in plain ints and dicts: no lock, no allocation on the
common path (a task costs a few dict updates). ``prometheus_client`` serves them from its
own HTTP thread through a collector that reads them when scraped: ``dict(...)`` copies
are taken in one step under the GIL, and lengths of what the supervisor holds are read
as they are, a gauge's worth. So a slow or stuck scraper never waits on the loop, and the
loop never waits on a scraper. Children are forked with the listening socket closed (it
is opened after the supervisor marks its inherited descriptors).
"""
from __future__ import annotations

import bisect
import json
import logging
import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

log = logging.getLogger("workhorse.supervisor")

#: Task runtime histogram buckets, in seconds (Prometheus' defaults, stretched to an hour).
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
           900.0, 3600.0)


#: Task wait histogram buckets (from sent, due or received to start), in seconds.
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                300.0, 900.0, 3600.0)


class Metrics:
    """The counts (loop thread writes; the collector reads)."""

    def __init__(self, held: Callable[[], Mapping[str, int]],
                 lease_renewals: Callable[[], int],
                 scale: Callable[[], Mapping[str, Any]] | None = None) -> None:
        self.held = held                                   # messages held, by stage
        self.lease_renewals = lease_renewals
        #: What /scale shows (the queues' backlog, the slots), read when scraped.
        self.scale = scale
        #: since (sent, due, received) -> [count in each bucket, sum of seconds]
        self.waits: dict[str, list[Any]] = {}
        self.tasks: Counter[tuple[str, str]] = Counter()   # (task, outcome) -> settled
        #: task -> [count in each bucket (the last: above them all), sum of seconds]
        self.runtimes: dict[str, list[Any]] = {}
        self.child_exits: Counter[str] = Counter()         # reason -> children replaced
        self.dead_lettered = 0
        self.broker_connections = 0
        self.loop_lag = 0.0
        self.schedules_sent: Counter[str] = Counter()      # schedule -> due times sent here
        self.schedules_skipped: Counter[str] = Counter()   # schedule -> due times missed
        self.schedules_late: dict[str, float] = {}         # schedule -> the last one's lateness

    # ------------------------------------------------------------------ loop thread
    def settled(self, task: str, outcome: str) -> None:
        self.tasks[task, outcome] += 1

    def schedule_sent(self, name: str, late: float) -> None:
        self.schedules_sent[name] += 1
        self.schedules_late[name] = late

    def schedule_skipped(self, name: str, count: int) -> None:
        self.schedules_skipped[name] += count

    def child_exited(self, reason: str) -> None:
        self.child_exits[reason] += 1

    def ran(self, task: str, seconds: float) -> None:
        _observe(self.runtimes, task, BUCKETS, seconds)

    def waited(self, since: str, seconds: float) -> None:
        """A task started ``seconds`` after it was sent, due (ETA) or received here."""
        _observe(self.waits, since, WAIT_BUCKETS, max(0.0, seconds))

    # ------------------------------------------------------------------ scrape thread
    def families(self) -> Iterator[Metric]:
        tasks = CounterMetricFamily("workhorse_tasks", "Tasks settled, by task and outcome "
                                    "(succeeded, failed, retry, time_limit, child_lost, "
                                    "revoked, ...).", labels=["task", "outcome"])
        for (task, outcome), count in dict(self.tasks).items():
            tasks.add_metric([task, outcome], count)
        yield tasks
        yield _histogram("workhorse_task_runtime_seconds", "How long task bodies ran, by "
                         "task.", "task", BUCKETS, self.runtimes)
        yield _histogram("workhorse_task_wait_seconds", "How long tasks waited to start: "
                         "since they were sent (producers that stamp the send time: "
                         "workhorse's), since they were due (ETA/countdown), or since this "
                         "worker received them (unstamped).", "since", WAIT_BUCKETS,
                         self.waits)
        if self.scale is not None:
            yield from _scale_families(self.scale())
        yield _labelled(GaugeMetricFamily, "workhorse_messages_held", "Messages the "
                        "supervisor holds, by stage (buffered, scheduled, running, storing).",
                        "stage", self.held())
        yield _labelled(CounterMetricFamily, "workhorse_child_restarts", "Children replaced, "
                        "by why the last one ended (crashed, recycled, time_limit, "
                        "terminated, ...).", "reason", self.child_exits)
        yield CounterMetricFamily("workhorse_dead_lettered", "Messages dead-lettered.",
                                  value=self.dead_lettered)
        yield CounterMetricFamily("workhorse_broker_connections", "Broker connections made "
                                  "(the first, then each reconnect).",
                                  value=self.broker_connections)
        yield CounterMetricFamily("workhorse_lease_renewals", "Leases renewed (Redis, SQLite: "
                                  "a held message kept from other workers).",
                                  value=self.lease_renewals())
        yield _labelled(CounterMetricFamily, "workhorse_schedule_sent", "Due times of "
                        "periodic tasks this worker sent, by schedule.", "schedule",
                        self.schedules_sent)
        yield _labelled(CounterMetricFamily, "workhorse_schedule_skipped", "Due times of "
                        "periodic tasks missed and not sent (catchup, misfire_grace), by "
                        "schedule.", "schedule", self.schedules_skipped)
        yield _labelled(GaugeMetricFamily, "workhorse_schedule_late_seconds", "How long "
                        "after its due time this worker sent a schedule's last task.",
                        "schedule", self.schedules_late)
        yield GaugeMetricFamily("workhorse_loop_lag_seconds", "How late the supervisor's "
                                "loop last ran a timer: its turns are this slow.",
                                value=self.loop_lag)


def _observe(histograms: dict[str, list[Any]], key: str, bounds: tuple[float, ...],
             seconds: float) -> None:
    found = histograms.get(key)
    if found is None:
        found = histograms[key] = [[0] * (len(bounds) + 1), 0.0]
    found[0][bisect.bisect_left(bounds, seconds)] += 1
    found[1] += seconds


def _histogram(name: str, text: str, label: str, bounds: tuple[float, ...],
               histograms: dict[str, list[Any]]) -> Metric:
    metric = HistogramMetricFamily(name, text, labels=[label])
    for key, (counts, total) in dict(histograms).items():
        counts = list(counts)
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, bounds), "+Inf"), counts, strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        metric.add_metric([key], buckets, total)
    return metric


def _scale_families(scale: Mapping[str, Any]) -> Iterator[Metric]:
    queues: Mapping[str, Mapping[str, Any]] = scale["queues"]
    if scale["backlog_known"]:
        yield _labelled(GaugeMetricFamily, "workhorse_queue_ready_messages", "Messages ready "
                        "in each queue this worker consumes, as its broker tells (read every "
                        "second).", "queue", {q: v["ready"] for q, v in queues.items()})
        yield _labelled(GaugeMetricFamily, "workhorse_queue_oldest_ready_age_seconds", "How "
                        "long the oldest ready message of each queue has waited (SQLite, "
                        "Redis: from its send time; else at most how long the queue has not "
                        "been seen empty).", "queue",
                        {q: v["oldest_age"] for q, v in queues.items()
                         if v["oldest_age"] is not None})
    yield _labelled(GaugeMetricFamily, "workhorse_queue_scheduled_messages", "ETA/countdown "
                    "messages this worker holds until they are due, by queue (never counted "
                    "as backlog).", "queue", {q: v["scheduled"] for q, v in queues.items()})
    slots = scale["slots"]
    yield _labelled(GaugeMetricFamily, "workhorse_slots", "This worker's children, busy "
                    "with a task or idle.", "state",
                    {"busy": slots["busy"], "idle": slots["total"] - slots["busy"]})


def _labelled(family: type[Any], name: str, text: str, label: str,
              values: Mapping[str, float]) -> Metric:
    """A family with one label, from a dict the loop thread writes (copied in one step)."""
    metric = family(name, text, labels=[label])
    for key, value in dict(values).items():
        metric.add_metric([key], value)
    return metric


class _Collector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return self.metrics.families()


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        return None


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class MetricsServer:
    """Prometheus' exposition at ``/metrics`` (and any other path but ``/scale``), and the
    JSON of ``/scale``, served on threads of their own."""

    def __init__(self, metrics: Metrics, port: int, bind: str) -> None:
        self.metrics = metrics
        self.port = port
        self.bind = bind
        self._server: Any = None

    def start(self) -> None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self.metrics))
        exposition = make_wsgi_app(registry)

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
            if environ.get("PATH_INFO", "").rstrip("/") == "/scale" and self.metrics.scale:
                body = json.dumps(self.metrics.scale(), sort_keys=True).encode()
                start_response("200 OK", [("Content-Type", "application/json"),
                                          ("Content-Length", str(len(body)))])
                return [body]
            return exposition(environ, start_response)

        family = socket.getaddrinfo(self.bind, self.port, type=socket.SOCK_STREAM)[0][0]
        server_class = type("_Bound", (_Server,), {"address_family": family})
        self._server = make_server(self.bind, self.port, app, server_class,
                                   handler_class=_Quiet)
        threading.Thread(target=self._server.serve_forever, name="metrics",
                         daemon=True).start()
        log.info("metrics: serving Prometheus on http://%s:%d/metrics%s", self.bind,
                 self.port, " and /scale" if self.metrics.scale else "")

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
