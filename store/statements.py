"""The documented statements, one .sql file each, loaded by name."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import cache
from pathlib import Path
from typing import Any

from sqlalchemy import TextClause, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from store import errors

SQL_DIR = Path(__file__).parent / "sql"


@cache
def statement(name: str) -> TextClause:
    return text((SQL_DIR / f"{name}.sql").read_text())


@asynccontextmanager
async def transaction(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """One transaction; a constraint violation or a refused privilege leaves it as its domain error."""
    try:
        async with engine.begin() as conn:
            yield conn
    except errors.StoreError:
        raise
    except Exception as exc:
        translated = errors.translate(exc)
        if translated is exc:
            raise
        raise translated from exc


async def write(engine: AsyncEngine, name: str, **params: Any) -> int:
    """Run one statement, committed on its own; the row count of its outer command. A single statement is atomic
    without a transaction block (its deferred checks run at its implicit commit), so BEGIN and COMMIT would only
    add two round trips."""
    try:
        async with engine.connect() as conn:
            conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
            return (await conn.execute(statement(name), params)).rowcount
    except Exception as exc:
        translated = errors.translate(exc)
        if translated is exc:
            raise
        raise translated from exc


async def fetch_one(conn: AsyncConnection, name: str, **params: Any) -> dict[str, Any] | None:
    row = (await conn.execute(statement(name), params)).mappings().first()
    return dict(row) if row is not None else None
