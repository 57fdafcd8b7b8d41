"""The ``workhorse`` command: ``worker``, ``config``, ``inspect``, ``control``, ``dead``,
``health``, ``schedules``."""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import asdict
from datetime import UTC, datetime

from kombu import Connection

from .. import __version__
from ..app import App
from ..config import (
    ConfigError,
    check_master_names,
    Settings,
    add_setting_arguments,
    cli_values,
    load_settings,
    render_settings,
)
from ..control import client as control_client
from ..control.commands import ACTIONS
from ..control.inspect import COMMANDS
from ..exceptions import AppImportError
from ..protocol import dead_letter_queue
from .appload import AppModules
from ..broker.deadletters import Done, list_dead, purge_dead, requeue_dead
from .exitcodes import ExitCode
from ..schedules.entries import entries_for, iso
from ..schedules.fence import can_fence, fence_for
from ..transport.fenced import Record
from ..urls import redact
from .hostfiles import (
    HEALTH_MAX_AGE,
    PidfileTaken,
    check_health,
    health_path,
    remove_pidfile,
    write_pidfile,
)
from ..logs import configure as configure_logging


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="workhorse", description="Run Celery-protocol tasks from a message broker.")
    parser.add_argument("--version", action="version", version=f"workhorse {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    worker = commands.add_parser("worker", help="run the worker daemon",
                                 description="Run the supervisor and its prefork pool.")
    _add_common(worker)

    config = commands.add_parser(
        "config", help="print the effective settings and where each comes from",
        description="Print the effective settings as TOML, each with its source.")
    config.add_argument("--check", action="store_true",
                        help="only validate (settings and that the app imports); print nothing "
                             "but errors")
    _add_common(config)

    inspect = commands.add_parser(
        "inspect", help="ask running workers (Celery's remote control, as celery inspect)",
        description="Broadcast an inspect command to the workers on the broker (workhorse "
                    "or Celery) and print their replies.")
    inspect.add_argument("method", metavar="COMMAND",
                         help=f"one of: {', '.join(sorted(COMMANDS))}")
    inspect.add_argument("values", nargs="*", metavar="ARG",
                         help="query_task: the task ids")
    _add_broadcast(inspect)

    control = commands.add_parser(
        "control", help="steer running workers (Celery's remote control, as celery control)",
        description="Broadcast a control command to the workers on the broker (workhorse "
                    "or Celery) and print their replies. Revokes are also kept in the result "
                    "store, so workers that start later (workhorse ones) know them.")
    control.add_argument("method", metavar="COMMAND",
                         help=f"one of: {', '.join(sorted(ACTIONS))}")
    control.add_argument("values", nargs="*", metavar="ARG",
                         help="revoke: the task ids; revoke_by_stamped_headers: key=value "
                              "stamps")
    control.add_argument("--terminate", action="store_true",
                         help="revoke: also signal the child running the task (and what it "
                              "started)")
    control.add_argument("--signal", metavar="SIG",
                         help="with --terminate: the signal, by name or number (default TERM)")
    _add_broadcast(control)

    health = commands.add_parser(
        "health", help="exit 0 only while the worker runs tasks (a container health check)",
        description="Read the health file the worker's loop writes every 2 s (in "
                    "<state_dir>/health/<hostname>.json): exit 0 if it is fresh, the broker "
                    "thread turns and it is consuming; else print why and exit 1.")
    health.add_argument("--max-age", type=float, default=HEALTH_MAX_AGE, metavar="SECONDS",
                        help=f"how old the file may be (default {HEALTH_MAX_AGE:g})")
    _add_common(health)

    schedules = commands.add_parser(
        "schedules", help="the periodic tasks: list them, or print a schedule's due times",
        description="list: each schedule entry, its next due time and the last one sent "
                    "(and by which worker), read from the broker or result store. next: the "
                    "next due times of one entry of the config files, needing neither a "
                    "broker nor the task module.")
    schedules.add_argument("action", choices=("list", "next"))
    schedules.add_argument("name", nargs="?", metavar="NAME", help="next: the entry's name")
    schedules.add_argument("--after", metavar="ISO-TIME",
                           help="next: due times after this (ISO 8601 with an offset, e.g. "
                                "2027-03-27T12:00+01:00; default: now)")
    schedules.add_argument("--count", type=int, default=5, metavar="N",
                           help="next: how many due times (default 5)")
    schedules.add_argument("--json", action="store_true", help="list: as one JSON object")
    _add_common(schedules)

    dead = commands.add_parser(
        "dead", help="look at, replay or drop dead-lettered messages",
        description="Dead letters of each consumed queue are in <queue>.dead.")
    dead.add_argument("action", choices=("list", "requeue", "purge"))
    dead.add_argument("task_ids", nargs="*", metavar="ID",
                      help="requeue/purge only these dead letters, by the id `list` shows: "
                           "a task id, or unreadable-… (else give --all)")
    dead.add_argument("--all", action="store_true",
                      help="requeue/purge every dead letter but the unreadable ones")
    dead.add_argument("--dead-queue", metavar="NAME",
                      help="a queue holding dead letters other than <queue>.dead (e.g. the "
                           "queue behind a RabbitMQ dead-letter exchange)")
    dead.add_argument("--limit", type=int, default=100, help="list at most this many per queue")
    dead.add_argument("--json", action="store_true", help="list as JSON lines")
    _add_common(dead)
    return parser


