"""The settings reference (docs/settings.md), generated from the declarations.

    python -m workhorse.config.reference           # print it
    python -m workhorse.config.reference --write   # rewrite docs/settings.md
"""
from __future__ import annotations

import sys
from pathlib import Path

from .loader import CONFIG_ENV, DROP_IN_DIR, _show
from .settings import SECTIONS, SETTINGS

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "settings.md"

INTRO = f"""# Settings reference

Generated from `workhorse/config/settings.py` by `python -m workhorse.config.reference --write`;
a test fails when this file is out of date.

Every setting can come from five places; a later one wins:

1. its default;
2. keyword arguments to `App(...)` in your code (`App("proj", broker_url="redis://…")`);
3. config files: the file given by `--config FILE` (or `${CONFIG_ENV}`), then every
   `*.toml` and `*.ini` in the `{DROP_IN_DIR}/` directory beside it, in file-name order;
4. environment variables `WORKHORSE_<NAME>` (e.g. `WORKHORSE_CONCURRENCY=8`);
5. command-line flags (`--concurrency 8`, or the short form where one is listed).

Files are TOML (`.toml`) or INI (`.ini`, `.conf`, `.cfg`) with the same sections and keys.
In INI, environment variables and flags, lists are comma-separated and booleans are
`true`/`false` (also yes/no, on/off, 1/0). TOML has no null, so an optional setting is unset
with the string `"none"`. An unknown section or key, a value of the wrong type or out of
range, or `soft_time_limit >= time_limit` stops the command with exit status 2 and a message
naming the file, section, key and value. `workhorse config` prints the effective settings
and where each came from (passwords in URLs shown as `***`); `workhorse config --check`
only validates.

```toml
# /etc/workhorse/workhorse.toml
[worker]
app = "myproject.tasks"
concurrency = 8

[broker]
broker_url = "redis://localhost:6379/0"

[tasks]
soft_time_limit = 50
time_limit = 60
```
"""


def render() -> str:
    parts = [INTRO]
    for section in SECTIONS:
        parts.append(f"\n## [{section}]\n")
        for s in (s for s in SETTINGS if s.section == section):
            default = s.default_doc or _show(s.default)
            flags = ", ".join(f"`{f}`" for f in s.flags)
            parts.append(
                f"\n### `{s.name}`\n\n{s.help}\n\n"
                f"- accepted: {s.type.describe()}\n"
                f"- default: `{default}`\n"
                f"- env: `{s.env}`\n"
                f"- flag: {flags}\n"
                f"- on reload (SIGHUP): {'applied' if s.reload else 'needs a restart'}\n")
    return "".join(parts)


def main(argv: list[str]) -> int:
    text = render()
    if "--write" in argv:
        DOC_PATH.parent.mkdir(parents=True, exist_ok=True)
        DOC_PATH.write_text(text)
        print(f"wrote {DOC_PATH}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
