"""The outbox dispatcher: publishes each outbox row as signal-with-start of the export's workflow.

Runs under the dispatcher role, which may read the outbox and set published_at and nothing else. It wakes on
LISTEN (a trigger notifies on every outbox insert) and polls as a fallback. A row whose publication fails stays
unpublished and is retried with the same message ID, which the workflow uses to ignore a second delivery of one
row, so publishing a row twice is harmless.

No row lock is held while Temporal is asked: a Temporal that does not answer would hold them for as long as its
client retries, once per row. Instead a pass reads the unpublished rows in one short statement, publishes them one
by one outside any transaction, and marks each published row with its own conditional update. A session advisory
lock (a lock on no row) keeps two dispatchers from publishing the same backlog at once; any dispatcher may take
it, and it goes with the session if its holder dies. The first publication that fails ends the pass: Temporal is
away, and the next poll tries again.
"""

from __future__ import annotations

import asyncio
import logging
from uuid import UUID

import asyncpg
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from temporalio.client import Client

from activities.contracts import ExportInput, Wake
from starter.temporal import short_reason
from store import errors
from workflows.identity import export_workflow_id

log = logging.getLogger(__name__)

NOTIFY_CHANNEL = "exports_outbox"
_PENDING = text(
    "SELECT message_id, kind, job_id FROM outbox WHERE published_at IS NULL ORDER BY created_at LIMIT :batch"
)
_MARK = text(
    "UPDATE outbox SET published_at = clock_timestamp() WHERE message_id = :message_id AND published_at IS NULL"
)
# One key for every dispatcher of this database (pg_try_advisory_lock's bigint): "exports outbox".
_LOCK_KEY = 0x6578706F727473
_TRY_LOCK = text("SELECT pg_try_advisory_lock(:key)")
_UNLOCK = text("SELECT pg_advisory_unlock(:key)")


class OutboxDispatcher:
    def __init__(
        self,
        client: Client,
        engine: AsyncEngine,
        listen_dsn: str,
        *,
        task_queue: str,
        poll_seconds: float,
        batch: int = 100,
    ) -> None:
        self.client = client
        self.engine = engine
        self.listen_dsn = listen_dsn
        self.task_queue = task_queue
        self.poll_seconds = poll_seconds
        self.batch = batch
        self._nudged = asyncio.Event()
        self._failing = False

    async def publish(self, message_id: UUID, job_id: UUID) -> None:
        await self.client.start_workflow(
            "ExportWorkflow",
            ExportInput(job_id=job_id),
            id=export_workflow_id(job_id),
            task_queue=self.task_queue,
            start_signal="wake",
            start_signal_args=[Wake(message_id=message_id)],
        )

    async def dispatch_once(self) -> int:
        """Publish one batch of unpublished rows; the number published (0 while another dispatcher publishes)."""
        published = 0
        async with self.engine.connect() as conn:
            locked = await conn.scalar(_TRY_LOCK, {"key": _LOCK_KEY})
            await conn.commit()
            if not locked:
                return 0
            try:
                rows = (await conn.execute(_PENDING, {"batch": self.batch})).all()
                await conn.commit()
                for message_id, kind, job_id in rows:
                    try:
                        await self.publish(message_id, job_id)
                    except Exception as exc:
                        log.warning("outbox row %s (%s for %s) not published, the next pass tries again: %s",
                                    message_id, kind, job_id, short_reason(exc))
                        break
                    await conn.execute(_MARK, {"message_id": message_id})
                    await conn.commit()
                    published += 1
            finally:
                await self._unlock(conn)
        return published

    @staticmethod
    async def _unlock(conn: AsyncConnection) -> None:
        """Release the advisory lock, or drop the session that holds it: a pooled connection must never keep it."""
        if conn.invalidated:
            return  # the session is gone, and its lock with it
        try:
            await conn.rollback()
            await conn.scalar(_UNLOCK, {"key": _LOCK_KEY})
            await conn.commit()
        except Exception as exc:
            log.debug("could not release the outbox lock, dropping its session: %s", exc)
            await conn.invalidate()

    async def run(self, stop: asyncio.Event) -> None:
        listener = await self._listen()
        try:
            while not stop.is_set():
                self._nudged.clear()
                try:
                    while await self.dispatch_once() == self.batch:
                        pass
                except Exception as exc:  # the database is away: said once, and tried again at each poll
                    self._failed(f"outbox dispatch failed, trying again every {self.poll_seconds:g} s: "
                                 f"{errors.describe(exc)}")
                else:
                    if self._failing:
                        log.info("outbox dispatch works again")
                    self._failing = False
                if listener is None or listener.is_closed():
                    listener = await self._listen()
                waiters = [asyncio.ensure_future(self._nudged.wait()), asyncio.ensure_future(stop.wait())]
                await asyncio.wait(waiters, timeout=self.poll_seconds, return_when=asyncio.FIRST_COMPLETED)
                for waiter in waiters:
                    waiter.cancel()
        finally:
            if listener is not None:
                await listener.close()

    async def _listen(self) -> asyncpg.Connection | None:
        try:
            conn = await asyncpg.connect(self.listen_dsn)
            await conn.add_listener(NOTIFY_CHANNEL, lambda *args: self._nudged.set())
            return conn
        except Exception as exc:
            self._failed(f"LISTEN {NOTIFY_CHANNEL} unavailable, polling only: {errors.describe(exc)}")
            return None

    def _failed(self, message: str) -> None:
        """One warning when an outage begins; while it lasts, the same news at debug level."""
        (log.debug if self._failing else log.warning)(message)
        self._failing = True
