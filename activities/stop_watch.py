"""The stop watcher: hears a stop request the moment the cancellation's row write commits (LISTEN/NOTIFY), and
confirms it against the row before stopping the build. It is for speed only: cutoff 2 refuses delivery to a
stopped attempt whether or not this watcher heard anything."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from uuid import UUID

import asyncpg

from store.jobs import JobStore
from store.models import Status

log = logging.getLogger(__name__)

CHANNEL = "exports_stop"


class StopWatch:
    def __init__(self, store: JobStore, dsn: str, job_id: UUID, attempt_id: UUID, on_stop: Callable[[], None]):
        self.store = store
        self.dsn = dsn
        self.job_id = job_id
        self.attempt_id = attempt_id
        self.on_stop = on_stop
        self._conn: asyncpg.Connection | None = None
        self._confirming: asyncio.Task[None] | None = None
        self._again = False

    async def __aenter__(self) -> StopWatch:
        try:
            self._conn = await asyncpg.connect(self.dsn)
            await self._conn.add_listener(CHANNEL, self._notified)
        except Exception as exc:  # the build goes on; the cancel signal and cutoff 2 still stop it
            log.warning("stop watcher for %s unavailable: %s", self.job_id, exc)
        # A stop recorded before we listened would never be notified again: look once now.
        self._confirming = asyncio.create_task(self._confirm())
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._confirming is not None and not self._confirming.done():
            self._confirming.cancel()
        if self._conn is not None:
            self._conn.terminate()

    def _notified(self, conn: object, pid: int, channel: str, payload: object) -> None:
        if payload != str(self.job_id):
            return
        if self._confirming is None or self._confirming.done():
            self._confirming = asyncio.create_task(self._confirm())
        else:
            # A read already under way may have started before this stop committed: read once more after it.
            self._again = True

    async def _confirm(self) -> None:
        while True:
            self._again = False
            try:
                row = await self.store.read_job(self.job_id)
            except Exception as exc:
                log.warning("could not confirm a stop request for %s: %s", self.job_id, exc)
                return
            if (row is not None and row.status is Status.RUNNING and row.attempt_id == self.attempt_id
                    and row.stop_request_id is not None):
                log.info("stop request %s confirmed for %s attempt %s", row.stop_request_id, self.job_id,
                         self.attempt_id)
                self.on_stop()
                return
            if not self._again:
                return