def _add_broadcast(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--timeout", type=float, default=1.0,
                        help="seconds to wait for replies (default 1)")
    parser.add_argument("-d", "--destination", action="append", metavar="NAME",
                        help="ask only this worker (repeatable)")
    parser.add_argument("--json", action="store_true",
                        help="print the replies as one JSON object, by worker")
    _add_common(parser)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE",
                        help="TOML or INI config file (default: $WORKHORSE_CONFIG); drop-ins are "
                             "read from workhorse.d/ beside it")
    add_setting_arguments(parser)


def resolve(args: argparse.Namespace,
            modules: AppModules | None = None) -> tuple[Settings, App | None]:
    """Settings from every source, and the App they name (imported) if any.

    Two passes: the first finds ``app`` (it may come from the file or env); the app's own
    ``App(...)`` keywords then take their place between defaults and files. ``modules``
    remembers what the task module imported; given it again (a reload), the task module
    is imported from disk anew.
    """
    cli = cli_values(args)
    settings = load_settings(config_file=args.config, cli=cli)
    if not settings.app and (modules is None or modules.spec is None):
        check_master_names(settings)
        return settings, None
    app = (modules or AppModules()).load(settings.app or "")
    settings = load_settings(config_file=args.config or app.config_file,
                             code=app.code_settings, cli=cli)
    app.configure(settings)
    return settings, app


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    modules = AppModules()
    if args.command == "schedules" and args.action == "next":
        return _schedules_next(args)
    try:
        settings, app = resolve(args, modules)
    except ConfigError as exc:
        print(f"workhorse: configuration error: {exc}", file=sys.stderr)
        return ExitCode.CONFIG
    except AppImportError as exc:
        if exc.__cause__ is not None:
            traceback.print_exception(exc.__cause__, file=sys.stderr)
        print(f"workhorse: {exc}", file=sys.stderr)
        return ExitCode.APP_IMPORT
    if args.command == "config":
        return _config(args, settings)
    if args.command == "dead":
        return _dead(args, settings, app)
    if args.command == "schedules":
        return _schedules_list(args, settings, app)
    if args.command in ("inspect", "control"):
        return _broadcast(args, settings, app)
    if args.command == "health":
        problem = check_health(health_path(settings.state_dir, settings.hostname),
                               args.max_age)
        if problem:
            print(f"workhorse: unhealthy: {problem}", file=sys.stderr)
            return ExitCode.FAILURE
        print(f"workhorse: {settings.hostname} is healthy")
        return ExitCode.OK
    return _worker(args, settings, app, modules)


def _config(args: argparse.Namespace, settings: Settings) -> int:
    if not args.check:
        sys.stdout.write(render_settings(settings))
    return ExitCode.OK


def _worker(args: argparse.Namespace, settings: Settings, app: App | None,
            modules: AppModules) -> int:
    if app is None:
        print("workhorse: no task module to run: give -A module[:attribute] or set app in "
              "the [worker] section", file=sys.stderr)
        return ExitCode.CONFIG
    try:
        configure_logging(settings.loglevel, settings.log_format, settings.logfile)
    except OSError as exc:
        print(f"workhorse: cannot open the log file {settings.logfile}: {exc}", file=sys.stderr)
        return ExitCode.CONFIG
    try:
        _ = app.backend     # a store whose library or driver is missing is named now
    except ConfigError as exc:
        print(f"workhorse: configuration error: {exc}", file=sys.stderr)
        return ExitCode.CONFIG
    from .supervisor import Supervisor

    def reload() -> tuple[Settings, App]:
        new_settings, new_app = resolve(args, modules)
        assert new_app is not None      # a reload imports the app it started with
        return new_settings, new_app
    entries = entries_for(settings.schedule, app.celery_schedule)
    if settings.schedules and entries and not can_fence(settings.broker_url, app.backend):
        print(f"workhorse: configuration error: {len(entries)} schedule entries, but neither "
              f"the broker ({redact(settings.broker_url)}) nor the result store "
              f"({redact(settings.result_backend)}) can hold their fences, which keep each "
              "due time from being sent twice: use a sqlite:// or redis:// result_backend, "
              "or set schedules = false on this worker", file=sys.stderr)
        return ExitCode.CONFIG
    pidfile = settings.pidfile
    if pidfile is not None:
        try:
            write_pidfile(pidfile)
        except (PidfileTaken, OSError) as exc:
            print(f"workhorse: {exc}", file=sys.stderr)
            return ExitCode.CONFIG
    try:
        return Supervisor(app, settings, reload=reload).run()
    finally:
        if pidfile is not None:
            remove_pidfile(pidfile)


