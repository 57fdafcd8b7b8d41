"""Configuration: declarations, every source, the precedence rule, and precise errors."""
from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

import pytest

from workhorse.config import (
    SECTIONS,
    SETTINGS,
    ConfigError,
    add_setting_arguments,
    cli_values,
    load_settings,
    render_settings,
)
from workhorse.config import reference
from workhorse.config.settings import BY_NAME

ENV: dict[str, str] = {}   # an empty environment unless a test says otherwise


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def parse_cli(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_setting_arguments(parser)
    return cli_values(parser.parse_args(list(argv)))


# ---------------------------------------------------------------- every setting
# A sample value per setting, as text, and what it parses to.
SAMPLES = {
    "app": ("proj.tasks:app", "proj.tasks:app"),
    "queues": ("a,b", ("a", "b")),
    "concurrency": ("3", 3),
    "prefetch_multiplier": ("2", 2),
    "async_concurrency": ("500", 500),
    "loop_block_limit": ("2.5", 2.5),
    "max_tasks_per_child": ("100", 100),
    "max_memory_per_child": ("200MiB", 200 * 1024 * 1024),
    "graceful_timeout": ("5.5", 5.5),
    "max_boot_failures": ("3", 3),
    "max_scheduled": ("50", 50),
    "rabbitmq_consumer_timeout": ("600", 600.0),
    "broker_connection_retry_on_startup": ("false", False),
    "broker_connection_max_retries": ("5", 5),
    "broker_heartbeat": ("0", 0),
    "loglevel": ("debug", "DEBUG"),
    "hostname": ("w1@host", "w1@host"),
    "state_dir": ("/var/lib/wh", Path("/var/lib/wh")),
    "broker_url": ("redis://localhost:6379/0", "redis://localhost:6379/0"),
    "visibility_timeout": ("45", 45.0),
    "celery_visibility_timeout": ("7200", 7200.0),
    "result_backend": ("redis://localhost/1", "redis://localhost/1"),
    "broker_transport_options": ('{"master_name": "m"}', {"master_name": "m"}),
    "result_backend_transport_options": ('{"master_name": "m", "sentinel_kwargs": {}}',
                                         {"master_name": "m", "sentinel_kwargs": {}}),
    "result_expires": ("60", 60.0),
    "acks_late": ("false", False),
    "remote_control": ("off", False),
    "schedules": ("false", False),
    "send_events": ("yes", True),
    "heartbeat_events": ("0", False),
    "metrics_port": ("9808", 9808),
    "autoscale": ("10,3", (3, 10)),
    "autoscale_target_age": ("2.5", 2.5),
    "autoscale_idle": ("60", 60.0),
    "metrics_bind": ("0.0.0.0", "0.0.0.0"),
    "log_format": ("JSON", "json"),
    "logfile": ("/var/log/w.log", Path("/var/log/w.log")),
    "pidfile": ("/run/w.pid", Path("/run/w.pid")),
    "reject_on_worker_lost": ("no", False),
    "acks_on_failure": ("off", False),
    "acks_on_timeout": ("0", False),
    "max_deliveries": ("7", 7),
    "max_held_losses": ("25", 25),
    "queue_type": ("Quorum", "quorum"),
    "soft_time_limit": ("10", 10.0),
    "time_limit": ("20", 20.0),
    "track_started": ("yes", True),
    "max_retries": ("5", 5),
    "default_retry_delay": ("2.5", 2.5),
    "retry_backoff": ("3", 3),
    "retry_backoff_max": ("60", 60.0),
    "retry_jitter": ("no", False),
    "result_extended": ("true", True),
    "result_backend_always_retry": ("false", False),
    "result_backend_max_retries": ("4", 4),
    "result_backend_base_sleep_between_retries_ms": ("5", 5),
    "result_backend_max_sleep_between_retries_ms": ("500", 500),
}


def test_every_setting_has_a_sample():
    assert set(SAMPLES) == set(BY_NAME)


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
def test_every_setting_is_fully_declared(setting):
    assert setting.section in SECTIONS
    assert setting.help.strip() and setting.type.accepted
    assert setting.env == "WORKHORSE_" + setting.name.upper()
    assert setting.flag == "--" + setting.name.replace("_", "-")
    if callable(setting.default):
        assert setting.default_doc, "a computed default needs default_doc for --help and docs"


def test_every_default_passes_its_own_validator():
    settings = load_settings(env=ENV)
    for setting, value, source in settings:
        assert source.startswith("default")
        assert setting.type.parse(value if not isinstance(value, Path) else str(value)) == value


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_every_setting_round_trips_through_each_source(name, tmp_path):
    setting = BY_NAME[name]
    text, expected = SAMPLES[name]
    toml_value = {"false": "false", "no": "false", "off": "false", "0": "false",
                  "yes": "true"}.get(text) if setting.type.toml_name == "boolean" else None
    if toml_value is None:
        toml_value = text if setting.type.toml_name in ("integer", "float", "boolean or integer") \
            else f'"{text}"'
    if name == "max_memory_per_child":
        toml_value = f'"{text}"'
    if setting.type.toml_name == "table":
        toml_value = f"'{text}'"            # (JSON text; a TOML table is tested apart)
    toml = write(tmp_path / "w.toml", f"[{setting.section}]\n{name} = {toml_value}\n")
    ini = write(tmp_path / "w.ini", f"[{setting.section}]\n{name} = {text}\n")
    flag_args = ([f"--{'' if expected else 'no-'}{name.replace('_', '-')}"]
                 if setting.type.toml_name == "boolean" else [setting.flag, text])
    loaded = {
        "toml": load_settings(config_file=toml, env=ENV),
        "ini": load_settings(config_file=ini, env=ENV),
        "env": load_settings(env={setting.env: text}),
        "cli": load_settings(env=ENV, cli=parse_cli(*flag_args)),
    }
    for where, settings in loaded.items():
        assert settings[name] == expected, where
    assert loaded["toml"].source(name) == f"{toml} [{setting.section}]"
    assert loaded["env"].source(name) == f"env {setting.env}"
    assert loaded["cli"].source(name) == f"cli {setting.flag}"


# ---------------------------------------------------------------- precedence
def test_precedence_defaults_code_files_dropins_env_cli(tmp_path):
    main = write(tmp_path / "etc" / "workhorse.toml",
                 "[worker]\nconcurrency = 3\nhostname = 'file'\n"
                 "prefetch_multiplier = 5\nmax_tasks_per_child = 9\n")
    write(tmp_path / "etc" / "workhorse.d" / "20-b.ini", "[worker]\nprefetch_multiplier = 7\n")
    write(tmp_path / "etc" / "workhorse.d" / "10-a.toml",
          "[worker]\nprefetch_multiplier = 6\nhostname = 'dropin'\n")
    write(tmp_path / "etc" / "workhorse.d" / "ignored.txt", "not a config file")
    settings = load_settings(
        config_file=main,
        code={"concurrency": 2, "graceful_timeout": 5, "max_tasks_per_child": 1,
              "loglevel": "debug"},
        env={"WORKHORSE_HOSTNAME": "env", "WORKHORSE_LOGLEVEL": "error"},
        cli={"loglevel": "warning"})
    assert settings.graceful_timeout == 5.0
    assert settings.source("graceful_timeout") == "App(...) keyword"
    assert settings.concurrency == 3                      # file beats code
    assert settings.max_tasks_per_child == 9
    assert settings.prefetch_multiplier == 7              # 20-b.ini read after 10-a.toml
    assert settings.source("prefetch_multiplier").endswith("20-b.ini [worker]")
    assert settings.hostname == "env"                     # env beats files
    assert settings.loglevel == "WARNING"                 # cli beats env
    assert [p.name for p in settings.config_files] == ["workhorse.toml", "10-a.toml", "20-b.ini"]


def test_config_file_from_env(tmp_path):
    path = write(tmp_path / "c.toml", "[worker]\nconcurrency = 5\n")
    assert load_settings(env={"WORKHORSE_CONFIG": str(path)}).concurrency == 5


def test_derived_defaults_follow_state_dir(tmp_path):
    settings = load_settings(env={"WORKHORSE_STATE_DIR": str(tmp_path)})
    assert settings.broker_url == f"sqlite:///{tmp_path}/broker.sqlite3"
    assert settings.result_backend == f"sqlite:///{tmp_path}/results.sqlite3"
    assert settings.source("broker_url") == "default (derived from state_dir)"


def test_state_dir_default_prefers_systemd(monkeypatch, tmp_path):
    monkeypatch.setenv("STATE_DIRECTORY", f"{tmp_path}/a:{tmp_path}/b")
    assert load_settings(env=ENV).state_dir == tmp_path / "a"
    monkeypatch.delenv("STATE_DIRECTORY")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert load_settings(env=ENV).state_dir == tmp_path / "xdg" / "workhorse"


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize("text, message", [
    ("[worker]\nconcurrency = 'four'\n",
     "{f} [worker] concurrency = 'four': expected an integer from 1 to 1024"),
    ("[worker]\nconcurrency = 4.0\n",
     "{f} [worker] concurrency = 4.0: expected an integer from 1 to 1024"),
    ("[worker]\nconcurrency = 0\n", "{f} [worker] concurrency = 0: expected an integer from 1"),
    ("[worker]\nconcurency = 4\n",
     "{f} [worker] concurency: unknown setting; did you mean 'concurrency'?"),
    ("[workers]\nconcurrency = 4\n", "{f} [workers]: unknown section; did you mean 'worker'?"),
    ("[tasks]\nconcurrency = 4\n",
     "{f} [tasks] concurrency: concurrency belongs in the [worker] section"),
    ("concurrency = 4\n", "{f}: concurrency = 4 is outside any [section]; put it under [worker]"),
    ("[tasks]\nacks_late = 'maybe'\n", "{f} [tasks] acks_late = 'maybe': expected true or false"),
    ("[broker]\nbroker_url = 'kafka://x'\n", "expected a URL with scheme sqlite, redis"),
    ("[results]\nresult_backend = 'db+'\n",
     "{f} [results] result_backend = 'db+': expected db+<SQLAlchemy URL>"),
    ("[results]\nresult_backend = 'mongodb://x'\n", "db+<SQLAlchemy URL>, rpc://"),
    ("[worker]\nqueues = ['a', '']\n", "none of them empty"),
    ("[worker\n", "{f}: not valid TOML"),
    ("[broker]\nbroker_heartbeat = 0.5\n",
     "{f} [broker] broker_heartbeat = 0.5: expected an integer from 0 to 65535"),
    ("[broker]\nbroker_heartbeat = 70000\n", "expected an integer from 0 to 65535"),
    ("[tasks]\ntime_limit = 20\nsoft_time_limit = 30\n",
     "time_limit (20) must be greater than soft_time_limit (30): time_limit from {f} [tasks], "
     "soft_time_limit from {f} [tasks]"),
])
def test_bad_toml_names_file_section_key_value_and_what_is_accepted(tmp_path, text, message):
    path = write(tmp_path / "workhorse.toml", text)
    with pytest.raises(ConfigError) as raised:
        load_settings(config_file=path, env=ENV)
    assert message.format(f=path) in str(raised.value)


@pytest.mark.parametrize("text, message", [
    ("[worker]\nconcurrency = lots\n", "{f} [worker] concurrency = 'lots': expected an integer"),
    ("[worker]\nconcurency = 4\n", "did you mean 'concurrency'"),
    ("concurrency = 4\n", "{f}: not valid INI"),
])
def test_bad_ini_is_reported_like_toml(tmp_path, text, message):
    path = write(tmp_path / "workhorse.ini", text)
    with pytest.raises(ConfigError) as raised:
        load_settings(config_file=path, env=ENV)
    assert message.format(f=path) in str(raised.value)


def test_bad_env_and_cli_values_name_the_variable_and_flag():
    with pytest.raises(ConfigError, match=r"env WORKHORSE_CONCURRENCY = 'x': expected an integer"):
        load_settings(env={"WORKHORSE_CONCURRENCY": "x"})
    with pytest.raises(ConfigError, match=r"env WORKHORSE_CONCURENCY: unknown setting; did you "
                                          r"mean 'WORKHORSE_CONCURRENCY'"):
        load_settings(env={"WORKHORSE_CONCURENCY": "2"})
    with pytest.raises(ConfigError, match=r"cli --prefetch-multiplier = '0': expected"):
        load_settings(env=ENV, cli=parse_cli("--prefetch-multiplier", "0"))
    with pytest.raises(ConfigError, match=r"App\(...\) keyword 'concurency'"):
        load_settings(env=ENV, code={"concurency": 2})


def test_soft_limit_not_below_hard_limit_across_sources(tmp_path):
    path = write(tmp_path / "w.toml", "[tasks]\ntime_limit = 20\n")
    with pytest.raises(ConfigError, match=r"time_limit \(20\) must be greater than soft_time_limit "
                                          r"\(30\): time_limit from .*w.toml \[tasks\], "
                                          r"soft_time_limit from env WORKHORSE_SOFT_TIME_LIMIT"):
        load_settings(config_file=path, env={"WORKHORSE_SOFT_TIME_LIMIT": "30"})


def test_missing_and_unknown_config_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(config_file=tmp_path / "nope.toml", env=ENV)
    with pytest.raises(ConfigError, match=r"from WORKHORSE_CONFIG\) does not exist"):
        load_settings(env={"WORKHORSE_CONFIG": str(tmp_path / "nope.toml")})
    yaml = write(tmp_path / "w.yaml", "worker: {}")
    with pytest.raises(ConfigError, match=r"unknown config file type '.yaml'; accepted: .toml"):
        load_settings(config_file=yaml, env=ENV)


@pytest.mark.parametrize("text, expected", [
    ("512", 512 * 1024), ("512KiB", 512 * 1024), ("200MB", 200_000_000), ("1GiB", 1024 ** 3),
    ("1.5G", 1_500_000_000), ("none", None),
])
def test_memory_sizes(text, expected):
    settings = load_settings(env={"WORKHORSE_MAX_MEMORY_PER_CHILD": text})
    assert settings.max_memory_per_child == expected


@pytest.mark.parametrize("text", ["-1", "lots", "12XB", "0", "1.5"])
def test_bad_memory_sizes(text):
    with pytest.raises(ConfigError, match="expected a memory size"):
        load_settings(env={"WORKHORSE_MAX_MEMORY_PER_CHILD": text})


def test_optional_values_are_unset_with_none(tmp_path):
    path = write(tmp_path / "w.toml",
                 "[tasks]\ntime_limit = \"none\"\n[results]\nresult_expires = 'None'\n")
    settings = load_settings(config_file=path, env=ENV)
    assert settings.time_limit is None and settings.result_expires is None


# ---------------------------------------------------------------- output and docs
def test_render_is_valid_toml_that_loads_back_to_the_same_settings(tmp_path):
    settings = load_settings(env={"WORKHORSE_QUEUES": "a,b", "WORKHORSE_TIME_LIMIT": "9",
                                  "WORKHORSE_MAX_MEMORY_PER_CHILD": "1MiB"})
    text = render_settings(settings)
    assert "# env WORKHORSE_QUEUES" in text
    assert tomllib.loads(text)["worker"]["queues"] == ["a", "b"]
    again = load_settings(config_file=write(tmp_path / "again.toml", text), env=ENV)
    assert again.as_dict() == settings.as_dict()


def test_help_shows_env_var_and_default():
    parser = argparse.ArgumentParser()
    add_setting_arguments(parser)
    text = parser.format_help()
    assert "WORKHORSE_CONCURRENCY" in text and "number of CPUs" in text
    assert "--no-acks-late" in text and "-A APP" in text


def test_settings_reference_is_up_to_date():
    current = reference.DOC_PATH.read_text() if reference.DOC_PATH.exists() else ""
    assert current == reference.render(), (
        "docs/settings.md is stale: run `python -m workhorse.config.reference --write`")


def test_a_queue_listed_with_a_type_is_declared_with_it_else_queue_type():
    from workhorse import App
    app = App("t", queues="default, payments:quorum, odd:name:classic", queue_type="classic",
              broker_url="memory://", result_backend="disabled")
    assert list(app.settings.queues) == ["default", "payments", "odd:name"]
    assert app.queue_type("payments") == "quorum"
    assert app.queue_type("payments.dead") == "quorum"       # its dead letters' too
    assert app.queue_type("default") == "classic"
    assert app.queue_type("odd:name") == "classic"


def test_a_celery_apps_queue_types_apply_unless_queue_type_is_set():
    from workhorse import App
    app = App("t", queues="a, b", broker_url="memory://", result_backend="disabled")
    app.celery_default_queue_type, app.celery_queue_types = "quorum", {"b": "classic"}
    assert (app.queue_type("a"), app.queue_type("b")) == ("quorum", "classic")
    set_explicitly = App("t", queues="a, b", queue_type="classic", broker_url="memory://",
                         result_backend="disabled")
    set_explicitly.celery_default_queue_type = "quorum"
    assert set_explicitly.queue_type("a") == "classic"


def test_a_queue_listed_twice_under_two_types_is_refused():
    from workhorse import App
    from workhorse.config import ConfigError
    with pytest.raises(ConfigError, match="queues.*without repeats"):
        _ = App("t", queues="a, a:quorum").settings
