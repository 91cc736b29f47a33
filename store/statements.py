"""The documented statements, one .sql file each, loaded by name, and the one way the store reaches a database role.

`Database` is that way: every read, write and transaction of the store runs through it, so every driver error
leaves as store/errors.py's answer (a domain error, or the driver's own connection error), and every conditional
write has one path for an uncertain answer: a bounded re-read with the statement documented for it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractContextManager, asynccontextmanager, contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Generic, TypeVar, overload

from opentelemetry import trace
from sqlalchemy import TextClause, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.sql import Executable

from store import errors

SQL_DIR = Path(__file__).parent / "sql"

log = logging.getLogger(__name__)

# A write's row count: an int where it is always known (a write asked without a re-read raises an uncertain answer),
# int | None where a re-read may answer instead of it.
Count = TypeVar("Count", bound=int | None)


# The API alone: without a configured provider (EXPORTS_TRACING=off) its spans are no-ops that cost a call.
_tracer = trace.get_tracer("store.statements")


def sql_span(name: str) -> AbstractContextManager[trace.Span]:
    """One span per named statement run, under the activity's span when tracing is on."""
    return _tracer.start_as_current_span(f"sql {name}", kind=trace.SpanKind.CLIENT,
                                         attributes={"db.system": "postgresql", "db.operation.name": name})


@cache
def statement(name: str) -> TextClause:
    return text((SQL_DIR / f"{name}.sql").read_text())


def _executable(query: str | Executable) -> Executable:
    return statement(query) if isinstance(query, str) else query


@contextmanager
def translated() -> Iterator[None]:
    """A constraint violation or a refused privilege leaves as its domain error; anything else as it is (so a
    lost connection stays what errors.is_uncertain recognises)."""
    try:
        yield
    except errors.StoreError:
        raise
    except Exception as exc:
        answer = errors.translate(exc)
        if answer is exc:
            raise
        raise answer from exc


@dataclass(frozen=True)
class Reread:
    """The statement that says, when a write's answer is lost or it changed nothing, what the row holds."""

    name: str
    params: dict[str, Any]
    # Also asked when the write answered that it changed nothing (the row then says why, or that it had committed).
    when_unchanged: bool = True


@dataclass(frozen=True)
class Written(Generic[Count]):
    """What a conditional write learnt. `count` is the statement's row count (of its outer command), None when its
    answer was lost (only a write with a re-read answers so). `row` is the re-read's row (None also when it found
    none), and `unanswered` the re-read's own error when it could not be asked either (a lost connection, or past
    its bound)."""

    count: Count
    row: dict[str, Any] | None = None
    unanswered: BaseException | None = None

    @property
    def changed(self) -> bool:
        return self.count == 1

    @property
    def uncertain(self) -> bool:
        return self.count is None


def storable(value: Any) -> Any:
    """What the store records about a partner (its messages, what its files hold, an exception's text) as
    PostgreSQL can keep it: a NUL, which no text or jsonb value may hold, becomes U+FFFD, in strings at any depth.
    A partner that sends one, broken or lying, must not make the record of its export impossible: the refused
    write left the export Delivering for good, and the follow-up's look failed at every run. An operator's input
    is refused instead, before it comes here (the contracts' checks)."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {storable(key): storable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [storable(item) for item in value]
    return value


def evidence_json(detail: dict[str, Any]) -> str:
    """An evidence record's detail as the jsonb the statements take, storable."""
    return json.dumps(storable(detail), sort_keys=True, default=lambda other: storable(str(other)))


