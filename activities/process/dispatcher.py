"""The outbox dispatcher: publishes each outbox row as signal-with-start of the export's workflow.

Runs under the dispatcher role, which may read the outbox and set published_at and nothing else. It wakes on
LISTEN (a trigger notifies on every outbox insert) and polls as a fallback. A row whose publication fails stays
unpublished and is retried with the same message ID, which the workflow uses to ignore a second delivery of one
row, so publishing a row twice is harmless.

No row lock is held while Temporal is asked: a Temporal that does not answer would hold them for as long as its
client retries, once per row. Instead a pass reads the unpublished rows in one short statement, publishes them one
by one outside any transaction, and marks each published row with its own conditional update, all through
store/outbox.py, whose session advisory lock keeps two dispatchers from publishing the same backlog at once. The
first publication that fails ends the pass: Temporal is away, and the next poll tries again.
"""

from __future__ import annotations

import asyncio
import logging
from uuid import UUID

import asyncpg
from temporalio.client import Client

from activities.contracts import ExportInput, Wake
from activities.process.temporal import short_reason
from store import errors
from store.outbox import Outbox
from workflows.identity import export_workflow_id

# The logger keeps the name it had before the module moved into process/: log filters and alerts match on it.
log = logging.getLogger("activities.dispatcher")

NOTIFY_CHANNEL = "exports_outbox"


class OutboxDispatcher:
    def __init__(
        self,
        client: Client,
        outbox: Outbox,
        listen_dsn: str,
        *,
        task_queue: str,
        poll_seconds: float,
        batch: int = 100,
    ) -> None:
        self.client = client
        self.outbox = outbox
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
        async with self.outbox.dispatch_pass() as outbox:
            if outbox is None:
                return 0
            for row in await outbox.pending(self.batch):
                try:
                    await self.publish(row.message_id, row.job_id)
                except Exception as exc:
                    log.warning("outbox row %s (%s for %s) not published, the next pass tries again: %s",
                                row.message_id, row.kind, row.job_id, short_reason(exc))
                    break
                await outbox.mark_published(row.message_id)
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
