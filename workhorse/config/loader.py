"""Reading settings from every source, and the one function that decides precedence:
defaults < App(...) keywords < config files (main, then drop-ins by name) < env < CLI."""
from __future__ import annotations

import argparse
import configparser
import difflib
import os
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..schedules.entries import Entry, EntryError, from_table, merge
from .settings import BY_NAME, SECTIONS, SETTINGS, Setting
from ..urls import SENTINEL, redact, scheme_of, split_master_name
from .types import Invalid

CONFIG_ENV = "WORKHORSE_CONFIG"
ENV_PREFIX = "WORKHORSE_"
DROP_IN_DIR = "workhorse.d"
TOML_SUFFIXES = (".toml",)
INI_SUFFIXES = (".ini", ".conf", ".cfg")
#: The config files' periodic tasks: [[schedule]] (TOML) or [schedule.NAME] (TOML, INI).
SCHEDULE_SECTION = "schedule"


class ConfigError(Exception):
    """A setting that cannot be used; the message says where, what, and what is accepted."""


@dataclass(frozen=True)
class Raw:
    """One value as a source gave it, before parsing."""

    value: Any
    source: str          # "/etc/workhorse/workhorse.toml [worker]", "env WORKHORSE_X", ...
    key: str             # how the source spelled it, for the error message


class Settings:
    """The resolved settings, immutable; each value remembers its source."""

    def __init__(self, values: Mapping[str, Any], sources: Mapping[str, str],
                 config_files: tuple[Path, ...], schedule: tuple[Entry, ...] = ()) -> None:
        self._values = dict(values)
        self._sources = dict(sources)
        self.config_files = config_files
        #: The [[schedule]] entries of the config files (a drop-in's replaces the main
        #: file's of the same name).
        self.schedule = schedule

    def __getattr__(self, name: str) -> Any:
        try:
            value = self.__dict__["_values"][name]
        except KeyError:
            raise AttributeError(f"no setting named {name!r}") from None
        # Kept as an attribute: the next read does not come here (the supervisor reads
        # some settings for every task). The settings never change; a reload makes new.
        self.__dict__[name] = value
        return value

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def source(self, name: str) -> str:
        return self._sources[name]

    def as_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def __iter__(self) -> Iterator[tuple[Setting, Any, str]]:
        for setting in SETTINGS:
            yield setting, self._values[setting.name], self._sources[setting.name]

    def __repr__(self) -> str:
        return f"<Settings from {', '.join(map(str, self.config_files)) or 'defaults, env, cli'}>"


