"""The systemd unit: Type=notify (ready, watchdog, stopping) and its restart policy."""
from __future__ import annotations

import configparser
import signal
import socket

from workhorse.daemon.exitcodes import ExitCode

from .conftest import ROOT, Worker, make_broker, wait_until, worker_env


def test_ready_watchdog_and_stopping_are_notified(tmp_path):
    broker = make_broker("sqlite", tmp_path)
    address = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(0.2)
    env = worker_env(broker, tmp_path)
    env.update(NOTIFY_SOCKET=address, WATCHDOG_USEC="400000")   # ping every 0.2 s
    worker = Worker(tmp_path, env, ["-A", "tests.apps.basic"])
    received: list[str] = []

    def got(text: str) -> bool:
        try:
            received.append(sock.recv(4096).decode())
        except TimeoutError:
            pass
        return any(text in r for r in received)
    try:
        wait_until(lambda: got("READY=1"), 30, "READY=1")
        count = sum("WATCHDOG=1" in r for r in received)
        wait_until(lambda: got("WATCHDOG=1") and sum("WATCHDOG=1" in r for r in received)
                   >= count + 2, 10, "two watchdog pings")
        worker.signal(signal.SIGTERM)
        wait_until(lambda: got("STOPPING=1"), 10, "STOPPING=1")
        assert worker.wait_exit(30) == 0
    finally:
        worker.kill()
        sock.close()


def test_the_unit_restarts_with_a_growing_delay_except_after_config_and_import_errors():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str    # type: ignore[assignment,method-assign]
    unit.read(ROOT / "systemd" / "workhorse.service")
    service = unit["Service"]
    assert service["Restart"] == "on-failure"
    prevented = {int(code) for code in service["RestartPreventExitStatus"].split()}
    assert prevented == {ExitCode.CONFIG, ExitCode.APP_IMPORT}
    assert ExitCode.CHILD_BOOT not in prevented and ExitCode.FAILURE not in prevented
    assert int(service["RestartSec"]) < int(service["RestartMaxDelaySec"])
    assert int(service["RestartSteps"]) > 0
    assert unit["Unit"]["StartLimitIntervalSec"] == "0"     # never gives up
