"""Engines per database role, raw asyncpg connections for COPY and LISTEN, and migrations."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import socket
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlencode, urlsplit, urlunsplit

import asyncpg
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import event
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.engine.interfaces import DBAPIConnection, ExceptionContext
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import ConnectionPoolEntry, PoolProxiedConnection

from store import errors, urls
from store.settings import Settings

log = logging.getLogger(__name__)

MIGRATIONS = Path(__file__).parent / "migrations"


# What sslmode (or its SQLAlchemy spelling, ssl) may say: libpq's modes, as asyncpg reads them.
SSL_MODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
# Query parameters SQLAlchemy's asyncpg dialect reads itself; every other one is the connection's, read by asyncpg.
_DIALECT_PARAMS = ("prepared_statement_cache_size",)


@dataclass(frozen=True)
class Bounds:
    """How long a connection waits on PostgreSQL (docs/database.md, "Silent networks"): each statement (None: no
    bound, for a COPY or a migration that may rightly run long), each connect, and how long the kernel lets sent
    data or keepalive probes go unacknowledged before it drops the connection (TCP_USER_TIMEOUT, with keepalives
    paced to match). A bound that fires is an uncertain answer (store/errors.py), as a lost connection is."""

    statement_seconds: float | None
    connect_seconds: float
    tcp_user_timeout_seconds: float

    @classmethod
    def of(cls, settings: Settings) -> Bounds:
        return cls(settings.database_statement_timeout_seconds, settings.database_connect_timeout_seconds,
                   settings.database_tcp_user_timeout_seconds)

    @classmethod
    def defaults(cls) -> Bounds:
        return cls.of(Settings.model_construct())

    def connect_kwargs(self) -> dict[str, float | None]:
        """asyncpg.connect()'s own: its connect timeout, and the statement bound as every statement's default."""
        return {"timeout": self.connect_seconds, "command_timeout": self.statement_seconds}


def keep_alive(conn: asyncpg.Connection, tcp_user_timeout_seconds: float) -> None:
    """TCP keepalives and TCP_USER_TIMEOUT on an asyncpg connection's socket (asyncpg has no parameters for them),
    so that a peer gone silent is dropped by the kernel in about `tcp_user_timeout_seconds`, idle or not, instead
    of after the kernel's retransmissions (some 15 minutes) or never (idle). A Unix socket needs none."""
    transport: Any = conn._transport  # type: ignore[attr-defined]  # asyncpg's own, the socket's only way out
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    # Probes begin after half the timeout idle, three of them before it ends; the user timeout then decides.
    for name, value in (("TCP_KEEPIDLE", tcp_user_timeout_seconds / 2), ("TCP_KEEPINTVL", tcp_user_timeout_seconds / 6),
                        ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", tcp_user_timeout_seconds * 1000)):
        option = getattr(socket, name, None)  # Linux has them all; other systems some
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, max(1, round(value)))


