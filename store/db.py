"""Engines per database role, raw asyncpg connections for COPY and LISTEN, and migrations."""

from __future__ import annotations

import io
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import asyncpg
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import event
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import ConnectionPoolEntry, PoolProxiedConnection

from store import errors

MIGRATIONS = Path(__file__).parent / "migrations"


# What sslmode (or its SQLAlchemy spelling, ssl) may say: libpq's modes, as asyncpg reads them.
SSL_MODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
# Query parameters SQLAlchemy's asyncpg dialect reads itself; every other one is the connection's, read by asyncpg.
_DIALECT_PARAMS = ("prepared_statement_cache_size",)


def make_engine(url: str, *, pool_size: int = 5, max_overflow: int | None = None) -> AsyncEngine:
    """A pooled engine. The URL's connection parameters (host, port, sslmode, sslrootcert, passfile, ...) and the
    PG* variables are read by asyncpg as libpq reads them, not by SQLAlchemy (see asyncpg_dsn)."""
    if not url:
        raise ValueError("no database URL configured (EXPORTS_DATABASE_URL, or start `exports dev`)")
    dsn = asyncpg_dsn(url)
    engine = create_async_engine(url, pool_size=pool_size,
                                 max_overflow=pool_size if max_overflow is None else max_overflow)

    @event.listens_for(engine.sync_engine, "do_connect")
    def _libpq_parameters(dialect: Dialect, connection_record: ConnectionPoolEntry, cargs: list[Any],
                          cparams: dict[str, Any]) -> None:
        # SQLAlchemy hands every query parameter to asyncpg.connect() as a keyword, which has none for sslmode,
        # sslrootcert, sslcert or passfile: the whole URL goes as asyncpg's DSN instead, which reads them all.
        kept = {key: cparams[key] for key in _DIALECT_PARAMS if key in cparams}
        cparams.clear()
        cparams.update(kept, dsn=dsn)

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
    """The same URL in the form asyncpg itself accepts: its libpq parameters (sslmode, sslrootcert, host, ...)
    as they are, `ssl=<mode>` (SQLAlchemy's spelling) as `sslmode=<mode>`, without the dialect's own
    parameters. Anything the URL leaves out, asyncpg takes from PGHOST, PGPORT, PGUSER, PGPASSWORD, PGDATABASE,
    PGSSLMODE, PGSSLROOTCERT, PGPASSFILE, ... as libpq does. A malformed sslmode is a ValueError."""
    if url.startswith("postgresql+asyncpg://"):
        url = "postgresql://" + url[len("postgresql+asyncpg://"):]
    parts = urlsplit(url)
    if not parts.query:
        return url
    params = []
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key in _DIALECT_PARAMS:
            continue
        if key in ("ssl", "sslmode"):
            if value not in SSL_MODES:
                raise ValueError(f"{key}={value!r} in the database URL: expected one of {', '.join(SSL_MODES)}")
            key = "sslmode"
        params.append((key, value))
    if sum(key == "sslmode" for key, _ in params) > 1:
        raise ValueError("the database URL gives sslmode (or ssl) more than once")
    return urlunsplit(parts._replace(query=urlencode(params, safe="/:")))


async def connect_raw(url: str) -> asyncpg.Connection:
    return await asyncpg.connect(asyncpg_dsn(url))


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


class MigrationLocked(Exception):
    """A migration waited its bound for a lock another session holds, and rolled back: nothing changed."""


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


async def migrate(owner_url: str, revision: str = "head", *,
                  lock_timeout_seconds: float = 10.0) -> tuple[str | None, str]:
    """Bring the schema to `revision` (the newest by default), up or down, as the owner role, in one transaction;
    returns (the revision before, the revision now). Safe to run again: Alembic skips what is applied. A target
    this release does not know, or a database that a newer release migrated, is UnknownRevision, before any
    change. Each lock is waited for at most `lock_timeout_seconds`, then MigrationLocked: a DDL statement queued
    behind a long transaction would hold every worker's statement on that table behind it, for as long."""
    target = resolve_revision(revision)
    engine = make_engine(owner_url, pool_size=1, max_overflow=0)

    def run(sync_conn: Connection) -> str | None:
        sync_conn.exec_driver_sql(f"SET LOCAL lock_timeout = {int(lock_timeout_seconds * 1000)}")
        current = MigrationContext.configure(sync_conn).get_current_revision()
        if current is not None and current not in known_revisions():
            raise UnknownRevision(newer_revision_line(current))
        config = _alembic_config(sync_conn)
        if current is not None and _is_below(target, current):
            command.downgrade(config, target)
        else:
            command.upgrade(config, target)
        return current

    try:
        async with engine.begin() as conn:
            before = await conn.run_sync(run)
            await conn.exec_driver_sql(GRANT_REVISION_READ)
    except Exception as exc:
        if errors.is_lock_timeout(exc):
            raise MigrationLocked(f"the migration waited {lock_timeout_seconds:g} s for a lock that another session "
                                  "holds (a long transaction, or a statement of a running worker) and rolled back: "
                                  "nothing changed; run it again") from None
        raise
    finally:
        await engine.dispose()
    return before, target


def migration_sql(from_revision: str | None = None, to_revision: str = "head") -> str:
    """The SQL that `migrate` would run, for a DBA to review or apply with psql (Alembic's offline mode): from
    an empty database, or from `from_revision` (the one recorded in the database's alembic_version), to
    `to_revision`; a downgrade when that comes before `from_revision`. Connects to nothing. A revision this
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
            command.upgrade(config, target if start is None else f"{start}:{target}", sql=True)
    except CommandError as exc:
        raise ValueError(str(exc)) from None
    text = out.getvalue()
    # Inside the script's one transaction, as the online run does it.
    body, commit, rest = text.rpartition("COMMIT;")
    if not commit:
        return f"{text}{GRANT_REVISION_READ};\n"
    return f"{body}{GRANT_REVISION_READ};\n\n{commit}{rest}"
