"""The documented statements, one .sql file each, loaded by name."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
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


@contextmanager
def _domain_errors() -> Iterator[None]:
    """A constraint violation or a refused privilege leaves as its domain error; anything else as it is."""
    try:
        yield
    except errors.StoreError:
        raise
    except Exception as exc:
        translated = errors.translate(exc)
        if translated is exc:
            raise
        raise translated from exc


@asynccontextmanager
async def transaction(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """One transaction, its errors as domain errors."""
    with _domain_errors():
        async with engine.begin() as conn:
            yield conn


async def write(engine: AsyncEngine, name: str, **params: Any) -> int:
    """Run one statement, committed on its own; the row count of its outer command. A single statement is atomic
    without a transaction block (its deferred checks run at its implicit commit), so BEGIN and COMMIT would only
    add two round trips."""
    with _domain_errors():
        async with engine.connect() as conn:
            conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
            return (await conn.execute(statement(name), params)).rowcount


async def fetch_one(conn: AsyncConnection, name: str, **params: Any) -> dict[str, Any] | None:
    row = (await conn.execute(statement(name), params)).mappings().first()
    return dict(row) if row is not None else None
