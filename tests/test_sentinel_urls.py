"""Redis Sentinel and Valkey URLs (pure): Celery's ``sentinel://`` list with the master's
name at its end or in the transport options, checked at start with one line naming what is
wrong, shown without passwords, and turned into the transport and result store that ask
the sentinels for the master."""
from __future__ import annotations

import pytest

from workhorse import App
from workhorse.backends import backend_from_url
from workhorse.backends.redis import RedisBackend
from workhorse.config import ConfigError, load_settings
from workhorse.transport import REDIS, REDIS_SENTINEL
from workhorse.urls import as_redis, redact, sentinels, split_master_name

pytestmark = pytest.mark.timeout(60)

LIST = "sentinel://:secret@h1:26380/2;sentinel://h2;sentinel://h3:26381"


def test_a_sentinel_list_gives_its_sentinels_database_password_and_master():
    url, master = split_master_name(f"{LIST}?master_name=mymaster")
    assert (url, master) == (LIST, "mymaster")
    found = sentinels(url)
    assert found.addresses == (("h1", 26380), ("h2", 26379), ("h3", 26381))
    assert (found.db, found.password) == (2, "secret")
    assert redact(f"{LIST}?master_name=m") == (
        "sentinel://:***@h1:26380/2;sentinel://h2;sentinel://h3:26381?master_name=m")
    assert split_master_name("redis://h/0") == ("redis://h/0", None)


def test_valkey_urls_are_redis_on_the_wire():
    assert as_redis("valkey://h:6379/0") == "redis://h:6379/0"
    assert as_redis("valkeys://u:p@h/1") == "rediss://u:p@h/1"
    assert as_redis("amqp://h//") == "amqp://h//"


@pytest.mark.parametrize(("setting", "options"), [("broker_url", "broker_transport_options"),
                                                   ("result_backend",
                                                    "result_backend_transport_options")])
def test_a_sentinel_list_needs_the_masters_name_from_somewhere(setting, options):
    app = App("t", **{setting: LIST})
    with pytest.raises(ConfigError) as raised:
        app.connection()
    assert (f"{setting} from App(...) keyword lists Redis Sentinels but not the master's "
            f"name: end the list with ?master_name=<name>, or set master_name in {options}"
            ) == str(raised.value)
    assert App("t", **{setting: LIST, options: {"master_name": "m"}}).settings
    # A Celery app run with -A may bring it in its own transport options.
    celery_like = App("t")
    celery_like.celery_transport_options[options] = {"master_name": "m"}
    celery_like.configure(load_settings(code={setting: LIST}, env={}))


@pytest.mark.parametrize(("settings", "error"), [
    ({"result_backend": "redis://a/0;redis://b/0"}, "a list of URLs (url;url) is not for redis"),
    ({"broker_url": "sentinel://h1;redis://h2"}, "share one scheme"),
    ({"broker_transport_options": "not json"}, "expected a table of options"),
])
def test_a_bad_sentinel_setting_is_refused_naming_it(settings, error):
    with pytest.raises(ConfigError) as raised:
        load_settings(code=settings, env={})
    assert error in str(raised.value)
    assert "secret" not in str(raised.value)


def test_the_master_name_may_come_from_the_transport_options_in_env_or_toml(tmp_path):
    env = {"WORKHORSE_BROKER_URL": LIST,
           "WORKHORSE_BROKER_TRANSPORT_OPTIONS": '{"master_name": "mymaster"}'}
    assert load_settings(env=env).broker_transport_options == {"master_name": "mymaster"}
    config = tmp_path / "workhorse.toml"
    config.write_text(f'[results]\nresult_backend = "{LIST}"\n'
                      'result_backend_transport_options = { master_name = "m2" }\n')
    settings = load_settings(config_file=config, env={})
    assert settings.result_backend_transport_options == {"master_name": "m2"}


def test_a_sentinel_broker_gets_workhorses_redis_transport_on_the_named_master():
    app = App("t", broker_url=f"{LIST}?master_name=mymaster", result_backend="disabled",
              broker_transport_options={"sentinel_kwargs": {"password": "s"},
                                        "visibility_timeout": 5})
    connection = app.connection()
    assert connection.transport_cls == REDIS_SENTINEL
    options = connection.transport_options
    assert options["master_name"] == "mymaster"
    assert options["sentinel_kwargs"] == {"password": "s"}
    assert options["visibility_timeout"] == app.settings.visibility_timeout   # ours win
    assert "?" not in connection.hostname
    plain = App("t", broker_url="valkey://h:6379/0", result_backend="disabled").connection()
    assert plain.transport_cls == REDIS and plain.hostname == "h"


def test_a_sentinel_result_store_is_redis_with_the_master_name():
    backend = backend_from_url(LIST, transport_options={"master_name": "mymaster"})
    assert isinstance(backend, RedisBackend)
    assert backend.transport_options == {"master_name": "mymaster"}
    assert isinstance(backend_from_url("valkey://h/1"), RedisBackend)