def make_engine(url: str, *, pool_size: int = 5, max_overflow: int | None = None,
                bounds: Bounds | None = None) -> AsyncEngine:
    """A pooled engine. The URL's connection parameters (host, port, sslmode, sslrootcert, passfile, ...) and the
    PG* variables are read by asyncpg as libpq reads them, not by SQLAlchemy (see asyncpg_dsn). Every connection
    has `bounds` (the settings' defaults when None)."""
    if not url:
        raise ValueError("no database URL configured (EXPORTS_DATABASE_URL, or start `exports dev`)")
    dsn = asyncpg_dsn(url)
    bounds = Bounds.defaults() if bounds is None else bounds
    engine = create_async_engine(urls.sqlalchemy_url(url), pool_size=pool_size,
                                 max_overflow=pool_size if max_overflow is None else max_overflow)

    @event.listens_for(engine.sync_engine, "do_connect")
    def _libpq_parameters(dialect: Dialect, connection_record: ConnectionPoolEntry, cargs: list[Any],
                          cparams: dict[str, Any]) -> None:
        # SQLAlchemy hands every query parameter to asyncpg.connect() as a keyword, which has none for sslmode,
        # sslrootcert, sslcert or passfile: the whole URL goes as asyncpg's DSN instead, which reads them all.
        kept = {key: cparams[key] for key in _DIALECT_PARAMS if key in cparams}
        cparams.clear()
        cparams.update(kept, dsn=dsn, async_creator_fn=connect_each_host, **bounds.connect_kwargs())

    @event.listens_for(engine.sync_engine, "connect")
    def _keepalives(dbapi_connection: DBAPIConnection, connection_record: ConnectionPoolEntry) -> None:
        keep_alive(dbapi_connection.driver_connection, bounds.tcp_user_timeout_seconds)

    @event.listens_for(engine.sync_engine, "handle_error")
    def _past_its_bound_is_lost(context: ExceptionContext) -> None:
        # A statement past its bound (asyncpg's command_timeout), or abandoned by its caller's (a cancellation), may
        # have met a dead network. SQLAlchemy drops its connection already; every older connection of the pool is
        # replaced at its next checkout too, as after a lost connection, rather than each waiting out its bound.
        if (isinstance(context.original_exception, (TimeoutError, asyncio.CancelledError))
                and context.connection is not None):
            context.is_disconnect = True
            context.invalidate_pool_on_disconnect = True

    @event.listens_for(engine.sync_engine, "close")
    def _close_at_once(dbapi_connection: DBAPIConnection, connection_record: ConnectionPoolEntry) -> None:
        # A connection the pool discards (invalidated, replaced, disposed) is closed without a goodbye: on a dead
        # network the goodbye waits for an answer that never comes (2 s, or a whole statement bound), and the
        # server needs none.
        dbapi_connection.driver_connection.terminate()

    @event.listens_for(engine.sync_engine, "checkout")
    def _replace_closed(dbapi_connection: DBAPIConnection, connection_record: ConnectionPoolEntry,
                        connection_proxy: PoolProxiedConnection) -> None:
        # asyncpg notices, without a round trip, a connection the server or the network closed (a restart, a
        # cut), and the pool then replaces it. pool_pre_ping would ask the server instead: three round trips
        # (BEGIN, a ping, ROLLBACK) before every statement. A connection that died silently fails its statement,
        # which the store treats as an uncertain answer, and the pool drops every connection older than that.
        driver: Any = connection_record.driver_connection  # asyncpg's connection, there at every checkout
        if driver.is_closed():
            raise DisconnectionError("the pooled connection was closed")

    return engine


def asyncpg_dsn(url: str) -> str:
    """The same URL in the form asyncpg itself accepts: its libpq parameters (sslmode, sslrootcert, host,
    target_session_attrs, ...) as they are, `ssl=<mode>` (SQLAlchemy's spelling) as `sslmode=<mode>`, without the
    dialect's own parameters. Several hosts (a primary and its standbys) in any form store/urls.py reads; where
    asyncpg would read them otherwise than libpq (a repeated host=, ?port= beside hosts before the path), they are
    written out again as one ?host= list. Anything the URL leaves out, asyncpg takes from PGHOST, PGPORT, PGUSER,
    PGPASSWORD, PGDATABASE, PGSSLMODE, PGSSLROOTCERT, PGPASSFILE, ... as libpq does. Hosts or ports that cannot be
    read whole are urls.MalformedDatabaseUrl; a malformed sslmode, a ValueError."""
    parsed = urls.parse(url)
    if url.startswith("postgresql+asyncpg://"):
        url = "postgresql://" + url[len("postgresql+asyncpg://"):]
    parts = urlsplit(url)
    if not parts.query:
        return url
    params = []
    for key, value in parsed.other_params() if parsed.respell else parsed.query:
        if key in _DIALECT_PARAMS:
            continue
        if key in ("ssl", "sslmode"):
            if value not in SSL_MODES:
                raise ValueError(f"{key}={value!r} in the database URL: expected one of {', '.join(SSL_MODES)}")
            key = "sslmode"
        params.append((key, value))
    if sum(key == "sslmode" for key, _ in params) > 1:
        raise ValueError("the database URL gives sslmode (or ssl) more than once")
    if parsed.respell:
        auth = "" if parsed.auth is None else f"{parsed.auth}@"
        query = urlencode([*parsed.host_params(), *params], safe=urls.QUERY_SAFE)
        return f"{parts.scheme}://{auth}{parts.path}?{query}"
    return urlunsplit(parts._replace(query=urlencode(params, safe=urls.QUERY_SAFE)))


