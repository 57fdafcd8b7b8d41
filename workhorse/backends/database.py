"""Celery's database result store: ``result_backend = "db+<SQLAlchemy URL>"``.

Results are rows of Celery's own tables, ``celery_taskmeta`` and ``celery_tasksetmeta``
(with the ``result_extended`` columns where the table has them), written as Celery 5.7's
store writes them with its default JSON serializer, so a Celery client on the same URL
reads them, and read back from rows either wrote (a pickled value only through
``pickles.loads``). The tables are made when missing, as Celery makes them.

As in Celery's store, a task's row is never written again once it holds SUCCESS (a
repeated run does not replace the result), and expired rows stay readable until the
worker's periodic purge (or ``celery.backend_cleanup``) deletes them: rows whose
``date_done`` is older than ``result_expires``.

workhorse's own chords and claims (idempotent tasks, and ``celery.chord_unlock`` applying
a Celery client's chord body once) are counted in tables of its own, ``workhorse_chords``,
``workhorse_chord_parts`` and ``workhorse_claims``, in one transaction each, with the rows
they read locked (``SELECT … FOR UPDATE`` where the database has it).

SQLAlchemy is an optional dependency (``pip install 'workhorse[sql]'``, plus the driver
of the URL: psycopg for ``postgresql://``). Tested on PostgreSQL.
"""
from __future__ import annotations

import importlib
import logging
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from ..config import ConfigError
from ..states import READY_STATES, SUCCESS
from ..urls import redact
from .base import (Backend, ChordCompletion, ChordPart, Claim, RequestInfo, encoded,
                   pending_meta)
from .encoding import build_meta, dumps, loads
from .pickles import loads as pickle_loads

if TYPE_CHECKING:
    import sqlalchemy as sa

log = logging.getLogger("workhorse.results")

PREFIX = "db+"
TASK_TABLE = "celery_taskmeta"
GROUP_TABLE = "celery_tasksetmeta"
#: result_extended's columns in Celery's table (``stamps`` is written as Celery does
#: only when a request has stamps; workhorse leaves it empty).
EXTENDED = ("name", "args", "kwargs", "worker", "retries", "queue")
#: How long a claim on a completed chord holds before another caller may take over.
CHORD_CLAIM_SECONDS = 30.0
#: A chord whose header never completes is forgotten after this long.
CHORD_EXPIRES = 86400.0
#: Seconds to wait for a connection to the database before the attempt fails.
CONNECT_TIMEOUT = 10


def sqlalchemy_url(url: str) -> str:
    """``db+postgresql://…`` → ``postgresql://…`` (what SQLAlchemy is given)."""
    if not url.startswith(PREFIX) or "://" not in url:
        raise ValueError(f"expected db+<SQLAlchemy URL> such as db+postgresql://host/db, "
                         f"got {redact(url)!r}")
    return url[len(PREFIX):]


def _import_sqlalchemy() -> Any:
    try:
        import sqlalchemy
    except ImportError:
        raise ConfigError(
            "result_backend db+…: the database result store needs SQLAlchemy, which is not "
            "installed: pip install 'workhorse[sql]' (and the database's driver, e.g. "
            "psycopg for postgresql://)") from None
    return sqlalchemy


