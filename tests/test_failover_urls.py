"""A broker URL's failover form (``amqp://h1//;amqp://h2//``): checked, shown without
passwords, and tried in order by every connection the worker makes (broker, remote
control, events), keeping workhorse's own transport on every host (pure); then a real
worker whose first URL is a dead port (RabbitMQ)."""
from __future__ import annotations

import socket
import uuid

import pytest

from workhorse import App
from workhorse.config import ConfigError, load_settings
from workhorse.transport import RABBITMQ
from workhorse.broker.connection import FailoverConnection
from workhorse.urls import alternatives, redact

from .conftest import AMQP_URL, BrokerEnv, require_service, wait_until
from .test_remote_control import celery_app

pytestmark = pytest.mark.timeout(120)


def test_a_failover_list_is_split_and_shown_without_passwords():
    url = "amqp://u:secret@h1:5672//; amqp://u:secret@h2:5672//;"
    assert alternatives(url) == ["amqp://u:secret@h1:5672//", "amqp://u:secret@h2:5672//"]
    assert redact(url) == "amqp://u:***@h1:5672//;amqp://u:***@h2:5672//"
    assert alternatives("redis://h/0") == ["redis://h/0"]


@pytest.mark.parametrize(("url", "error"), [
    ("amqp://h1//;redis://h2/0", "share one scheme, not amqp, redis"),
    ("sqlite:///a.db;sqlite:///b.db", "a list of URLs (url;url) is not for sqlite"),
    ("amqp://h1//;kafka://u:pw@h2", "expected a URL with scheme"),
])
def test_a_bad_failover_list_is_refused_naming_the_problem(url, error):
    with pytest.raises(ConfigError) as raised:
        load_settings(code={"broker_url": url}, env={})
    assert error in str(raised.value) and "broker_url" in str(raised.value)
    assert "pw" not in str(raised.value)


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_switching_to_the_next_url_keeps_workhorses_transport():
    app = App("t", broker_url="amqp://h1//;amqp://u:p@h2:5673/v", result_backend="disabled")
    connection = app.connection()
    assert isinstance(connection, FailoverConnection)
    assert connection.transport_cls == RABBITMQ
    connection.maybe_switch_next()
    assert (connection.hostname, connection.port, connection.userid) == ("h2", 5673, "u")
    assert connection.transport_cls == RABBITMQ     # kombu's switch() would say "amqp"
    assert connection.retries(1) == 1 and connection.retries(2) == 3
    single = App("t", broker_url="amqp://h1//", result_backend="disabled").connection()
    assert single.retries(1) == 0 and single.retries(2) == 1


def test_a_worker_whose_first_url_is_dead_runs_tasks_and_answers_on_the_next(
        start_worker, tmp_path):
    require_service("RabbitMQ", 5672)
    dead = AMQP_URL.replace("127.0.0.1:5672", f"127.0.0.1:{_dead_port()}")
    assert dead != AMQP_URL
    broker = BrokerEnv("amqp", f"{dead};{AMQP_URL}", f"t-{uuid.uuid4().hex[:10]}")
    hostname = f"fo-{uuid.uuid4().hex[:8]}@test"
    worker = start_worker(broker, hostname=hostname, send_events=True)
    worker.wait_for_log(r"broker: connected to 127\.0\.0\.1:5672")   # said as it gets ready
    client = App("client", broker_url=broker.url, queues=[broker.queue],
                 result_backend=f"sqlite:///{tmp_path / 'results.sqlite3'}")
    celery = celery_app(BrokerEnv("amqp", AMQP_URL, broker.queue))
    try:
        assert client.send_task("tests.apps.basic.add", (2, 3)).get(timeout=30) == 5
        inspect = celery.control.inspect(destination=[hostname], timeout=10)
        wait_until(lambda: inspect.ping() == {hostname: {"ok": "pong"}}, 30,
                   "an answer to ping over the second URL")
        assert "unreachable" not in worker.log()    # a dead first URL is not an outage
    finally:
        client.close()
        celery.close()
        with BrokerEnv("amqp", AMQP_URL, broker.queue).connection() as conn:
            conn.default_channel.queue_delete(broker.queue)