# Failures after which libpq tries a URL's next host: nothing answered in time, the network refused, or the server
# is not the kind asked for (a standby when read-write is wanted) or cannot take connections yet.
_NEXT_HOST = (OSError, TimeoutError, asyncpg.TargetServerAttributeNotMatched, asyncpg.CannotConnectNowError)


# For each multi-host DSN, its hosts in the order the next connection tries them: a host that answers as asked
# moves to the front, one that does not (refused, timed out, or given up by its caller meanwhile) to the back.
# After a failover, only the connections made before one reached the promoted host wait out the old primary gone
# silent: a step bounded more tightly than that wait (a lease renewal, 5 s, against 5 s for each host) was
# otherwise given up at the first host, every time.
_HOST_ORDER: dict[str, list[str]] = {}


def _tried(dsn: str, spec: str, *, answered: bool) -> None:
    order = _HOST_ORDER[dsn]
    if spec in order:
        order.remove(spec)
    if answered:
        order.insert(0, spec)
    else:
        order.append(spec)


async def connect_each_host(dsn: str, *, timeout: float, **kwargs: Any) -> asyncpg.Connection:
    """asyncpg.connect() with `timeout` for each host of the DSN in turn, as libpq's connect_timeout is: asyncpg's
    own timeout covers all the hosts at once, so a first host that accepts and never answers (a primary gone
    silent after a failover) would use it all up and the promoted standby never be tried. Hosts go in the order
    of `_HOST_ORDER` (the DSN's at first). The first host that answers as `target_session_attrs` asks wins;
    otherwise the last host's error is raised. `prefer-standby`, which weighs every host before choosing, is left
    to asyncpg."""
    parsed = urls.parse(dsn)
    if len(parsed.hosts) <= 1 or ("target_session_attrs", "prefer-standby") in parsed.other_params():
        return await asyncpg.connect(dsn, timeout=timeout, **kwargs)
    each_host = parsed.one_host_each()
    order = _HOST_ORDER.setdefault(dsn, [host.spec for host, _ in each_host])
    hosts = sorted(each_host, key=lambda each: order.index(each[0].spec))
    for number, (host, candidate) in enumerate(hosts, start=1):
        try:
            conn: asyncpg.Connection = await asyncpg.connect(candidate, timeout=timeout, **kwargs)
        except BaseException as exc:
            _tried(dsn, host.spec, answered=False)
            if number == len(hosts) or not isinstance(exc, _NEXT_HOST):
                raise
            log.info("database host %s not taken (%s); trying the next", host.spec, type(exc).__name__)
            continue
        _tried(dsn, host.spec, answered=True)
        return conn
    raise AssertionError("unreachable: the last host's answer is returned or raised")


async def connect_raw(url: str, bounds: Bounds | None = None) -> asyncpg.Connection:
    """A connection outside the pools (COPY, LISTEN), to a URL or an asyncpg DSN, with `bounds` (the settings'
    defaults when None) and keepalives."""
    bounds = Bounds.defaults() if bounds is None else bounds
    conn: asyncpg.Connection = await connect_each_host(asyncpg_dsn(url), timeout=bounds.connect_seconds,
                                                       command_timeout=bounds.statement_seconds)
    try:
        keep_alive(conn, bounds.tcp_user_timeout_seconds)
    except BaseException:
        conn.terminate()
        raise
    return conn