def _broadcast(args: argparse.Namespace, settings: Settings, app: App | None) -> int:
    """``workhorse inspect`` and ``workhorse control``."""
    what = f"{args.command} {args.method}"
    try:
        if args.command == "inspect":
            arguments = control_client.arguments(args.method, args.values)
        else:
            arguments = control_client.control_arguments(
                args.method, args.values, terminate=args.terminate, signal=args.signal)
    except ValueError as exc:
        print(f"workhorse: {args.command}: {exc}", file=sys.stderr)
        return ExitCode.CONFIG
    app = app or App(f"workhorse-{args.command}")
    app.configure(settings)
    kept = False
    entries = control_client.revoked_entries(args.method, arguments)
    if entries:
        try:
            app.backend.save_revoked(entries)
            kept = True
        except Exception as exc:  # noqa: BLE001 - the broadcast may still reach workers
            print(f"workhorse: {what}: could not keep it in the result store ({exc!r}): "
                  "only the workers online now will know it", file=sys.stderr)
    with app.connection() as connection:
        replies = control_client.broadcast(connection, args.method, arguments,
                                           timeout=args.timeout,
                                           destination=args.destination)
    if not replies:
        print(f"workhorse: {what}: no worker replied within {args.timeout:g} s"
              + ("; kept in the result store: workhorse workers that start later will not "
                 "run them" if kept else ""), file=sys.stderr)
        return ExitCode.OK if kept else ExitCode.FAILURE
    if args.json:
        print(json.dumps(replies, default=str))
    else:
        for name, reply in sorted(replies.items()):
            print(f"-> {name}: {json.dumps(reply, indent=2, default=str)}")
    return ExitCode.OK


def _dead(args: argparse.Namespace, settings: Settings, app: App | None) -> int:
    if args.action != "list" and not args.all and not args.task_ids:
        print(f"workhorse: dead {args.action}: name the ids (as dead list shows them), or "
              "give --all", file=sys.stderr)
        return ExitCode.CONFIG
    if args.action == "list" and (args.all or args.task_ids):
        print("workhorse: dead list takes no ids", file=sys.stderr)
        return ExitCode.CONFIG
    app = app or App("workhorse-dead")
    app.configure(settings)
    pairs = ([(args.dead_queue, settings.queues[0])] if args.dead_queue
             else [(dead_letter_queue(q), q) for q in settings.queues])
    try:
        with app.connection() as connection:
            if args.action == "list":
                status = _dead_list(connection, pairs, args.limit, args.json,
                                    app.queue_type)
            else:
                status = _dead_act(connection, pairs, args.action,
                                   None if args.all else args.task_ids, app.queue_type)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (``| head``): stop quietly, as command-line tools do. What
        # is not written yet would fail again at exit: write it nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return ExitCode.OK if args.action == "list" else ExitCode.FAILURE
    return status


def _dead_list(connection: Connection, pairs: list[tuple[str, str]], limit: int,
               as_json: bool, queue_type: Callable[[str], str]) -> int:
    for dead_queue, _ in pairs:
        for letter in list_dead(connection, dead_queue, limit, queue_type):
            if as_json:
                print(json.dumps({"dead_queue": dead_queue, **asdict(letter)}))
            else:
                print(f"{dead_queue}\t{letter.id}\t{letter.task}\t{letter.dead_at}\t"
                      f"{letter.reason}")
    return ExitCode.OK


