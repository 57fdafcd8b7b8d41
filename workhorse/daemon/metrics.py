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
import logging
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
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


class Metrics:
    """The counts (loop thread writes; the collector reads)."""

    def __init__(self, held: Callable[[], Mapping[str, int]],
                 lease_renewals: Callable[[], int]) -> None:
        self.held = held                                   # messages held, by stage
        self.lease_renewals = lease_renewals
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
        found = self.runtimes.get(task)
        if found is None:
            found = self.runtimes[task] = [[0] * (len(BUCKETS) + 1), 0.0]
        found[0][bisect.bisect_left(BUCKETS, seconds)] += 1
        found[1] += seconds

    # ------------------------------------------------------------------ scrape thread
    def families(self) -> Iterator[Metric]:
        tasks = CounterMetricFamily("workhorse_tasks", "Tasks settled, by task and outcome "
                                    "(succeeded, failed, retry, time_limit, child_lost, "
                                    "revoked, ...).", labels=["task", "outcome"])
        for (task, outcome), count in dict(self.tasks).items():
            tasks.add_metric([task, outcome], count)
        yield tasks
        runtime = HistogramMetricFamily("workhorse_task_runtime_seconds",
                                        "How long task bodies ran, by task.", labels=["task"])
        for task, (counts, total) in dict(self.runtimes).items():
            counts = list(counts)
            cumulative, buckets = 0, []
            for bound, count in zip((*map(str, BUCKETS), "+Inf"), counts, strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            runtime.add_metric([task], buckets, total)
        yield runtime
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


class MetricsServer:
    """prometheus_client's HTTP server on a thread of its own."""

    def __init__(self, metrics: Metrics, port: int, bind: str) -> None:
        self.metrics = metrics
        self.port = port
        self.bind = bind
        self._server: Any = None

    def start(self) -> None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self.metrics))
        self._server, _thread = start_http_server(self.port, addr=self.bind, registry=registry)
        log.info("metrics: serving Prometheus on http://%s:%d/metrics", self.bind, self.port)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