def _tables(sa: Any, metadata: Any) -> dict[str, Any]:
    """Celery's two tables, column for column (celery/backends/database/models.py), and
    workhorse's own."""
    key = sa.Integer().with_variant(sa.BigInteger, "mssql")
    return {
        "task": sa.Table(
            TASK_TABLE, metadata,
            sa.Column("id", key, sa.Sequence("task_id_sequence"), primary_key=True,
                      autoincrement=True),
            sa.Column("task_id", sa.String(155), unique=True),
            sa.Column("status", sa.String(50)),
            sa.Column("result", sa.LargeBinary, nullable=True),
            sa.Column("date_done", sa.DateTime, nullable=True, index=True),
            sa.Column("traceback", sa.Text, nullable=True),
            sa.Column("children", sa.LargeBinary, nullable=True),
            sa.Column("name", sa.String(155), nullable=True),
            sa.Column("args", sa.LargeBinary, nullable=True),
            sa.Column("kwargs", sa.LargeBinary, nullable=True),
            sa.Column("worker", sa.String(155), nullable=True),
            sa.Column("retries", sa.Integer, nullable=True),
            sa.Column("queue", sa.String(155), nullable=True),
            sa.Column("stamps", sa.LargeBinary, nullable=True),
            sqlite_autoincrement=True),
        "group": sa.Table(
            GROUP_TABLE, metadata,
            sa.Column("id", key, sa.Sequence("taskset_id_sequence"), primary_key=True,
                      autoincrement=True),
            sa.Column("taskset_id", sa.String(155), unique=True),
            sa.Column("result", sa.LargeBinary, nullable=True),
            sa.Column("date_done", sa.DateTime, nullable=True, index=True),
            sqlite_autoincrement=True),
        "chords": sa.Table(
            "workhorse_chords", metadata,
            sa.Column("group_id", sa.String(155), primary_key=True),
            sa.Column("size", sa.Integer, nullable=False),
            sa.Column("claim", sa.String(155), nullable=True),
            sa.Column("claim_until", sa.Float, nullable=True),
            sa.Column("done", sa.Boolean, nullable=False, default=False),
            sa.Column("expires_at", sa.Float, nullable=False)),
        "parts": sa.Table(
            "workhorse_chord_parts", metadata,
            sa.Column("group_id", sa.String(155), primary_key=True),
            sa.Column("idx", sa.Integer, primary_key=True, autoincrement=False),
            sa.Column("task_id", sa.String(155), primary_key=True),
            sa.Column("state", sa.String(50), nullable=False),
            sa.Column("result", sa.Text, nullable=False)),
        "claims": sa.Table(
            "workhorse_claims", metadata,
            sa.Column("key", sa.String(255), primary_key=True),
            sa.Column("owner", sa.String(255), nullable=True),
            sa.Column("until", sa.Float, nullable=True),
            sa.Column("done", sa.Boolean, nullable=False, default=False),
            sa.Column("expires_at", sa.Float, nullable=True)),
    }


def _upsert(module: str) -> Any:
    def insert(table: Any) -> Any:
        return importlib.import_module(f"sqlalchemy.dialects.{module}").insert(table)
    return insert


#: Dialects whose INSERT … ON CONFLICT DO UPDATE … WHERE writes a row in one statement.
_UPSERTS = {"postgresql": _upsert("postgresql"), "sqlite": _upsert("sqlite")}


class UnreadableResult(ValueError):
    """A stored value in a format workhorse does not read."""


def decode_value(payload: bytes | None, where: str) -> Any:
    """A ``LargeBinary`` column's value: JSON (what Celery and workhorse write), or a
    pickle read through ``pickles.loads``."""
    if payload is None:
        return None
    payload = bytes(payload)
    if payload[:1] == b"\x80":
        return pickle_loads(payload)
    try:
        return loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise UnreadableResult(
            f"{where} is neither JSON nor a pickle ({exc}): workhorse reads what Celery's "
            "json and pickle result serializers write") from None


def _encode(value: Any) -> bytes:
    return dumps(value).encode("utf-8")


def _utc(value: datetime | None) -> str | None:
    if value is None:
        return None
    return (value if value.tzinfo else value.replace(tzinfo=UTC)).isoformat()


