"""Ask and steer workers over Celery's broadcast mailbox (``workhorse inspect``,
``workhorse control``): the same wire format as ``celery inspect/control``, so either tool
reaches either kind of worker."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kombu import Connection, pidbox

from . import commands
from .commands import ACTIONS
from .inspect import COMMANDS
from .revoked import Revoked

#: Commands whose positional arguments on the command line are a list under this name.
LIST_ARGUMENT = {"query_task": "ids", "registered": "taskinfoitems"}


def mailbox() -> pidbox.Mailbox:
    return pidbox.Mailbox("celery", type="fanout", accept=["json"], serializer="json")


def arguments(command: str, values: Sequence[str]) -> dict[str, Any]:
    """A command's arguments from the command line's words; ValueError naming what is
    wrong."""
    if command not in COMMANDS:
        raise ValueError(f"no such command: {command!r}; one of {', '.join(sorted(COMMANDS))}")
    if not values:
        return {}
    name = LIST_ARGUMENT.get(command)
    if name is None:
        raise ValueError(f"{command} takes no arguments, not {' '.join(values)!r}")
    return {name: list(values)}


def control_arguments(command: str, values: Sequence[str], *, terminate: bool = False,
                      signal: str | None = None) -> dict[str, Any]:
    """A control command's arguments from the command line; ValueError naming what is
    wrong (checked here as the worker checks them, so nothing malformed is sent)."""
    if command not in ACTIONS:
        raise ValueError(f"no such command: {command!r}; one of {', '.join(sorted(ACTIONS))}")
    if command.startswith("revoke"):
        commands.signum(signal)
        if not values:
            raise ValueError(f"{command} needs "
                             + ("the task ids" if command == "revoke" else "key=value stamps"))
        found: dict[str, Any] = (
            {"task_id": commands.task_ids(list(values))} if command == "revoke" else
            {"headers": {key: [value] for key, value in
                         commands.stamped_headers(list(values)).items()}})
        found.update(terminate=terminate, signal=signal)
        return found
    if terminate or signal:
        raise ValueError(f"--terminate and --signal go with revoke, not {command}")
    if command in ("pool_grow", "pool_shrink"):
        if len(values) > 1:
            raise ValueError(f"{command} takes one number, not {' '.join(values)!r}")
        return {"n": commands.children(values[0] if values else 1)}
    if command in ("add_consumer", "cancel_consumer"):
        if len(values) != 1:
            raise ValueError(f"{command} takes one queue name, not {' '.join(values)!r}")
        return {"queue": commands.queue_name(values[0])}
    if command == "time_limit":
        if not 1 <= len(values) <= 3:
            raise ValueError("time_limit takes a task name, then its soft and hard limits")
        task_name, soft, hard = (*values, None, None)[:3]
        commands.limit(soft, "soft")
        commands.limit(hard, "hard")
        return {"task_name": task_name, "soft": soft, "hard": hard}
    if values:
        raise ValueError(f"{command} takes no arguments, not {' '.join(values)!r}")
    return {}


def revoked_entries(command: str, arguments: dict[str, Any]) -> dict[str, float]:
    """What a revoke command revokes, as the shared store keeps it."""
    if command == "revoke":
        return Revoked().revoke_ids(arguments["task_id"])
    if command == "revoke_by_stamped_headers":
        return Revoked().revoke_stamps(arguments["headers"])
    return {}


def broadcast(connection: Connection, command: str, args: dict[str, Any], *,
              timeout: float, destination: Sequence[str] | None = None
              ) -> dict[str, Any]:
    """Every reply that came within ``timeout``, by worker name."""
    replies = mailbox()(connection)._broadcast(
        command, args, list(destination) if destination else None, reply=True,
        timeout=timeout)
    merged: dict[str, Any] = {}
    for reply in replies or ():
        if isinstance(reply, dict):
            merged.update(reply)
    return merged
