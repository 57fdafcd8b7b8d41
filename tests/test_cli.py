"""The command line: exit statuses and messages an operator reads."""
from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from .conftest import ROOT

pytestmark = pytest.mark.timeout(60)


def run(*args: str, env: dict[str, str] | None = None,
        cwd: Path = ROOT) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("WORKHORSE_")}
    base["PYTHONPATH"] = str(ROOT)
    base.update(env or {})
    return subprocess.run([sys.executable, "-m", "workhorse", *args], env=base, cwd=cwd,
                          capture_output=True, text=True, timeout=50)


def test_a_module_that_does_not_import_is_exit_3(tmp_path):
    result = run("worker", "-A", "tests.apps.broken", env={"WORKHORSE_STATE_DIR": str(tmp_path)})
    assert result.returncode == 3
    assert "cannot import task module 'tests.apps.broken': RuntimeError: this module is broken" \
        in result.stderr
    assert "Traceback" in result.stderr   # the operator sees where it broke


def test_a_task_option_of_the_wrong_type_stops_the_worker_with_exit_3(tmp_path):
    state = tmp_path / "state"
    result = run("worker", "-A", "tests.apps.bad_option", env={"WORKHORSE_STATE_DIR": str(state)})
    assert result.returncode == 3, result.stderr
    assert result.stderr.splitlines()[-1] == (
        "workhorse: cannot import task module 'tests.apps.bad_option': TaskOptionError: "
        "task tests.apps.bad_option.add: option max_deliveries: expected an integer from 1 to "
        "1000, got '3' (a str)")
    assert not state.exists()     # refused before anything started


def test_a_missing_module_is_exit_3(tmp_path):
    result = run("worker", "-A", "tests.apps.nope", env={"WORKHORSE_STATE_DIR": str(tmp_path)})
    assert result.returncode == 3
    assert "No module named 'tests.apps.nope'" in result.stderr


def test_an_attribute_that_is_not_an_app_is_exit_3(tmp_path):
    result = run("worker", "-A", "tests.apps.basic:add", env={"WORKHORSE_STATE_DIR": str(tmp_path)})
    assert result.returncode == 3
    assert "tests.apps.basic:add is Task, not a workhorse App" in result.stderr


def test_bad_config_is_exit_2_and_nothing_starts(tmp_path):
    config = tmp_path / "workhorse.toml"
    config.write_text("[worker]\nconcurrency = 'four'\n")
    state = tmp_path / "state"
    result = run("worker", "--config", str(config), "-A", "tests.apps.basic",
                 env={"WORKHORSE_STATE_DIR": str(state)})
    assert result.returncode == 2
    assert f"{config} [worker] concurrency = 'four': expected an integer from 1 to 1024" \
        in result.stderr
    assert not state.exists()


def test_no_app_is_exit_2(tmp_path):
    result = run("worker", env={"WORKHORSE_STATE_DIR": str(tmp_path)})
    assert result.returncode == 2 and "-A module" in result.stderr


def test_bad_flag_is_exit_2():
    result = run("worker", "--concurrency", "0")
    assert result.returncode == 2
    assert "cli --concurrency = '0': expected an integer from 1 to 1024" in result.stderr


def test_config_prints_effective_settings_with_sources(tmp_path):
    config = tmp_path / "workhorse.toml"
    config.write_text("[worker]\nconcurrency = 3\n")
    result = run("config", "--config", str(config), "--prefetch-multiplier", "2",
                 env={"WORKHORSE_HOSTNAME": "h1", "WORKHORSE_STATE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert f"concurrency = 3  # {config} [worker]" in result.stdout
    assert "prefetch_multiplier = 2  # cli --prefetch-multiplier" in result.stdout
    assert 'hostname = "h1"  # env WORKHORSE_HOSTNAME' in result.stdout
    assert tomllib.loads(result.stdout)["worker"]["concurrency"] == 3


def test_config_hides_passwords_in_urls(tmp_path):
    result = run("config", "--broker-url", "amqp://ops:s3cret@rabbit:5672//",
                 "--result-backend", "redis://:hunter2@cache:6379/1",
                 env={"WORKHORSE_STATE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "s3cret" not in result.stdout and "hunter2" not in result.stdout
    settings = tomllib.loads(result.stdout)
    assert settings["broker"]["broker_url"] == "amqp://ops:***@rabbit:5672//"
    assert settings["results"]["result_backend"] == "redis://:***@cache:6379/1"


def test_config_includes_the_apps_own_keywords(tmp_path):
    result = run("config", "-A", "tests.apps.keywords", env={"WORKHORSE_STATE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert "max_deliveries = 5  # App(...) keyword" in result.stdout


def test_config_check_is_quiet_when_valid_and_exit_2_when_not(tmp_path):
    good = tmp_path / "good.ini"
    good.write_text("[tasks]\nacks_late = false\n")
    result = run("config", "--check", "--config", str(good))
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    bad = tmp_path / "bad.ini"
    bad.write_text("[tasks]\ntime_limit = 5\nsoft_time_limit = 10\n")
    result = run("config", "--check", "--config", str(bad))
    assert result.returncode == 2
    assert "time_limit (5) must be greater than soft_time_limit (10)" in result.stderr


def test_version():
    from workhorse import __version__
    result = run("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"workhorse {__version__}"