class DatabaseBackend(Backend):
    """Results in Celery's tables through SQLAlchemy."""

    def __init__(self, url: str, **options: Any) -> None:
        super().__init__(url, **options)
        self.sa = _import_sqlalchemy()
        self.target = sqlalchemy_url(url)
        try:
            self.sa.engine.make_url(self.target)
        except Exception as exc:  # noqa: BLE001 - SQLAlchemy's own message says what
            raise ConfigError(f"result_backend {redact(url)!r}: {exc}") from None
        self.metadata = self.sa.MetaData()
        self.t = _tables(self.sa, self.metadata)
        self._columns: frozenset[str] | None = None
        self._upserts: dict[tuple[str, ...], Any] = {}
        # Made now, so a URL whose driver is missing fails the worker's start, by name.
        self._engines: tuple[Any, Any] | None = self._new_engines()
        self._pid = os.getpid()

    # -- connections: two engines a process, one for transactions and one whose
    # connections commit each statement as it runs (a store, a read: one round trip)
    def _both(self) -> tuple[Any, Any]:
        if self._engines is None or self._pid != os.getpid():
            if self._engines is not None and self._pid != os.getpid():
                # Inherited across fork: their connections are the parent's; leave them be.
                for engine in self._engines:
                    engine.dispose(close=False)
            self._engines = self._new_engines()
            self._pid = os.getpid()
            self._columns = None
        return self._engines

    @property
    def engine(self) -> sa.engine.Engine:
        """The engine for transactions."""
        return self._both()[0]

    def _new_engines(self) -> tuple[Any, Any]:
        sa = self.sa
        url = sa.engine.make_url(self.target)
        connect_args: dict[str, Any] = {}
        if url.get_backend_name() == "postgresql" and "connect_timeout" not in url.query:
            connect_args["connect_timeout"] = CONNECT_TIMEOUT
        try:
            # No ping before each use (a round trip a store): a connection found dead
            # fails its call, which is retried on a new one (on_connection_error).
            return (sa.create_engine(url, pool_recycle=3600, connect_args=connect_args),
                    sa.create_engine(url, pool_recycle=3600, connect_args=connect_args,
                                     isolation_level="AUTOCOMMIT"))
        except Exception as exc:  # noqa: BLE001 - no driver, unknown dialect: say which
            raise ConfigError(f"result_backend {redact(self.url)!r}: {exc}") from None

    @contextmanager
    def _begin(self) -> Iterator[Any]:
        """A transaction, committed at the end."""
        self._ensure_tables()
        with self.engine.begin() as conn:
            yield conn

    @contextmanager
    def _single(self) -> Iterator[Any]:
        """For one statement: no transaction around it, so no round trip to commit."""
        self._ensure_tables()
        with self._both()[1].connect() as conn:
            yield conn

    def _ensure_tables(self) -> None:
        if self._columns is not None and self._pid == os.getpid():
            return
        engine = self.engine
        try:
            self.metadata.create_all(engine, checkfirst=True)
        except (self.sa.exc.ProgrammingError, self.sa.exc.IntegrityError):
            # Another process made a table between the check and the CREATE (two children
            # storing their first results into an empty database): check again.
            self.metadata.create_all(engine, checkfirst=True)
        # A table Celery made without result_extended lacks those columns: write the
        # columns it has.
        found = {c["name"] for c in self.sa.inspect(engine).get_columns(TASK_TABLE)}
        missing = [name for name in EXTENDED if name not in found]
        if self.extended and missing:
            log.warning("result store: %s has no %s columns (made without "
                        "result_extended): the extended fields are not stored",
                        TASK_TABLE, ", ".join(missing))
        self._columns = frozenset(found)

    def close(self) -> None:
        if self._engines is not None and self._pid == os.getpid():
            for engine in self._engines:
                engine.dispose()
        self._engines = None
        self._columns = None

    def on_connection_error(self, exc: BaseException) -> None:
        """Drop the pooled connections (any may be dead), keep the engines."""
        if self._engines is not None and self._pid == os.getpid():
            for engine in self._engines:
                engine.dispose()

    def exception_safe_to_retry(self, exc: BaseException) -> bool:
        """A lost connection, a database down or refusing connections, a pool timeout,
        a deadlock or serialization failure: yes. A bad statement or value: no."""
        errors = self.sa.exc
        if isinstance(exc, (errors.OperationalError, errors.InterfaceError,
                            errors.TimeoutError)):
            return True
        return isinstance(exc, errors.DBAPIError) and bool(exc.connection_invalidated)

    # -- task results
    def store_result(self, task_id: str, result: Any, state: str,
                     traceback: str | None = None, request: RequestInfo | None = None,
                     extra: Mapping[str, Any] | None = None) -> None:
        def encode() -> dict[str, Any]:
            meta = build_meta(task_id, state, result, traceback, request=request,
                              extended=self.extended)
            row = {
                "status": state,
                "result": _encode(meta["result"]),
                "traceback": traceback,
                "children": _encode(meta["children"]) if meta["children"] else None,
                "date_done": datetime.now(UTC),
            }
            if self.extended and request:
                row.update(name=meta["name"], args=_encode(meta["args"]),
                           kwargs=_encode(meta["kwargs"]), worker=meta["worker"],
                           retries=meta["retries"], queue=meta["queue"])
            return row
        row = encoded(task_id, state, encode)
        self.retrying(f"storing {state} for {task_id}", lambda: self._write(task_id, row))

    def _write(self, task_id: str, row: dict[str, Any]) -> None:
        sa, task = self.sa, self.t["task"]
        self._ensure_tables()
        upsert = _UPSERTS.get(self.engine.dialect.name)
        if upsert is not None:
            # One statement: insert, or update unless SUCCESS is stored.
            values = {k: v for k, v in row.items() if k in (self._columns or ())}
            names = tuple(sorted(values))
            statement = self._upserts.get(names)
            if statement is None:   # built once for each set of columns, then only bound
                insert = upsert(task).values(
                    {"task_id": sa.bindparam("task_id"),
                     **{name: sa.bindparam(name) for name in names}})
                statement = self._upserts[names] = insert.on_conflict_do_update(
                    index_elements=[task.c.task_id],
                    set_={name: insert.excluded[name] for name in names},
                    where=task.c.status != SUCCESS)
            with self._single() as conn:
                conn.execute(statement, {"task_id": task_id, **values})
            return
        for _ in range(3):
            with self._begin() as conn:
                known = self._columns or frozenset()
                values = {k: v for k, v in row.items() if k in known}
                updated = conn.execute(
                    sa.update(task).where(task.c.task_id == task_id, task.c.status != SUCCESS)
                    .values(**values)).rowcount
                if updated:
                    return
                if conn.execute(sa.select(task.c.status).where(
                        task.c.task_id == task_id)).first() is not None:
                    return      # SUCCESS is stored: a repeated run does not replace it
                try:
                    with conn.begin_nested():
                        conn.execute(sa.insert(task).values(task_id=task_id, **values))
                    return
                except sa.exc.IntegrityError:
                    pass        # another writer inserted it meanwhile: update it, once more
        raise RuntimeError(f"task {task_id}'s row could not be written (3 attempts)")

    def _set(self, task_id: str, state: str, payload: str) -> None:
        raise NotImplementedError("the database store writes columns: see store_result")

    def _get(self, task_id: str) -> str | None:
        raise NotImplementedError("the database store reads columns: see get_task_meta")

    def get_task_meta(self, task_id: str) -> dict[str, Any]:
        return self.retrying(f"reading {task_id}", lambda: self._read(task_id))

    def _read(self, task_id: str) -> dict[str, Any]:
        task = self.t["task"]
        with self._single() as conn:
            row = conn.execute(self.sa.select(task).where(task.c.task_id == task_id)
                               ).mappings().first()
        if row is None:
            return pending_meta(task_id)
        where = f"the stored result of task {task_id}"
        meta: dict[str, Any] = {
            "status": row["status"],
            "result": decode_value(row["result"], where),
            "traceback": row["traceback"],
            "children": decode_value(row["children"], where) or [],
            "date_done": _utc(row["date_done"]) if row["status"] in READY_STATES else None,
            "task_id": task_id,
        }
        if self.extended:
            meta.update({name: row.get(name) for name in EXTENDED})
            for name in ("args", "kwargs"):
                meta[name] = decode_value(meta[name], where)
        return meta

    def _forget(self, task_id: str) -> None:
        task = self.t["task"]
        with self._begin() as conn:
            conn.execute(self.sa.delete(task).where(task.c.task_id == task_id))

    # -- groups: {taskset_id, result: the GroupResult's tuple form}
    def save_group(self, group_id: str, as_tuple: Any) -> None:
        payload = _encode(as_tuple)
        self.retrying(f"saving group {group_id}", lambda: self._save_group(group_id, payload))

    def _save_group(self, group_id: str, payload: bytes) -> None:
        sa, group = self.sa, self.t["group"]
        values = {"result": payload, "date_done": datetime.now(UTC)}
        with self._begin() as conn:
            if conn.execute(sa.update(group).where(group.c.taskset_id == group_id)
                            .values(**values)).rowcount:
                return
            conn.execute(sa.insert(group).values(taskset_id=group_id, **values))

    def restore_group(self, group_id: str) -> Any | None:
        return self.retrying(f"reading group {group_id}", lambda: self._restore_group(group_id))

    def _restore_group(self, group_id: str) -> Any | None:
        group = self.t["group"]
        with self._begin() as conn:
            row = conn.execute(self.sa.select(group.c.result).where(
                group.c.taskset_id == group_id)).first()
        return None if row is None else decode_value(row[0], f"group {group_id}")

    def _forget_group(self, group_id: str) -> None:
        group = self.t["group"]
        with self._begin() as conn:
            conn.execute(self.sa.delete(group).where(group.c.taskset_id == group_id))

    # -- chords sent by workhorse clients, counted here (a Celery client's chord comes as
    # celery.chord_unlock instead: see workhorse.builtins)
    def set_chord_size(self, group_id: str, size: int) -> None:
        self.retrying(f"setting up chord {group_id}", lambda: self._set_chord_size(group_id,
                                                                                   size))

    def _set_chord_size(self, group_id: str, size: int) -> None:
        sa, chords, parts = self.sa, self.t["chords"], self.t["parts"]
        with self._begin() as conn:
            conn.execute(sa.delete(parts).where(parts.c.group_id == group_id))
            conn.execute(sa.delete(chords).where(chords.c.group_id == group_id))
            conn.execute(sa.insert(chords).values(group_id=group_id, size=size, done=False,
                                                  expires_at=time.time() + CHORD_EXPIRES))

    def _part_return(self, group_id: str, task_id: str, index: int, state: str,
                     encoded: str) -> ChordCompletion | None:
        sa, chords, parts = self.sa, self.t["chords"], self.t["parts"]
        with self._begin() as conn:
            # The chord's row, locked: its parts are counted by one writer at a time.
            chord = conn.execute(sa.select(chords.c.size, chords.c.claim, chords.c.claim_until,
                                           chords.c.done)
                                 .where(chords.c.group_id == group_id).with_for_update()).first()
            if chord is None or chord.done:
                return None
            known = conn.execute(sa.select(parts.c.task_id).where(
                parts.c.group_id == group_id, parts.c.idx == index,
                parts.c.task_id == task_id)).first()
            if known is None:
                conn.execute(sa.insert(parts).values(group_id=group_id, idx=index,
                                                     task_id=task_id, state=state,
                                                     result=encoded))
            ready = conn.execute(sa.select(sa.func.count()).select_from(parts).where(
                parts.c.group_id == group_id)).scalar_one()
            now = time.time()
            # The claim is the completing part's task id: that part's redelivery (its
            # worker died before the body was sent) takes it again at once.
            if ready < chord.size or (chord.claim not in (None, task_id)
                                      and chord.claim_until > now):
                return None
            conn.execute(sa.update(chords).where(chords.c.group_id == group_id).values(
                claim=task_id, claim_until=now + CHORD_CLAIM_SECONDS))
            rows = conn.execute(sa.select(parts.c.task_id, parts.c.state, parts.c.result)
                                .where(parts.c.group_id == group_id)
                                .order_by(parts.c.idx)).all()
        return ChordCompletion([ChordPart(t, s, loads(r)) for t, s, r in rows], task_id)

    def chord_finished(self, group_id: str, token: str) -> None:
        sa, chords, parts = self.sa, self.t["chords"], self.t["parts"]

        def finish() -> None:
            with self._begin() as conn:
                if conn.execute(sa.update(chords).where(chords.c.group_id == group_id,
                                                        chords.c.claim == token)
                                .values(done=True)).rowcount:
                    conn.execute(sa.delete(parts).where(parts.c.group_id == group_id))
        self.retrying(f"finishing chord {group_id}", finish)

    # -- claims (retried by the base class's public methods)
    def _claim(self, key: str, owner: str, ttl: float) -> Claim:
        sa, claims = self.sa, self.t["claims"]
        for _ in range(3):
            with self._begin() as conn:
                row = conn.execute(sa.select(claims).where(claims.c.key == key)
                                   .with_for_update()).mappings().first()
                now = time.time()
                values = {"owner": owner, "until": now + ttl, "done": False, "expires_at": None}
                if row is None:
                    try:
                        with conn.begin_nested():
                            conn.execute(sa.insert(claims).values(key=key, **values))
                        return Claim.CLAIMED
                    except sa.exc.IntegrityError:
                        continue        # claimed by another at the same moment: read it
                if row["done"] and (row["expires_at"] is None or row["expires_at"] > now):
                    return Claim.DONE
                if not row["done"] and row["owner"] != owner and row["until"] > now:
                    return Claim.HELD
                conn.execute(sa.update(claims).where(claims.c.key == key).values(**values))
                return Claim.CLAIMED
        raise RuntimeError(f"claim {key} could not be read or taken (3 attempts)")

    def _renew_claims(self, claims: Mapping[str, str], ttl: float) -> set[str]:
        sa, table = self.sa, self.t["claims"]
        lost = set()
        with self._begin() as conn:
            now = time.time()
            for key, owner in claims.items():
                renewed = conn.execute(sa.update(table).where(
                    table.c.key == key, table.c.owner == owner, table.c.done.is_(False),
                    table.c.until > now).values(until=now + ttl)).rowcount
                if not renewed:
                    lost.add(key)
        return lost

    def _release_claim(self, key: str, owner: str) -> None:
        sa, claims = self.sa, self.t["claims"]
        with self._begin() as conn:
            conn.execute(sa.delete(claims).where(claims.c.key == key, claims.c.owner == owner,
                                                 claims.c.done.is_(False)))

    def _finish_claim(self, key: str) -> None:
        sa, claims = self.sa, self.t["claims"]
        values = {"owner": None, "until": None, "done": True,
                  "expires_at": time.time() + self.expires if self.expires else None}
        with self._begin() as conn:
            if not conn.execute(sa.update(claims).where(claims.c.key == key)
                                .values(**values)).rowcount:
                conn.execute(sa.insert(claims).values(key=key, **values))

    # -- housekeeping
    #: A call may wait long on a database that stops answering: the supervisor makes
    #: its own (its stores, the purge) off its loop, on threads of their own.
    calls_block = True

    def purge_expired(self) -> int:
        """Delete results and groups whose ``date_done`` is older than ``result_expires``
        (as Celery's ``backend_cleanup`` does), abandoned chords and lapsed claims;
        returns how many results."""
        return self.retrying("purging expired results", self._purge_expired)

    def _purge_expired(self) -> int:
        sa, t = self.sa, self.t
        now = time.time()
        removed = 0
        with self._begin() as conn:
            if self.expires:
                before = datetime.now(UTC) - timedelta(seconds=self.expires)
                removed = conn.execute(sa.delete(t["task"]).where(
                    t["task"].c.date_done < before)).rowcount
                conn.execute(sa.delete(t["group"]).where(t["group"].c.date_done < before))
            old = sa.select(t["chords"].c.group_id).where(t["chords"].c.expires_at <= now)
            conn.execute(sa.delete(t["parts"]).where(t["parts"].c.group_id.in_(old)))
            conn.execute(sa.delete(t["chords"]).where(t["chords"].c.expires_at <= now))
            claims = t["claims"]
            conn.execute(sa.delete(claims).where(sa.or_(
                sa.and_(claims.c.done.is_(True), claims.c.expires_at <= now),
                sa.and_(claims.c.done.is_(False), claims.c.until <= now))))
        return int(removed)

