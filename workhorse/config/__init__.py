"""Configuration: one declaration per setting, read from TOML/INI files, env and CLI."""
from .loader import (
    ConfigError,
    Settings,
    add_setting_arguments,
    check_master_names,
    cli_values,
    load_settings,
    render_settings,
)
from .settings import SECTIONS, SETTINGS, Setting

__all__ = ["ConfigError", "SECTIONS", "SETTINGS", "Setting", "Settings", "add_setting_arguments",
           "check_master_names", "cli_values", "load_settings", "render_settings"]
