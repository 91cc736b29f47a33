"""Engines per database role, raw asyncpg connections for COPY and LISTEN, and migrations."""

from __future__ import annotations

import io
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import asyncpg
from alembic import command
from alembic.config import Config
from alembic.util import CommandError
from sqlalchemy import event
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

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
    def _libpq_parameters(dialect, connection_record, cargs, cparams) -> None:
        # SQLAlchemy hands every query parameter to asyncpg.connect() as a keyword, which has none for sslmode,
        # sslrootcert, sslcert or passfile: the whole URL goes as asyncpg's DSN instead, which reads them all.
        kept = {key: cparams[key] for key in _DIALECT_PARAMS if key in cparams}
        cparams.clear()
        cparams.update(kept, dsn=dsn)

    @event.listens_for(engine.sync_engine, "checkout")
    def _replace_closed(dbapi_connection, connection_record, connection_proxy) -> None:
        # asyncpg notices, without a round trip, a connection the server or the network closed (a restart, a
        # cut), and the pool then replaces it. pool_pre_ping would ask the server instead: three round trips
        # (BEGIN, a ping, ROLLBACK) before every statement. A connection that died silently fails its statement,
        # which the store treats as an uncertain answer, and the pool drops every connection older than that.
        if connection_record.driver_connection.is_closed():
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


async def migrate(owner_url: str) -> None:
    """Apply every migration as the owner role. Safe to run again: Alembic skips what is applied."""
    engine = make_engine(owner_url, pool_size=1, max_overflow=0)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(lambda sync_conn: command.upgrade(_alembic_config(sync_conn), "head"))
    finally:
        await engine.dispose()


def migration_sql(from_revision: str | None = None) -> str:
    """The SQL that `migrate` would run, for a DBA to review or apply with psql (Alembic's offline mode): from
    an empty database, or from `from_revision` (the one recorded in the database's alembic_version). Connects
    to nothing. A revision Alembic does not know is a ValueError."""
    config = _alembic_config()
    out = io.StringIO()
    config.attributes["output_buffer"] = out
    target = "head" if from_revision is None else f"{from_revision}:head"
    try:
        command.upgrade(config, target, sql=True)
    except CommandError as exc:
        raise ValueError(str(exc)) from None
    return out.getvalue()