class RawConnections:
    """Connections outside the pools for one kind of long statement (a build's COPY), kept open `idle_seconds`
    between uses, at most `most` of them: a new PostgreSQL session for each use cost about 6 ms of CPU, client and
    server. The caller bounds how many it uses at once (the worker's build slots).

    A kept connection is asked one bounded round trip before it is used: a server that went silent behind a live
    peer (a failed-over primary whose host still takes packets) answers nothing, and the kernel's keepalives see no
    fault there, so without the question the long statement would wait on it for good. One that does not answer is
    terminated with every other kept one (made to the same server), and a new connection is made as a first one
    is, host by host. A connection its user leaves unusable (a COPY abandoned midway) is terminated, never kept."""

    def __init__(self, kind: str, url: str, bounds: Bounds | None = None, *, most: int,
                 idle_seconds: float = 30.0) -> None:
        self.kind = kind
        self.dsn = asyncpg_dsn(url)
        self.bounds = Bounds.defaults() if bounds is None else bounds
        self.most = most
        self.idle_seconds = idle_seconds
        self._idle: list[tuple[asyncpg.Connection, asyncio.TimerHandle]] = []  # the most recently used last
        self._in_use = 0
        self._closing: set[asyncio.Task[None]] = set()

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[asyncpg.Connection]:
        """A connection for one use; on any failure or cancellation it is terminated, not kept."""
        conn = await self._take()
        self._in_use += 1
        try:
            yield conn
        except BaseException:
            conn.terminate()
            raise
        finally:
            self._in_use -= 1
        self._keep(conn)

    async def _take(self) -> asyncpg.Connection:
        while self._idle:
            conn, timer = self._idle.pop()
            timer.cancel()
            if await self._answers(conn):
                return conn
            for other, other_timer in self._idle:
                other_timer.cancel()
                other.terminate()
            self._idle.clear()
        return await connect_raw(self.dsn, self.bounds)

    async def _answers(self, conn: asyncpg.Connection) -> bool:
        """Whether a kept connection answers one round trip within a connect's bound; terminated when not."""
        try:
            async with asyncio.timeout(self.bounds.connect_seconds):
                await conn.fetchval("SELECT 1")
            return True
        except BaseException as exc:
            conn.terminate()
            if not isinstance(exc, Exception):
                raise  # the user was cancelled while it asked
            log.warning("a kept %s connection did not answer (%s): making a new one", self.kind,
                        errors.describe(exc))
            return False

    def _keep(self, conn: asyncpg.Connection) -> None:
        if conn.is_closed():
            return
        if len(self._idle) + self._in_use >= self.most:
            self._close(conn)
            return
        timer = asyncio.get_running_loop().call_later(self.idle_seconds, self._expire, conn)
        self._idle.append((conn, timer))

    def _expire(self, conn: asyncpg.Connection) -> None:
        self._idle = [(kept, timer) for kept, timer in self._idle if kept is not conn]
        self._close(conn)

    def _close(self, conn: asyncpg.Connection) -> None:
        """A goodbye to the server, bounded: one that does not answer is terminated (asyncpg's close does that)."""
        async def close() -> None:
            with contextlib.suppress(Exception):
                await conn.close(timeout=self.bounds.connect_seconds)

        task = asyncio.create_task(close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """Close the kept connections; those in use are their users' to end."""
        idle, self._idle = self._idle, []
        for conn, timer in idle:
            timer.cancel()
            self._close(conn)
        if self._closing:
            await asyncio.wait(set(self._closing))


def _alembic_config(connection: Connection | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = connection
    return config


# The worker's preflight (starter/preflight.py) reads the schema revision as the application role, and the
# migrations leave alembic_version to its owner: every migration run, online or as --sql, grants that one read.
# Idempotent, and skipped where there is no table or no role yet.
GRANT_REVISION_READ = """DO $$ BEGIN
    IF to_regclass('alembic_version') IS NOT NULL
       AND EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'exports_app') THEN
        GRANT SELECT ON alembic_version TO exports_app;
    END IF;
END $$"""


class UnknownRevision(ValueError):
    """A revision this release's migrations do not contain: one line, nothing changed."""


class MigrationStopped(Exception):
    """An upgrade that failed part way for another reason than a lock: its line says why and which revision the
    database is at; `cause` is the failure, for the kind of answer (refused, or PostgreSQL lost)."""

    def __init__(self, line: str, cause: Exception) -> None:
        super().__init__(line)
        self.cause = cause


class MigrationLocked(Exception):
    """A migration waited its bound for a lock another session holds, and rolled back; an upgrade keeps the
    migrations it committed before it (the line says which revision the database is at)."""


@lru_cache(maxsize=1)
def _scripts() -> ScriptDirectory:
    return ScriptDirectory.from_config(_alembic_config())


def head_revision() -> str:
    """The newest revision this release ships (store/migrations/versions): the one its code needs."""
    head = _scripts().get_current_head()  # raises where the migrations have several heads
    if head is None:
        raise RuntimeError(f"no migrations in {MIGRATIONS}")
    return head


def revision_module(revision: str) -> ModuleType:
    """A migration's module, for what it defines (e.g. the columns a grant names)."""
    return _scripts().get_revision(revision).module


def known_revisions() -> list[str]:
    """Every revision this release ships, oldest first."""
    return [script.revision for script in reversed(list(_scripts().walk_revisions()))]


def newer_revision_line(revision: str) -> str:
    """What to do about a database that a newer release migrated (its revision is not one of ours)."""
    head = head_revision()
    return (f"database at revision {revision}, which this release does not know (newer than {head}): run the "
            f"newer release's worker, or roll the database back with the newer release's "
            f"`exports migrate --to {head}`")


def resolve_revision(revision: str) -> str:
    """`revision` as one of ours (`head` is the newest), else UnknownRevision."""
    if revision == "head":
        return head_revision()
    known = known_revisions()
    if revision not in known:
        raise UnknownRevision(f"unknown revision {revision!r}: this release knows {', '.join(known)} (or head)")
    return revision


def _is_below(target: str, current: str) -> bool:
    """Whether `target` comes before `current` in the chain: reaching it is a downgrade."""
    return target != current and any(script.revision == target
                                     for script in _scripts().iterate_revisions(current, "base"))


async def database_revision(conn: asyncpg.Connection) -> str | None:
    """The revision recorded in the database (alembic_version), None when it was never migrated. A role that may
    not read the table gets asyncpg's InsufficientPrivilegeError."""
    if await conn.fetchval("SELECT to_regclass('alembic_version') IS NULL"):
        return None
    revision: str | None = await conn.fetchval("SELECT version_num FROM alembic_version")
    return revision


# The advisory lock that serialises migrations (pg_advisory_lock's bigint, held by the session): "exports migrate".
MIGRATION_LOCK_KEY = int.from_bytes(b"xmigrate", "big") & 0x7FFF_FFFF_FFFF_FFFF
# How long a migration waits for another to finish before it gives up (MigrationLocked; run it again).
MIGRATION_WAIT_SECONDS = 300
# The session's turn among migrations (online and in the printed script alike).
TAKE_TURN = f"SELECT pg_advisory_lock({MIGRATION_LOCK_KEY})"


def _lock_timeout(seconds: float) -> str:
    """The session's bound on each lock wait."""
    return f"SET lock_timeout = {int(seconds * 1000)}"


async def migrate(owner_url: str, revision: str = "head", *, lock_timeout_seconds: float = 10.0,
                  then: Sequence[str] = ()) -> tuple[str | None, str]:
    """Bring the schema to `revision` (the newest by default), up or down, as the owner role; returns (the
    revision before, the revision now). Safe to run again: Alembic skips what is applied. A target this release
    does not know, or a database that a newer release migrated, is UnknownRevision, before any change.

    An upgrade commits each migration on its own, so a lock it takes lasts only as long as that migration: a table
    altered early is read again while a later index builds, and the previous release's workers go on during a
    rolling deploy. One that fails keeps the migrations before it, each a revision the previous release runs on;
    the same command goes on from there. A downgrade runs in one transaction, all or nothing: a rollback left half
    done would be at a revision that neither release runs on.

    Each lock is waited for at most `lock_timeout_seconds`, then MigrationLocked: a DDL statement queued behind a
    long transaction would hold every worker's statement on that table behind it, for as long. `then`: statements
    run after the migrations (the worker's grants) while this run still holds the migration lock, so that they too
    are run by one migration at a time (concurrent GRANTs on one object fail: "tuple concurrently updated")."""
    target = resolve_revision(revision)
    # No statement bound: a migration's DDL may rightly run long; its lock waits have lock_timeout_seconds.
    engine = make_engine(owner_url, pool_size=1, max_overflow=0, bounds=replace(Bounds.defaults(),
                                                                                  statement_seconds=None))

    def run(sync_conn: Connection) -> str | None:
        # One migration at a time (every worker pod runs one as it starts): the others wait here, without holding
        # anything another session waits for, then find nothing to apply. Without it, two at once collided on
        # the same DDL and the later failed. The session holds it across the migrations' transactions; closing
        # the session (the engine's dispose, below) gives it back however the run ends.
        sync_conn.exec_driver_sql(_lock_timeout(MIGRATION_WAIT_SECONDS))
        try:
            sync_conn.exec_driver_sql(TAKE_TURN)
        except Exception as exc:
            if errors.is_lock_timeout(exc):
                raise MigrationLocked(f"another `exports migrate` kept the migration lock for "
                                      f"{MIGRATION_WAIT_SECONDS} s: nothing changed; run it again") from None
            raise
        try:
            sync_conn.exec_driver_sql(_lock_timeout(lock_timeout_seconds))
            current = MigrationContext.configure(sync_conn).get_current_revision()
            sync_conn.commit()  # Alembic begins a transaction of each migration only on a connection outside one
        except Exception as exc:
            raise _stopped(exc, lock_timeout_seconds, None, None, "the read of the database's revision",
                           None) from None
        if current is not None and current not in known_revisions():
            raise UnknownRevision(newer_revision_line(current))
        config = _alembic_config(sync_conn)
        if current is not None and _is_below(target, current):
            try:
                command.downgrade(config, target)
            except Exception as exc:
                raise _stopped(exc, lock_timeout_seconds, current, current, f"the downgrade to {target}",
                               target) from None
        else:
            config.attributes["transaction_per_migration"] = True
            reached = current
            # One at a time, so that the revision reached is known: each returns once its transaction committed.
            for step in _upgrade_path(current, target):
                try:
                    command.upgrade(config, step)
                except Exception as exc:
                    raise _stopped(exc, lock_timeout_seconds, current, reached, f"the migration to {step}",
                                   step) from None
                reached = step
        try:
            sync_conn.exec_driver_sql(GRANT_REVISION_READ)
            for statement in then:
                sync_conn.exec_driver_sql(statement)
            sync_conn.commit()
        except Exception as exc:
            raise _stopped(exc, lock_timeout_seconds, current, target, "the grants after the migrations",
                           None) from None
        return current

    try:
        async with engine.connect() as conn:
            before = await conn.run_sync(run)
    finally:
        await engine.dispose()
    return before, target


def _upgrade_path(current: str | None, target: str) -> list[str]:
    """The revisions an upgrade from `current` applies to reach `target`, oldest first."""
    if current == target:
        return []
    return [script.revision for script in reversed(list(_scripts().iterate_revisions(target, current or "base")))
            if script.revision != current]


def _stopped(exc: Exception, lock_timeout_seconds: float, before: str | None, reached: str | None, failed: str,
             failed_revision: str | None) -> Exception:
    """What a migration run that failed part way says: why, and the revision the database is at. An upgrade keeps
    the migrations it committed before the failed one; a downgrade, one transaction, keeps none."""
    if reached == before:
        kept = "nothing changed"
    else:
        kept = f"the migrations before it are kept: the database is at revision {reached} (from {before or 'empty'})"
    if errors.is_lock_timeout(exc):
        return MigrationLocked(f"the migration waited {lock_timeout_seconds:g} s for a lock that another session holds "
                               f"(a long transaction, or a statement of a running worker) and rolled back; {kept}; "
                               f"run it again")
    if errors.is_uncertain(exc):
        # Its commit may have been the statement in flight: only the database knows, and a run again reads it.
        went = (f", unless it was committing as the connection went (then at {failed_revision})"
                if failed_revision else "")
        return MigrationStopped(f"the connection to PostgreSQL was lost during {failed} ({errors.describe(exc)}); "
                                f"{kept}{went}; run it again: it goes on from the revision the database records",
                                exc)
    return MigrationStopped(f"{failed} failed and rolled back: {errors.describe(exc)}; {kept}; mend the cause and "
                            f"run it again", exc)


def migration_sql(from_revision: str | None = None, to_revision: str = "head", *,
                  lock_timeout_seconds: float = 10.0) -> str:
    """The SQL that `migrate` would run, for a DBA to review or apply with psql (Alembic's offline mode): from
    an empty database, or from `from_revision` (the one recorded in the database's alembic_version), to
    `to_revision`; a downgrade when that comes before `from_revision`. As online, an upgrade's migrations are a
    transaction each (psql -v ON_ERROR_STOP=1 stops at a failed one, with those before it kept and recorded), a
    downgrade one transaction. Like `migrate`, the script first takes the migration lock (so that it and the
    workers' `exports migrate` take turns) and bounds each lock wait by `lock_timeout_seconds`; both hold for the
    psql session. Connects to nothing. A revision this
    release does not know is UnknownRevision (a ValueError)."""
    target = resolve_revision(to_revision)
    start = None if from_revision is None else resolve_revision(from_revision)
    config = _alembic_config()
    out = io.StringIO()
    config.attributes["output_buffer"] = out
    try:
        if start is not None and _is_below(target, start):
            command.downgrade(config, f"{start}:{target}", sql=True)
        else:
            config.attributes["transaction_per_migration"] = True
            command.upgrade(config, target if start is None else f"{start}:{target}", sql=True)
    except CommandError as exc:
        raise ValueError(str(exc)) from None
    text = _session_preamble(lock_timeout_seconds, start) + out.getvalue()
    # Inside the script's last transaction, as the online run does it after the migrations.
    body, commit, rest = text.rpartition("COMMIT;")
    if not commit:
        return f"{text}{GRANT_REVISION_READ};\n"
    return f"{body}{GRANT_REVISION_READ};\n\n{commit}{rest}"


def _session_preamble(lock_timeout_seconds: float, start: str | None) -> str:
    """The script's first statements, what `migrate` does on its session before the migrations: take turns, bound
    each lock wait, and check that the database is at the revision the script starts from (`start`, None: empty),
    as `migrate` reads it, so that a script printed for another revision changes nothing."""
    expected = "NULL" if start is None else f"'{start}'"
    printed_for = "'(empty)'" if start is None else expected
    return (f"-- One migration at a time, as `exports migrate` takes turns: wait at most {MIGRATION_WAIT_SECONDS} s "
            f"for another.\n"
            f"{_lock_timeout(MIGRATION_WAIT_SECONDS)};\n"
            f"{TAKE_TURN};\n"
            f"-- Each lock a migration needs is waited for at most {lock_timeout_seconds:g} s: a DDL statement queued "
            f"behind a long\n-- transaction would hold every statement on its table behind it. Past it, psql stops "
            f"(ON_ERROR_STOP):\n-- run the script again from the revision reached (--from).\n"
            f"{_lock_timeout(lock_timeout_seconds)};\n"
            f"-- Written for a database at revision {start or '(empty)'}: at any other, it stops here, changing "
            f"nothing.\n"
            f"DO $$ DECLARE found text; BEGIN\n"
            f"    IF to_regclass('alembic_version') IS NOT NULL THEN\n"
            f"        EXECUTE 'SELECT max(version_num) FROM alembic_version' INTO found;\n"
            f"    END IF;\n"
            f"    IF found IS DISTINCT FROM {expected} THEN\n"
            f"        RAISE EXCEPTION 'the database is at revision %, and this script was printed for %: print it "
            f"again with --from %', coalesce(found, '(empty)'), {printed_for}, coalesce(found, '(none)');\n"
            f"    END IF;\n"
            f"END $$;\n\n")