def _dead_act(connection: Connection, pairs: list[tuple[str, str]], action: str,
              ids: list[str] | None, queue_type: Callable[[str], str]) -> int:
    """Requeue or purge, one line per dead letter acted on or named; FAILURE when something
    named could not be done."""
    failed = False
    found: set[str] = set()

    def report(done: Done) -> None:
        nonlocal failed
        failed = failed or not done.ok
        found.add(done.id)
        print(f"{done.dead_queue}\t{done.id}\t{done.what}")
    wanted = None if ids is None else set(ids)
    for dead_queue, home in pairs:
        if action == "requeue":
            requeue_dead(connection, dead_queue, wanted, home, report, queue_type)
        else:
            purge_dead(connection, dead_queue, wanted, report, queue_type)
    for missing in sorted((wanted or set()) - found):
        failed = True
        print(f"{', '.join(dead for dead, _ in pairs)}\t{missing}\tnot found")
    return ExitCode.FAILURE if failed else ExitCode.OK


def _schedules_next(args: argparse.Namespace) -> int:
    """``workhorse schedules next NAME``: from the config files alone."""
    try:
        settings = load_settings(config_file=args.config, cli=cli_values(args))
    except ConfigError as exc:
        print(f"workhorse: configuration error: {exc}", file=sys.stderr)
        return ExitCode.CONFIG
    found = {entry.name: entry for entry in settings.schedule}
    if not args.name or args.name not in found:
        known = ", ".join(sorted(found)) or "none in the config files"
        what = f"no schedule named {args.name!r}" if args.name else "give the schedule's name"
        print(f"workhorse: schedules next: {what} (schedules: {known})", file=sys.stderr)
        return ExitCode.CONFIG
    if args.count < 1:
        print("workhorse: schedules next: --count must be at least 1", file=sys.stderr)
        return ExitCode.CONFIG
    entry = found[args.name]
    if args.after is None:
        after = datetime.now(UTC)
    else:
        try:
            given: datetime | None = datetime.fromisoformat(args.after)
        except ValueError:
            given = None
        if given is None or given.tzinfo is None:
            print(f"workhorse: schedules next: --after {args.after!r}: expected an ISO 8601 "
                  "time with its offset, e.g. 2027-03-27T12:00+01:00", file=sys.stderr)
            return ExitCode.CONFIG
        after = given
    for _ in range(args.count):
        after = entry.timing.next_after(after)
        print(iso(after, entry.tz))
    return ExitCode.OK


def _schedules_list(args: argparse.Namespace, settings: Settings, app: App | None) -> int:
    """``workhorse schedules list``: each entry, its next due time, the last one sent."""
    entries = entries_for(settings.schedule, app.celery_schedule if app else [])
    app = app or App("workhorse-schedules")
    app.configure(settings)
    records: dict[str, Record] = {}
    trouble = None
    try:
        with app.connection() as connection:
            connection.ensure_connection(max_retries=1)
            fence = fence_for(connection, app.backend)
            if fence is None:
                trouble = "neither the broker nor the result store can hold fences"
            else:
                records = fence.records(entry.name for entry in entries)
    except Exception as exc:  # noqa: BLE001 - the entries are still worth printing
        trouble = f"could not read what was sent: {exc!r}"
    now = datetime.now(UTC)
    rows = []
    for entry in entries:
        due = entry.timing.next_after(now)
        record = records.get(entry.name)
        rows.append({
            "name": entry.name, "task": entry.task, "when": entry.timing.describe(),
            "catchup": entry.catchup, "misfire_grace": entry.misfire_grace,
            "next": iso(due, entry.tz), "next_utc": iso(due),
            "last_sent": None if record is None else iso(record.nominal, entry.tz),
            "last_sent_by": None if record is None else record.by,
            "last_task_id": None if record is None else record.task_id,
            "last_state": None if record is None else record.state,
            "source": entry.source})
    if args.json:
        print(json.dumps({"schedules": rows, "error": trouble}))
    else:
        if not rows:
            print("no schedule entries (see [[schedule]] in docs/periodic.md)")
        for row in rows:
            last = ("never" if row["last_sent"] is None else
                    f"{row['last_sent']} by {row['last_sent_by']} ({row['last_task_id']}"
                    + (", not confirmed)" if row["last_state"] == "sending" else ")"))
            print(f"{row['name']}: {row['task']}, {row['when']}, catchup {row['catchup']}\n"
                  f"    next: {row['next']} ({row['next_utc']})\n"
                  f"    last sent: {last}")
        if not settings.schedules:
            print("(schedules = false: this configuration's workers send none of them)")
    if trouble:
        print(f"workhorse: schedules list: {trouble}", file=sys.stderr)
        return ExitCode.FAILURE
    return ExitCode.OK
