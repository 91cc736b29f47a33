"""Engines per database role, raw asyncpg connections for COPY and LISTEN, and migrations."""

from __future__ import annotations

from pathlib import Path

import asyncpg
from alembic import command
from alembic.config import Config
from sqlalchemy import event
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

MIGRATIONS = Path(__file__).parent / "migrations"


def make_engine(url: str, *, pool_size: int = 5) -> AsyncEngine:
    if not url:
        raise ValueError("no database URL configured (EXPORTS_DATABASE_URL, or start `exports dev`)")
    engine = create_async_engine(url, pool_size=pool_size, max_overflow=pool_size)

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
    """The same URL in the form asyncpg itself accepts."""
    return url.replace("postgresql+asyncpg://", "postgresql://", 1)


async def connect_raw(url: str) -> asyncpg.Connection:
    return await asyncpg.connect(asyncpg_dsn(url))


def _alembic_config(connection: Connection) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = connection
    return config


async def migrate(owner_url: str) -> None:
    """Apply every migration as the owner role. Safe to run again: Alembic skips what is applied."""
    engine = create_async_engine(owner_url)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(lambda sync_conn: command.upgrade(_alembic_config(sync_conn), "head"))
    finally:
        await engine.dispose()