# ---------------------------------------------------------------- sources
def _suggest(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _check_key(path: Path, section: str, key: str) -> None:
    if key in BY_NAME and BY_NAME[key].section == section:
        return
    where = f"{path} [{section}] {key}"
    if key in BY_NAME:
        raise ConfigError(f"{where}: {key} belongs in the [{BY_NAME[key].section}] section")
    names = [s.name for s in SETTINGS if s.section == section]
    raise ConfigError(f"{where}: unknown setting{_suggest(key, names)} "
                      f"(settings in [{section}]: {', '.join(names)})")


def _check_section(path: Path, section: str) -> None:
    if section not in SECTIONS:
        raise ConfigError(f"{path} [{section}]: unknown section{_suggest(section, list(SECTIONS))} "
                          f"(sections: {', '.join(SECTIONS)})")


def read_toml(path: Path) -> dict[str, Raw]:
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    found: dict[str, Raw] = {}
    for section, table in data.items():
        if section == SCHEDULE_SECTION:
            continue            # read by read_schedule
        if not isinstance(table, dict):
            home = f"; put it under [{BY_NAME[section].section}]" if section in BY_NAME else ""
            raise ConfigError(f"{path}: {section} = {table!r} is outside any [section]{home}")
        _check_section(path, section)
        for key, value in table.items():
            _check_key(path, section, key)
            if isinstance(value, dict) and BY_NAME[key].type.toml_name != "table":
                raise ConfigError(f"{path} [{section}] {key}: nested tables are not settings")
            found[key] = Raw(value, f"{path} [{section}]", key)
    return found


def read_ini(path: Path) -> dict[str, Raw]:
    parser = configparser.ConfigParser(interpolation=None, default_section="\0no-defaults")
    # keys are case-sensitive
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    try:
        with path.open() as f:
            parser.read_file(f)
    except configparser.Error as exc:
        raise ConfigError(f"{path}: not valid INI: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    found: dict[str, Raw] = {}
    for section in parser.sections():
        if section.startswith(SCHEDULE_SECTION + "."):
            continue            # read by read_schedule
        _check_section(path, section)
        for key, value in parser.items(section):
            _check_key(path, section, key)
            found[key] = Raw(value, f"{path} [{section}]", key)
    return found


def read_file(path: Path) -> dict[str, Raw]:
    suffix = path.suffix.lower()
    if suffix in TOML_SUFFIXES:
        return read_toml(path)
    if suffix in INI_SUFFIXES:
        return read_ini(path)
    raise ConfigError(f"{path}: unknown config file type {suffix or '(no extension)'!r}; "
                      f"accepted: {', '.join(TOML_SUFFIXES + INI_SUFFIXES)}")


def read_schedule(path: Path) -> list[Entry]:
    """The schedule entries of one config file: TOML ``[[schedule]]`` tables (each with
    its ``name``) or ``[schedule.NAME]`` tables; INI ``[schedule.NAME]`` sections, whose
    args and kwargs are JSON."""
    tables: list[dict[str, Any]] = []
    if path.suffix.lower() in TOML_SUFFIXES:
        data = tomllib.loads(path.read_text())        # (read_toml checked it)
        value = data.get(SCHEDULE_SECTION)
        if value is None:
            return []
        if isinstance(value, list) and all(isinstance(v, dict) for v in value):
            tables = [dict(v) for v in value]
        elif isinstance(value, dict) and all(isinstance(v, dict) for v in value.values()):
            for name, table in value.items():
                if "name" in table and table["name"] != name:
                    raise ConfigError(f"{path} [schedule.{name}]: name = {table['name']!r} "
                                      "differs from the table's name")
                tables.append({**table, "name": name})
        else:
            raise ConfigError(f"{path}: schedule must be [[schedule]] tables (each with a "
                              "name) or [schedule.NAME] tables")
    else:
        parser = configparser.ConfigParser(interpolation=None, default_section="\0none")
        parser.optionxform = str  # type: ignore[assignment,method-assign]
        parser.read_string(path.read_text(), str(path))
        for section in parser.sections():
            if section.startswith(SCHEDULE_SECTION + "."):
                name = section[len(SCHEDULE_SECTION) + 1:]
                tables.append({**dict(parser.items(section)), "name": name})
    try:
        return [from_table(table, str(path)) for table in tables]
    except EntryError as exc:
        raise ConfigError(str(exc)) from None


def config_files(config_file: str | os.PathLike[str] | None,
                 env: Mapping[str, str]) -> tuple[Path, ...]:
    """The main file (argument, else $WORKHORSE_CONFIG) and its drop-ins, in reading order."""
    named = config_file if config_file is not None else env.get(CONFIG_ENV) or None
    if named is None:
        return ()
    main = Path(named).expanduser()
    if not main.is_file():
        origin = "" if config_file is not None else f" (from {CONFIG_ENV})"
        raise ConfigError(f"config file {main}{origin} does not exist")
    drop_in = main.parent / DROP_IN_DIR
    extras = sorted((p for p in drop_in.glob("*") if p.suffix.lower() in (".toml", ".ini")
                     and p.is_file()), key=lambda p: p.name) if drop_in.is_dir() else []
    return (main, *extras)


def read_env(env: Mapping[str, str]) -> dict[str, Raw]:
    found: dict[str, Raw] = {}
    envs = [s.env for s in SETTINGS]
    for key, value in env.items():
        if not key.startswith(ENV_PREFIX) or key == CONFIG_ENV:
            continue
        name = key[len(ENV_PREFIX):].lower()
        if name not in BY_NAME:
            raise ConfigError(f"env {key}: unknown setting{_suggest(key, envs)}")
        found[name] = Raw(value, f"env {key}", key)
    return found


def read_code(code: Mapping[str, Any]) -> dict[str, Raw]:
    found: dict[str, Raw] = {}
    for key, value in code.items():
        if key not in BY_NAME:
            raise ConfigError(f"App(...) keyword {key!r}: unknown setting"
                              f"{_suggest(key, list(BY_NAME))}")
        found[key] = Raw(value, "App(...) keyword", key)
    return found


def read_cli(cli: Mapping[str, Any]) -> dict[str, Raw]:
    found: dict[str, Raw] = {}
    for key, value in cli.items():
        setting = BY_NAME[key]
        found[key] = Raw(value, f"cli {setting.flag}", setting.flag)
    return found


# ---------------------------------------------------------------- precedence
def resolve(layers: list[dict[str, Raw]], files: tuple[Path, ...] = ()) -> Settings:
    """THE precedence rule: later layers win; defaults fill the rest, in declaration order
    (so a derived default sees the values declared before it)."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for setting in SETTINGS:
        raw = next((layer[setting.name] for layer in reversed(layers) if setting.name in layer),
                   None)
        if raw is None:
            values[setting.name] = setting.default_value(values)
            sources[setting.name] = ("default (derived from state_dir)" if setting.derived
                                     and setting.name in ("broker_url", "result_backend")
                                     else "default")
            continue
        try:
            values[setting.name] = setting.type.parse(raw.value)
        except Invalid as exc:
            # env and cli sources already name the variable or flag; files need the key
            prefix = raw.source if raw.source.startswith(("env ", "cli ")) else \
                f"{raw.source} {setting.name}"
            # (a URL's password is never echoed)
            shown = redact(raw.value) if isinstance(raw.value, str) else raw.value
            raise ConfigError(f"{prefix} = {shown!r}: {exc}") from None
        sources[setting.name] = raw.source
    _check_together(values, sources)
    return Settings(values, sources, files)


def _check_together(values: Mapping[str, Any], sources: Mapping[str, str]) -> None:
    soft, hard = values["soft_time_limit"], values["time_limit"]
    if soft is not None and hard is not None and soft >= hard:
        raise ConfigError(
            f"time_limit ({_num(hard)}) must be greater than soft_time_limit ({_num(soft)}): "
            f"time_limit from {sources['time_limit']}, soft_time_limit from "
            f"{sources['soft_time_limit']}")


def check_master_names(settings: Settings,
                       fallback: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """A ``sentinel://`` list needs the master's name: at the list's end, in its transport
    options setting, or in ``fallback`` (a Celery app's options of those names, under -A).
    Checked once the app is known, since a Celery app may bring it."""
    for url_setting, options_setting in (("broker_url", "broker_transport_options"),
                                         ("result_backend", "result_backend_transport_options")):
        url = settings[url_setting]
        if (scheme_of(url) == SENTINEL and split_master_name(url)[1] is None
                and not settings[options_setting].get("master_name")
                and not (fallback or {}).get(options_setting, {}).get("master_name")):
            raise ConfigError(
                f"{url_setting} from {settings.source(url_setting)} lists Redis Sentinels but "
                f"not the master's name: end the list with ?master_name=<name>, or set "
                f"master_name in {options_setting}")


def _num(value: float) -> str:
    return str(int(value)) if value == int(value) else str(value)


def load_settings(*, config_file: str | os.PathLike[str] | None = None,
                  code: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
                  cli: Mapping[str, Any] | None = None) -> Settings:
    """Read every source and resolve; raises ConfigError naming the first problem."""
    env = os.environ if env is None else env
    files = config_files(config_file, env)
    layers = [read_code(code or {}), *(read_file(path) for path in files), read_env(env),
              read_cli(cli or {})]
    settings = resolve(layers, files)
    settings.schedule = tuple(merge([entry for path in files for entry in read_schedule(path)]))
    return settings


# ---------------------------------------------------------------- command line
def add_setting_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, grouped by section; unset flags leave no trace."""
    groups = {section: parser.add_argument_group(f"{section} settings") for section in SECTIONS}
    for setting in SETTINGS:
        default = setting.default_doc or _show(setting.default)
        help_text = f"{setting.help} [default: {default}; env {setting.env}]"
        help_text = help_text.replace("%", "%%")
        if setting.type.toml_name == "boolean":
            groups[setting.section].add_argument(
                *setting.flags, dest=setting.name, default=argparse.SUPPRESS,
                action=argparse.BooleanOptionalAction, help=help_text)
        else:
            groups[setting.section].add_argument(
                *setting.flags, dest=setting.name, default=argparse.SUPPRESS,
                metavar=setting.name.upper(), help=help_text)


def cli_values(namespace: argparse.Namespace) -> dict[str, Any]:
    given = vars(namespace)
    return {s.name: given[s.name] for s in SETTINGS if s.name in given}


def _show(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    if isinstance(value, float) and value == int(value):
        return str(int(value))
    return str(value)


# ---------------------------------------------------------------- output
def _toml_value(setting: Setting, value: Any) -> str:
    if value is None:
        return '"none"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(repr(v) if isinstance(v, int) else _toml_string(v)
                               for v in value) + "]"
    return _toml_string(str(value))


def _toml_string(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def render_settings(settings: Settings) -> str:
    """The effective settings as TOML (loadable again, but for passwords in URLs, which are
    shown as ``***``), each line saying where it came from.

    ``max_memory_per_child`` is written in KiB, the unit a bare integer means."""
    lines: list[str] = []
    for section in SECTIONS:
        lines.append(f"[{section}]")
        for setting, value, source in settings:
            if setting.section != section:
                continue
            if setting.name == "max_memory_per_child" and value is not None:
                shown = f'"{value}B"'
            else:
                shown = _toml_value(setting, redact(value) if isinstance(value, str) else value)
            lines.append(f"{setting.name} = {shown}  # {source}")
        lines.append("")
    return "\n".join(lines)
