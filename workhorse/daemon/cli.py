"""The ``workhorse`` command: ``worker``, ``config``, ``dead``."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from collections.abc import Sequence
from dataclasses import asdict

from kombu import Connection

from .. import __version__
from ..app import App
from ..config import (
    ConfigError,
    Settings,
    add_setting_arguments,
    cli_values,
    load_settings,
    render_settings,
)
from ..exceptions import AppImportError
from ..protocol import dead_letter_queue
from .appload import AppModules
from .deadletters import Done, list_dead, purge_dead, requeue_dead
from .exitcodes import ExitCode

LOG_FORMAT = "[%(asctime)s %(levelname)s %(processName)s %(process)d] %(message)s"


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
    logging.basicConfig(level=settings.loglevel, format=LOG_FORMAT, stream=sys.stderr)
    from .supervisor import Supervisor

    def reload() -> tuple[Settings, App]:
        new_settings, new_app = resolve(args, modules)
        assert new_app is not None      # a reload imports the app it started with
        return new_settings, new_app
    return Supervisor(app, settings, reload=reload).run()


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
                status = _dead_list(connection, pairs, args.limit, args.json)
            else:
                status = _dead_act(connection, pairs, args.action,
                                   None if args.all else args.task_ids)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (``| head``): stop quietly, as command-line tools do. What
        # is not written yet would fail again at exit: write it nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return ExitCode.OK if args.action == "list" else ExitCode.FAILURE
    return status


def _dead_list(connection: Connection, pairs: list[tuple[str, str]], limit: int,
               as_json: bool) -> int:
    for dead_queue, _ in pairs:
        for letter in list_dead(connection, dead_queue, limit):
            if as_json:
                print(json.dumps({"dead_queue": dead_queue, **asdict(letter)}))
            else:
                print(f"{dead_queue}\t{letter.id}\t{letter.task}\t{letter.dead_at}\t"
                      f"{letter.reason}")
    return ExitCode.OK


def _dead_act(connection: Connection, pairs: list[tuple[str, str]], action: str,
              ids: list[str] | None) -> int:
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
            requeue_dead(connection, dead_queue, wanted, home, report)
        else:
            purge_dead(connection, dead_queue, wanted, report)
    for missing in sorted((wanted or set()) - found):
        failed = True
        print(f"{', '.join(dead for dead, _ in pairs)}\t{missing}\tnot found")
    return ExitCode.FAILURE if failed else ExitCode.OK
