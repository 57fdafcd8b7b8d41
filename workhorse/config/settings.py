"""Every setting, declared once: name, section, type, default, help, env var, CLI flag.

The declarations drive the TOML/INI loaders, env vars, CLI flags, `workhorse config`,
the reference in docs/settings.md, and the tests that walk every setting.
"""
from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..urls import alternatives, redact, split_master_name
from . import types as t

SECTIONS = ("worker", "broker", "results", "tasks")

BROKER_SCHEMES = ("sqlite", "redis", "rediss", "valkey", "valkeys", "sentinel", "amqp",
                  "amqps", "pyamqp", "memory")
RESULT_SCHEMES = ("sqlite", "redis", "rediss", "valkey", "valkeys", "sentinel")


@dataclass(frozen=True)
class Setting:
    name: str
    section: str
    type: t.ValueType
    default: Any | Callable[[Mapping[str, Any]], Any]
    help: str
    default_doc: str | None = None
    cli: tuple[str, ...] = ()
    #: Applied by a reload (SIGHUP); False: read at start only, a change needs a restart.
    reload: bool = True

    @property
    def env(self) -> str:
        return "WORKHORSE_" + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def flags(self) -> tuple[str, ...]:
        return (*self.cli, self.flag)

    @property
    def derived(self) -> bool:
        return callable(self.default)

    def default_value(self, resolved: Mapping[str, Any]) -> Any:
        return self.default(resolved) if callable(self.default) else self.default


def _default_state_dir(_: Mapping[str, Any]) -> Path:
    systemd = os.environ.get("STATE_DIRECTORY")
    if systemd:
        return Path(systemd.split(":")[0]).absolute()
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "state"
    return (base / "workhorse").absolute()


def _check_url(schemes: tuple[str, ...], extra: str = "") -> Callable[[str], str | None]:
    def check(value: str) -> str | None:
        scheme = value.split("://", 1)[0] if "://" in value else None
        if scheme in schemes:
            return None
        return f"expected a URL with scheme {', '.join(schemes)}{extra}"
    return check


def _check_broker_url(value: str) -> str | None:
    """A broker URL, or a failover list of them (``amqp://h1//;amqp://h2//``): one scheme,
    and only for brokers with more than one server."""
    return _check_list(value, BROKER_SCHEMES, ("sqlite", "memory"))


def _check_list(value: str, schemes: tuple[str, ...], single: tuple[str, ...],
                extra: str = "") -> str | None:
    """A URL, or a list of them of one scheme (``a;b``) where ``single`` does not hold it."""
    urls = alternatives(split_master_name(value)[0])
    check = _check_url(schemes, extra)
    for url in urls or [value]:
        if (problem := check(url)) is not None:
            return problem if len(urls) < 2 else f"{problem} (in {redact(url)!r})"
    found = {url.split("://", 1)[0] for url in urls}
    if len(urls) > 1 and len(found) > 1:
        return f"the URLs of a failover list share one scheme, not {', '.join(sorted(found))}"
    if len(urls) > 1 and found & set(single):
        return (f"a list of URLs (url;url) is not for {' or '.join(sorted(found & set(single)))}"
                f" (it is for {', '.join(s for s in schemes if s not in single)})")
    return None


def _check_backend(value: str) -> str | None:
    if value == "disabled" or ("://" not in value and "." in value):
        return None
    if value.startswith("rpc://"):
        return None     # Celery's RPC store: through the broker, nothing more to name
    if value.startswith("db+"):
        # Celery's database store: SQLAlchemy's URL after db+, which SQLAlchemy checks.
        dialect = value[3:].split("://", 1)[0]
        if "://" in value and dialect and all(part.isidentifier()
                                              for part in dialect.split("+")):
            return None
        return "expected db+<SQLAlchemy URL>, such as db+postgresql://user@host/database"
    return _check_list(value, RESULT_SCHEMES, ("sqlite", "redis", "rediss", "valkey", "valkeys"),
                       ", db+<SQLAlchemy URL>, rpc://, \"disabled\" or a class path "
                       "(package.module:Class)")