class Database:
    """One database role's engine, as the store uses it: reads, single statements, transactions."""

    def __init__(self, engine: AsyncEngine, *, reread_timeout_seconds: float = 5.0) -> None:
        self.engine = engine
        self.reread_timeout_seconds = reread_timeout_seconds

    # --- reads -------------------------------------------------------------------------------------------------

    async def rows(self, query: str | Executable, **params: Any) -> list[dict[str, Any]]:
        """A named statement's rows, or a query's: one statement on its own (`_alone`), one round trip."""
        with translated():
            async with self._alone() as conn:
                return [dict(r) for r in (await conn.execute(_executable(query), params)).mappings().all()]

    async def row(self, query: str | Executable, **params: Any) -> dict[str, Any] | None:
        with translated():
            async with self._alone() as conn:
                found = (await conn.execute(_executable(query), params)).mappings().first()
        return dict(found) if found is not None else None

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[AsyncConnection]:
        """One connection for several reads."""
        with translated():
            async with self.engine.connect() as conn:
                yield conn

    async def ping(self) -> None:
        """One connection and `SELECT 1`."""
        with translated():
            async with self.engine.connect() as conn:
                await conn.exec_driver_sql("SELECT 1")

    # --- writes ------------------------------------------------------------------------------------------------

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncConnection]:
        """One transaction for several statements; `write(..., conn=)` runs its conditional ones."""
        with translated():
            async with self.engine.begin() as conn:
                yield conn

    @overload
    async def write(self, name: str, *, conn: AsyncConnection | None = None, reread: None = None,
                    **params: Any) -> Written[int]: ...

    @overload
    async def write(self, name: str, *, conn: None = None, reread: Reread, **params: Any) -> Written[int | None]: ...

    async def write(self, name: str, *, conn: AsyncConnection | None = None, reread: Reread | None = None,
                    **params: Any) -> Written[int] | Written[int | None]:
        """Run one conditional statement and answer what it did.

        Alone (no `conn`), it commits on its own (`_alone`). With `conn`, it is one statement of that transaction.
        With `reread`, an uncertain answer (errors.is_uncertain: the statement may or may not have committed) is
        not raised: the row is asked, bounded by
        reread_timeout_seconds so that no caller hangs with the database away, and the caller decides from the row.
        Without it, or for any definite error, the error is raised as its domain error."""
        with sql_span(name):
            if conn is not None:
                if reread is not None:
                    raise ValueError("a re-read asks the row on a connection of its own, not inside a transaction")
                with translated():
                    return Written((await conn.execute(statement(name), params)).rowcount)
            try:
                with translated():
                    async with self._alone() as own:
                        count = (await own.execute(statement(name), params)).rowcount
            except Exception as exc:
                if reread is None or not errors.is_uncertain(exc):
                    raise
                log.warning("%s of export %s is uncertain, asking the row: %s", name, params.get("job_id"),
                            errors.describe(exc))
                return await self._reread(reread, None)
            if count == 1 or reread is None or not reread.when_unchanged:
                return Written(count)
            return await self._reread(reread, count)

    async def write_row(self, name: str, **params: Any) -> dict[str, Any] | None:
        """Run one conditional statement alone (it commits on its own, as `write` does) whose answer is a row: what
        it did, or None when it matched nothing. An uncertain answer is raised, as `write` does without a re-read."""
        with sql_span(name), translated():
            async with self._alone() as own:
                found = (await own.execute(statement(name), params)).mappings().first()
        return dict(found) if found is not None else None

    @asynccontextmanager
    async def _alone(self) -> AsyncIterator[AsyncConnection]:
        """A connection whose statements each commit on their own: a single statement is atomic without a
        transaction block (its deferred checks run at its implicit commit), so BEGIN and COMMIT (or, for a read,
        ROLLBACK) would only add two round trips. A read sees one snapshot either way: its statement's."""
        async with self.engine.connect() as conn:
            yield await conn.execution_options(isolation_level="AUTOCOMMIT")

    async def _reread(self, reread: Reread, count: int | None) -> Written[int | None]:
        try:
            async with asyncio.timeout(self.reread_timeout_seconds):
                row = await self.row(reread.name, **reread.params)
        except Exception as exc:
            # Unanswered, the write still uncertain: a lost or timed-out re-read, and one that found no host as the
            # URL asks (a failover under way, no primary yet): raising that as definite failed a committed cutoff 2.
            if not errors.is_transient(exc):
                raise
            return Written(count, unanswered=exc)
        return Written(count, row=row)


class RoleStore:
    """What each of the store's classes stands on: one role's engine, reached only through `self.db`."""

    def __init__(self, engine: AsyncEngine, *, reread_timeout_seconds: float = 5.0) -> None:
        self.engine = engine
        self.db = Database(engine, reread_timeout_seconds=reread_timeout_seconds)

    @property
    def address(self) -> str:
        """Where it connects, for a message: the URL without its password."""
        return self.engine.url.render_as_string(hide_password=True)

    async def ping(self) -> None:
        await self.db.ping()

    async def aclose(self) -> None:
        """Close the role's connections (its engine's pool)."""
        await self.engine.dispose()


async def fetch_one(conn: AsyncConnection, name: str, **params: Any) -> dict[str, Any] | None:
    """A named statement's first row on a connection of `Database.transaction` or `Database.connection`."""
    with sql_span(name):
        row = (await conn.execute(statement(name), params)).mappings().first()
    return dict(row) if row is not None else None
