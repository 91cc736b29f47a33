"""The outbox dispatcher: publishes each outbox row as signal-with-start of the export's workflow.

Runs under the dispatcher role, which may read the outbox and set published_at and nothing else. It wakes on
LISTEN (a trigger notifies on every outbox insert) and polls as a fallback. Rows are taken with SKIP LOCKED, so
any number of dispatchers can run. A row whose publication fails stays unpublished and is retried with the same
message ID, which the workflow uses to ignore a second delivery of one row.
"""

from __future__ import annotations

import asyncio
import logging
from uuid import UUID

import asyncpg
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio.client import Client

from activities.contracts import ExportInput, Wake
from starter.temporal import workflow_id

log = logging.getLogger(__name__)

NOTIFY_CHANNEL = "exports_outbox"
_TAKE = text(
    "SELECT message_id, kind, job_id FROM outbox WHERE published_at IS NULL "
    "ORDER BY created_at LIMIT :batch FOR UPDATE SKIP LOCKED"
)
_MARK = text("UPDATE outbox SET published_at = clock_timestamp() WHERE message_id = :message_id")


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

    async def publish(self, message_id: UUID, job_id: UUID) -> None:
        await self.client.start_workflow(
            "ExportWorkflow",
            ExportInput(job_id=job_id),
            id=workflow_id(job_id),
            task_queue=self.task_queue,
            start_signal="wake",
            start_signal_args=[Wake(message_id=message_id)],
        )

    async def dispatch_once(self) -> int:
        """Publish one batch of unpublished rows; the number published."""
        published = 0
        async with self.engine.begin() as conn:
            rows = (await conn.execute(_TAKE, {"batch": self.batch})).all()
            for message_id, kind, job_id in rows:
                try:
                    await self.publish(message_id, job_id)
                except Exception as exc:
                    log.warning("outbox row %s (%s for %s) not published, will retry: %s", message_id, kind, job_id, exc)
                    continue
                await conn.execute(_MARK, {"message_id": message_id})
                published += 1
        return published

    async def run(self, stop: asyncio.Event) -> None:
        listener = await self._listen()
        try:
            while not stop.is_set():
                self._nudged.clear()
                try:
                    while await self.dispatch_once() == self.batch:
                        pass
                except Exception as exc:  # the database or Temporal is away: try again at the next poll
                    log.warning("outbox dispatch failed, retrying: %s", exc)
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
            log.warning("LISTEN %s unavailable, polling only: %s", NOTIFY_CHANNEL, exc)
            return None