def _check_app(value: str) -> str | None:
    module, _, attribute = value.partition(":")
    if module and all(part.isidentifier() for part in module.split(".")) and (
            not attribute or attribute.isidentifier()):
        return None
    return "expected module or module:attribute"


SETTINGS: tuple[Setting, ...] = (
    # [worker]
    Setting("app", "worker", t.text(_check_app, "a module or module:attribute").or_none(), None,
            "The task module to import: `module` or `module:attribute` naming a workhorse App.",
            cli=("-A",), reload=False),
    Setting("queues", "worker", t.queue_list(), (t.QueueName("celery"),),
            "Queues to consume. Tasks sent without a queue go to the first one. On RabbitMQ "
            "a name may carry the type its queue is declared with: payments:quorum (else "
            "queue_type).", cli=("-Q",), reload=False),
    Setting("concurrency", "worker", t.integer(1, 1024), lambda _: os.cpu_count() or 1,
            "Number of child processes, each running one task at a time.",
            default_doc="number of CPUs", cli=("-c",)),
    Setting("autoscale", "worker", t.pool_bounds(1, 1024).or_none(), None,
            "Size the pool on the backlog, between these two sizes (\"2,8\"; Celery's "
            "--autoscale 8,2 order is read the same): concurrency is the size it starts at "
            "(brought within them); it grows by one child a second while the oldest ready "
            "message is older than autoscale_target_age, and retires one idle child a second "
            "once, for autoscale_idle, no message waited longer and some child was idle at "
            "every look. None: a fixed pool.",
            reload=False),
    Setting("autoscale_target_age", "worker", t.seconds(positive=True), 1.0,
            "With autoscale: the pool grows while the oldest ready message of the queues "
            "consumed is older than this; /scale's load counts the backlog against it.",
            reload=False),
    Setting("autoscale_idle", "worker", t.seconds(positive=True), 30.0,
            "With autoscale: the pool shrinks after this long with no message waiting past "
            "autoscale_target_age and some child idle at every look.",
            reload=False),
    Setting("prefetch_multiplier", "worker", t.integer(1, 1000), 4,
            "The supervisor holds at most concurrency × prefetch_multiplier buffered and running "
            "messages; 1 fetches only what can start now. A larger window lets each take "
            "(SQLite, Redis) bring more messages in one step, which makes short tasks cheaper "
            "to hand out, and holds more of them back from other workers on the queue."),
    Setting("async_concurrency", "worker", t.integer(1, 100000), 100,
            "How many async def tasks one child runs at once, on its event loop (a task's own "
            "async_concurrency option can lower it for that task). A child runs either one "
            "sync task or up to this many async ones, never both. The supervisor holds at "
            "most concurrency × async_concurrency × prefetch_multiplier async messages."),
    Setting("loop_block_limit", "worker", t.seconds(positive=True), 10.0,
            "A child running async tasks whose event loop does not turn for this many "
            "seconds (a task called time.sleep, a C call or a busy loop) is killed: the task "
            "that blocked it is charged a delivery, its siblings go back to their queues "
            "uncharged."),
    Setting("max_tasks_per_child", "worker", t.integer(1).or_none(), None,
            "Replace a child after it has run this many tasks (none: never)."),
    Setting("max_memory_per_child", "worker", t.memory_size().or_none(), None,
            "Replace a child whose resident memory exceeds this after a task (none: never). "
            "A bare integer is KiB, as in Celery."),
    Setting("max_boot_failures", "worker", t.integer(1), 5,
            "Stop the worker with exit status 4 when this many children of one slot in a row "
            "die before they are ready (code run in each new child fails); what it holds is "
            "requeued. A child that dies after it was ready is replaced with back-off instead."),
    Setting("max_scheduled", "worker", t.integer(1), 10000,
            "At most this many scheduled (ETA/countdown) messages wait in the worker; beyond "
            "it, further ones go back to their queue (not counted as deliveries)."),
    Setting("graceful_timeout", "worker", t.seconds(positive=False), 60.0,
            "How long a warm shutdown waits for running tasks before killing them."),
    Setting("loglevel", "worker", t.choice("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
            "INFO", "Log level of the supervisor and its children.", cli=("-l",)),
    Setting("log_format", "worker", t.choice("text", "json"), "text",
            "How log records are written: text lines, or one JSON object per line. Under "
            "systemd each line also starts with its syslog priority and keeps a traceback "
            "in one record.", reload=False),
    Setting("logfile", "worker", t.path("a file path").or_none(), None,
            "Write the log to this file instead of stderr (none). Reopened after logrotate "
            "moves it: on SIGUSR2, and by every process within a second anyway.",
            cli=("-f",), reload=False),
    Setting("pidfile", "worker", t.path("a file path").or_none(), None,
            "Write the supervisor's pid to this file while it runs (none: no file). A "
            "worker refuses to start while the pid in it is another live workhorse.",
            reload=False),
    Setting("hostname", "worker", t.text(), lambda _: "workhorse@" + socket.gethostname(),
            "This worker's name in logs and in results.", default_doc="workhorse@<host name>",
            cli=("-n",), reload=False),
    Setting("schedules", "worker", t.boolean(), True,
            "Send the periodic tasks of the [[schedule]] entries (and of a Celery app's "
            "beat_schedule) when they are due; false: this worker never sends them. Any "
            "number of workers may: each due time is sent once."),
    Setting("remote_control", "worker", t.boolean(), True,
            "Answer Celery's broadcast mailbox (celery inspect, workhorse inspect, Flower) on "
            "a broker connection of its own.", reload=False),
    Setting("send_events", "worker", t.boolean(), False,
            "Send task events (task-received, -started, -succeeded, -failed, -retried, "
            "-rejected, -revoked) to Celery's event stream, for celery events and Flower, as "
            "celery worker -E. Remote control's enable_events/disable_events switch them "
            "until the worker stops.", cli=("-E", "--send-events"), reload=False),
    Setting("metrics_port", "worker", t.integer(0, 65535), 0,
            "Serve Prometheus metrics at /metrics, and the backlog for autoscalers at "
            "/scale, on this TCP port (0: off). See docs/operating.md, 'Metrics' and "
            "'Backlog and autoscaling'.", reload=False),
    Setting("metrics_bind", "worker", t.text(None, "an address to listen on"), "127.0.0.1",
            "The address the metrics endpoint listens on (0.0.0.0 or :: for every "
            "interface).", reload=False),
    Setting("heartbeat_events", "worker", t.boolean(), True,
            "Send worker-online, worker-heartbeat (every 2 s) and worker-offline events, as "
            "Celery's worker does; false is celery worker --without-heartbeat.",
            reload=False),
    Setting("state_dir", "worker", t.path(), _default_state_dir,
            "Where the embedded broker and result store live by default.",
            default_doc="$STATE_DIRECTORY (set by systemd), else $XDG_STATE_HOME/workhorse, "
                        "else ~/.local/state/workhorse", reload=False),
    # [broker]
    Setting("broker_url", "broker", t.text(_check_broker_url, "a broker URL"),
            lambda r: f"sqlite:///{r['state_dir'] / 'broker.sqlite3'}",
            "The message broker: sqlite:///<path> (embedded), redis:// (or valkey://), "
            "amqp://. For a cluster, several URLs of one scheme separated by ';' "
            "(amqp://h1//;amqp://h2//): each (re)connect tries them in that order; for Redis "
            "Sentinel, the sentinels: sentinel://h1:26379;sentinel://h2:26379?master_name=m.",
            default_doc="sqlite:///<state_dir>/broker.sqlite3", cli=("-b",), reload=False),
    Setting("visibility_timeout", "broker", t.seconds(positive=True), 30.0,
            "How long a message taken but not acknowledged stays leased (SQLite, Redis) before "
            "the broker hands it out again. A live worker renews the leases of everything it "
            "holds every visibility_timeout/4 s, so this bounds only how long a dead worker's "
            "messages wait. Workers sharing a broker should use the same value.", reload=False),
    Setting("celery_visibility_timeout", "broker", t.seconds(positive=True), 3600.0,
            "Redis: how long a message held by a consumer that is not a workhorse worker (a "
            "Celery worker on the same database, whose leases nothing renews) stays leased "
            "before a workhorse worker's sweep puts it back: set it to the Celery workers' "
            "visibility_timeout (Celery's default: 3600), so that their long tasks are not run "
            "twice. Each such message is logged once as it passes visibility_timeout.",
            reload=False),
    Setting("broker_connection_retry_on_startup", "broker", t.boolean(), True,
            "Keep trying, with back-off, when the broker cannot be reached at start (the "
            "worker is up meanwhile: signals, children, watchdog); false: exit with status 1 "
            "at the first failure.", reload=False),
    Setting("broker_connection_max_retries", "broker", t.integer(0).or_none(), None,
            "Give up (exit with status 1) after this many failed attempts in a row to "
            "connect or reconnect to the broker; none: never give up.", reload=False),
    Setting("broker_heartbeat", "broker", t.integer(0, 65535), 30,
            "RabbitMQ: the heartbeat timeout, in whole seconds (AMQP carries no fraction), "
            "the worker asks for on the connection it consumes on; where RabbitMQ has one "
            "of its own (60 s by default) the lower of the two is used. RabbitMQ closes the "
            "connection of a worker silent about that long (frozen, cut off) and gives its "
            "messages to other workers; a worker whose broker is silent twice that long "
            "reconnects. 0: no heartbeats; a silent worker's messages then stay with it "
            "until TCP gives up.",
            reload=False),
    Setting("broker_transport_options", "broker", t.table(), {},
            "Options for the broker's kombu transport, as Celery's setting of that name: "
            "master_name for a sentinel:// list (or ?master_name= at the list's end), "
            "sentinel_kwargs (e.g. the sentinels' own password). workhorse's own settings "
            "win where they overlap (visibility_timeout).", reload=False),
    Setting("queue_type", "broker", t.choice(*t.QUEUE_TYPES), "classic",
            "RabbitMQ: the type the worker declares its task queues (and their .dead queues) "
            "with when they do not exist: classic, or quorum (replicated across a cluster's "
            "nodes). A queue that exists is used as it is; one whose type differs is named in "
            "the log. Remote-control and event queues are always classic. A Celery app run "
            "with -A brings its own (task_default_queue_type, x-queue-type in task_queues) "
            "unless this is set.", reload=False),
    Setting("rabbitmq_consumer_timeout", "broker", t.seconds(positive=True), 1800.0,
            "RabbitMQ's consumer_timeout (its default: 30 minutes). A scheduled (ETA) message "
            "held for half of it is handed back to its queue as a fresh copy, so RabbitMQ "
            "never closes the channel over it. Running tasks must finish within it.", reload=False),
    # [results]
    Setting("result_backend", "results", t.text(_check_backend, "a result store URL"),
            lambda r: f"sqlite:///{r['state_dir'] / 'results.sqlite3'}",
            "Where results are stored: sqlite:///<path>, redis://, rediss:// (or valkey://, "
            "valkeys://), a Redis Sentinel list (sentinel://h1:26379;sentinel://h2:26379"
            "?master_name=m), db+ and a SQLAlchemy URL (Celery's database store, "
            "db+postgresql://user@host/db: pip install 'workhorse[sql]'), rpc:// (each "
            "state sent to the sender's reply queue, as Celery's RPC store), disabled, or a "
            "Backend class path.", default_doc="sqlite:///<state_dir>/results.sqlite3",
            reload=False),
    Setting("result_backend_transport_options", "results", t.table(), {},
            "Options for a Redis result store, as Celery's setting of that name: "
            "master_name for a sentinel:// list (or ?master_name= at the list's end), "
            "sentinel_kwargs.", reload=False),
    Setting("result_expires", "results", t.seconds(positive=False).or_none(), 86400.0,
            "Seconds a stored result is kept (0 or none: forever)."),
    Setting("result_extended", "results", t.boolean(), False,
            "Also store the task's name, args, kwargs, worker, retries and queue with its "
            "result (Celery's result_extended)."),
    Setting("result_backend_always_retry", "results", t.boolean(), True,
            "Retry storing and reading results through errors the store calls transient "
            "(lost connection, busy database), with exponential back-off and jitter."),
    Setting("result_backend_max_retries", "results", t.integer(0), 20,
            "How many such retries before giving up (the task's message is then requeued, "
            "not acked without a result)."),
    Setting("result_backend_base_sleep_between_retries_ms", "results", t.integer(1), 10,
            "The first back-off between result store retries, in milliseconds; it doubles."),
    Setting("result_backend_max_sleep_between_retries_ms", "results", t.integer(1), 10000,
            "The longest back-off between result store retries, in milliseconds."),
    # [tasks]
    Setting("acks_late", "tasks", t.boolean(), True,
            "Acknowledge a message after its outcome is final and stored (at-least-once); "
            "false: when a child starts it (at-most-once)."),
    Setting("reject_on_worker_lost", "tasks", t.boolean(), True,
            "With acks_late, requeue a task whose child died (counted toward max_deliveries); "
            "false: dead-letter it with FAILURE(WorkerLostError)."),
    Setting("acks_on_failure", "tasks", t.boolean(), True,
            "With acks_late, acknowledge a task that raised; false: dead-letter it."),
    Setting("acks_on_timeout", "tasks", t.boolean(), True,
            "With acks_late, acknowledge a task killed by its hard time limit; false: requeue "
            "it (counted)."),
    Setting("max_deliveries", "tasks", t.integer(1, 1000), 3,
            "A message is delivered at most this many times, counting each delivery that may "
            "have started and ended in a loss (its child, or its worker, died while it ran; a "
            "requeued Reject or hard time limit); past that it is dead-lettered before running."),
    Setting("max_held_losses", "tasks", t.integer(20, 100000), 20,
            "A message only held (buffered or scheduled, never started) by workers that died "
            "this many times is dead-lettered without being looked at again: the backstop for "
            "one that kills its supervisor before it starts (while it is read or waits). Such "
            "losses never count toward max_deliveries. At least 20: a message that comes back "
            "sits in the next worker's window, and may be held at every one of many deaths in "
            "a row that it did not cause."),
    Setting("soft_time_limit", "tasks", t.seconds(positive=True).or_none(), None,
            "Seconds after which SoftTimeLimitExceeded is raised inside the task."),
    Setting("time_limit", "tasks", t.seconds(positive=True).or_none(), None,
            "Seconds after which the child and everything it started is killed."),
    Setting("track_started", "tasks", t.boolean(), False,
            "Store the STARTED state when a task starts."),
    Setting("max_retries", "tasks", t.integer(0).or_none(), 3,
            "How many times self.retry() and autoretry may retry a task (none: no limit). "
            "A task's own max_retries, and retry(max_retries=...), take precedence."),
    Setting("default_retry_delay", "tasks", t.seconds(positive=False), 180.0,
            "Seconds before a retry when neither countdown nor eta is given and there is no "
            "back-off."),
    Setting("retry_backoff", "tasks", t.boolean_or_integer(1), False,
            "Autoretry with exponential back-off: true (base 1 s) or a base in seconds; the "
            "n-th retry waits base × 2^(n-1), at most retry_backoff_max."),
    Setting("retry_backoff_max", "tasks", t.seconds(positive=False), 600.0,
            "The longest back-off between automatic retries, in seconds."),
    Setting("retry_jitter", "tasks", t.boolean(), True,
            "Draw each back-off uniformly from [0, the computed delay], so retries spread out."),
)

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
