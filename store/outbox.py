"""The outbox, as the dispatcher role reads and marks it (the dispatcher itself is activities/process/dispatcher.py).

A pass runs on one session that holds a session advisory lock (a lock on no row): two dispatchers never publish
the same backlog at once, any dispatcher may take the lock, and it goes with the session if its holder dies."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from uuid import UUID

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from store.statements import RoleStore, statement

log = logging.getLogger(__name__)

# One key for every dispatcher of this database (pg_try_advisory_lock's bigint): "exports outbox".
LOCK_KEY = 0x6578706F727473
_TRY_LOCK = text("SELECT pg_try_advisory_lock(:key)")
_UNLOCK = text("SELECT pg_advisory_unlock(:key)")


@dataclass(frozen=True)
class Pending:
    message_id: UUID
    kind: str
    job_id: UUID


class OutboxPass:
    """What a dispatcher may do while it holds the lock; each statement commits on its own."""

    def __init__(self, conn: AsyncConnection) -> None:
        self._conn = conn

    async def pending(self, batch: int) -> list[Pending]:
        rows = (await self._conn.execute(statement("outbox_pending"), {"batch": batch})).all()
        await self._conn.commit()
        return [Pending(*row) for row in rows]

    async def mark_published(self, message_id: UUID) -> bool:
        """False when the row was marked already (by a dispatcher that held the lock before)."""
        marked = (await self._conn.execute(statement("outbox_mark_published"), {"message_id": message_id})).rowcount
        await self._conn.commit()
        return marked == 1


class Outbox(RoleStore):
    @asynccontextmanager
    async def dispatch_pass(self) -> AsyncIterator[OutboxPass | None]:
        """One pass on one session holding the outbox lock; None when another dispatcher holds it."""
        async with self.db.connection() as conn:
            locked = await conn.scalar(_TRY_LOCK, {"key": LOCK_KEY})
            await conn.commit()
            if not locked:
                yield None
                return
            try:
                yield OutboxPass(conn)
            finally:
                await _unlock(conn)


async def _unlock(conn: AsyncConnection) -> None:
    """Release the advisory lock, or drop the session that holds it: a pooled connection must never keep it."""
    if conn.invalidated:
        return  # the session is gone, and its lock with it
    try:
        await conn.rollback()
        await conn.scalar(_UNLOCK, {"key": LOCK_KEY})
        await conn.commit()
    except Exception as exc:
        log.debug("could not release the outbox lock, dropping its session: %s", exc)
        await conn.invalidate()
