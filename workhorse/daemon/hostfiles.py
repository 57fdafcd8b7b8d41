"""Files a worker keeps on its host for tools that cannot ask it over the broker: its
pidfile, and its health file, which ``workhorse health`` reads (a container's health
check).

The health file is written by a timer on the supervisor's loop, every
``HEALTH_INTERVAL`` s: that it is fresh says the loop turns; what it says tells whether
the broker thread turns and is connected (consuming). Both files are replaced atomically
(written beside, then renamed), so a reader never sees half of one.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import psutil

#: Seconds between health file writes; ``workhorse health`` allows a few of these.
HEALTH_INTERVAL = 2.0
HEALTH_MAX_AGE = 10.0


def health_path(state_dir: Path, hostname: str) -> Path:
    return state_dir / "health" / f"{hostname}.json"


def write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(text)
    os.replace(temporary, path)


def write_health(path: Path, **fields: Any) -> None:
    write_atomically(path, json.dumps({"pid": os.getpid(), "written": time.time(),
                                       **fields}))


def check_health(path: Path, max_age: float = HEALTH_MAX_AGE) -> str | None:
    """None if the worker behind ``path`` is healthy, else why not (one line)."""
    try:
        found = json.loads(path.read_text())
    except FileNotFoundError:
        return f"no health file at {path}: is the worker running (with this configuration)?"
    except (OSError, ValueError) as exc:
        return f"cannot read {path}: {exc}"
    age = time.time() - float(found.get("written", 0))
    if age > max_age:
        return (f"the supervisor's loop last wrote its health {age:.0f} s ago (pid "
                f"{found.get('pid')}): it is stuck or gone")
    if not psutil.pid_exists(int(found.get("pid", 0))):
        return f"the supervisor (pid {found.get('pid')}) is gone"
    if found.get("phase") != "running":
        return f"the worker is not running tasks: {found.get('phase')}"
    if not found.get("broker_thread"):
        return f"the broker thread does not turn: {found.get('broker')}"
    if not found.get("connected"):
        return f"not consuming: {found.get('broker')}"
    return None


class PidfileTaken(Exception):
    pass


def write_pidfile(path: Path) -> None:
    """Claim ``path`` for this process; PidfileTaken if a live workhorse holds it."""
    try:
        other = int(path.read_text().strip())
    except (OSError, ValueError):
        other = 0
    if other and other != os.getpid():
        try:
            command = " ".join(psutil.Process(other).cmdline())
        except psutil.Error:
            command = ""
        if "workhorse" in command:
            raise PidfileTaken(f"pidfile {path} names pid {other}, a workhorse that is "
                               "running: stop it first, or give another pidfile")
    write_atomically(path, f"{os.getpid()}\n")


def remove_pidfile(path: Path) -> None:
    """Remove ``path`` if it still names this process."""
    try:
        if int(path.read_text().strip()) == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass
