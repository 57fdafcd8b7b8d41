"""The systemd unit: Type=notify (ready, watchdog, stopping) and its restart policy."""
from __future__ import annotations

import configparser
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from workhorse.daemon.exitcodes import ExitCode

from .conftest import ROOT, Worker, make_broker, wait_until, worker_env


class NotifySocket:
    """A datagram socket in the place of systemd's: what the worker notifies."""

    def __init__(self, tmp_path: Path) -> None:
        self.address = str(tmp_path / "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.address)
        self.sock.settimeout(0.2)
        self.received: list[str] = []

    def got(self, text: str) -> bool:
        """Has a notification containing ``text`` come (reading one more, if any)?"""
        try:
            self.received.append(self.sock.recv(4096).decode())
        except TimeoutError:
            pass
        return any(text in r for r in self.received)

    def close(self) -> None:
        self.sock.close()


def test_ready_watchdog_and_stopping_are_notified(tmp_path):
    broker = make_broker("sqlite", tmp_path)
    notify = NotifySocket(tmp_path)
    env = worker_env(broker, tmp_path)
    env.update(NOTIFY_SOCKET=notify.address, WATCHDOG_USEC="400000")   # ping every 0.2 s
    worker = Worker(tmp_path, env, ["-A", "tests.apps.basic"])
    got, received = notify.got, notify.received
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
        notify.close()


@pytest.mark.parametrize("broker", ["sqlite"], indirect=True)
def test_a_warm_shutdown_says_how_it_goes_and_asks_for_more_time(broker, client, tmp_path):
    notify = NotifySocket(tmp_path)
    env = worker_env(broker, tmp_path)
    env.update(NOTIFY_SOCKET=notify.address, WORKHORSE_GRACEFUL_TIMEOUT="60")
    worker = Worker(tmp_path, env, ["-A", "tests.apps.basic"])
    got, received = notify.got, notify.received
    gate = tmp_path / "gate"
    try:
        wait_until(lambda: got("READY=1"), 30, "READY=1")
        running = client.send_task("tests.apps.basic.gate", (str(gate), "done"))
        wait_until(lambda: "gate" in (tmp_path / "runs.log").read_text()
                   if (tmp_path / "runs.log").exists() else False, 30, "the task to start")
        worker.signal(signal.SIGTERM)
        wait_until(lambda: got("STATUS=warm shutdown: 1 running; killed in"), 20,
                   "the shutdown's progress")
        [status] = [r for r in received if "STATUS=warm shutdown" in r][:1]
        assert "EXTEND_TIMEOUT_USEC=15000000" in status
        gate.touch()
        assert running.get(timeout=30) == "done"
        assert worker.wait_exit(30) == 0
    finally:
        gate.touch()
        worker.kill()
        notify.close()


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


#: The unit files, and the name each is analysed under (the template as an instance).
UNITS = {"workhorse.service": "workhorse.service",
         "workhorse@.service": "workhorse@emails.service"}


def _unit_for_analysis(tmp_path, name):
    """The unit file with ExecStart pointing at this environment's workhorse script (verify
    checks that it exists)."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed here")
    script = Path(sys.executable).parent / "workhorse"
    if not script.exists():
        pytest.skip(f"no workhorse script beside {sys.executable}")
    unit = tmp_path / UNITS[name]
    unit.write_text((ROOT / "systemd" / name).read_text()
                    .replace("/usr/local/bin/workhorse", str(script)))
    return unit


def test_the_template_is_the_unit_but_for_each_instances_name_state_and_settings():
    unit = (ROOT / "systemd" / "workhorse.service").read_text().split("[Unit]", 1)[1]
    template = (ROOT / "systemd" / "workhorse@.service").read_text().split("[Unit]", 1)[1]
    only_unit = [line for line in unit.splitlines() if line not in template.splitlines()]
    only_template = [line for line in template.splitlines() if line not in unit.splitlines()]
    assert only_unit == [
        "Description=workhorse task worker", "StateDirectory=workhorse",
        "WorkingDirectory=/var/lib/workhorse",
        "ExecStartPre=/usr/local/bin/workhorse config --check --config "
        "/etc/workhorse/workhorse.toml",
        "ExecStart=/usr/local/bin/workhorse worker --config /etc/workhorse/workhorse.toml"]
    assert only_template == [
        "Description=workhorse task worker %i", "StateDirectory=workhorse/%i",
        "WorkingDirectory=/var/lib/workhorse/%i", "EnvironmentFile=-/etc/workhorse/%i.env",
        "ExecStartPre=/usr/local/bin/workhorse config --check --config "
        "/etc/workhorse/workhorse.toml -n %i@%H",
        "ExecStart=/usr/local/bin/workhorse worker --config /etc/workhorse/workhorse.toml "
        "-n %i@%H"]


@pytest.mark.parametrize("name", sorted(UNITS))
def test_the_unit_file_verifies(tmp_path, name):
    unit = _unit_for_analysis(tmp_path, name)
    result = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                            text=True, timeout=60)
    # systemd before 254 does not know the restart back-off keys (the unit says so).
    problems = [line for line in (result.stdout + result.stderr).splitlines()
                if line and "RestartSteps" not in line and "RestartMaxDelaySec" not in line]
    assert result.returncode == 0 and not problems, problems


@pytest.mark.parametrize("name", sorted(UNITS))
def test_the_unit_file_is_hardened(tmp_path, name):
    """systemd-analyze security's exposure (0 safest, 10 worst) at most 2.0."""
    unit = _unit_for_analysis(tmp_path, name)
    result = subprocess.run(["systemd-analyze", "security", "--offline=true", str(unit)],
                            capture_output=True, text=True, timeout=60)
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout)
    assert found, result.stdout + result.stderr
    assert float(found.group(1)) <= 2.0, result.stdout
