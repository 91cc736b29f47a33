"""The lease keeper: inside the build and deliver activities, it renews the row lease and heartbeats to Temporal.

Each tick heartbeats (so the activity hears of its cancellation promptly, and Temporal sees it alive); every
`renew_every` it renews the lease with the conditional statement. A renewal that throws is retried at the next
tick and stops nothing. A renewal that changes no row means the attempt lost ownership: `on_lost` is called once.
Renewals are serialized, so an on-demand renewal never overlaps a scheduled one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any
from uuid import UUID

from temporalio import activity

from store.jobs import JobStore

log = logging.getLogger(__name__)


class LeaseKeeper:
    def __init__(
        self,
        store: JobStore,
        job_id: UUID,
        attempt_id: UUID,
        *,
        renew_every: float,
        heartbeat_every: float,
        on_lost: Callable[[], None] = lambda: None,
        details: Callable[[], Any] = lambda: None,
    ) -> None:
        self.store = store
        self.job_id = job_id
        self.attempt_id = attempt_id
        self.renew_every = renew_every
        self.heartbeat_every = heartbeat_every
        self.on_lost = on_lost
        self.details = details
        self.lost = False
        self._finished = False
        self._finishing = False  # finish() was called: a renewal that now finds no row is not a loss
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LeaseKeeper:
        self._task = asyncio.create_task(self._run(), name=f"lease-{self.job_id}")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.finish()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_renewal = loop.time() + self.renew_every
        while True:
            activity.heartbeat(self.details())
            if loop.time() >= next_renewal:
                next_renewal = loop.time() + self.renew_every
                await self.renew_now()
            await asyncio.sleep(min(self.heartbeat_every, self.renew_every))

    async def renew_now(self) -> bool:
        """One renewal, serialized with the scheduled ones. False only when a renewal changed no row."""
        async with self._lock:
            if self._finished:
                return not self.lost
            try:
                renewed = await self.store.renew_lease(self.job_id, self.attempt_id)
            except Exception as exc:
                log.warning("lease renewal for %s attempt %s failed, retrying next tick: %s",
                            self.job_id, self.attempt_id, exc)
                return True
            # A renewal that finishes after the terminal write finds no row; that is not a loss of ownership.
            if not renewed and not self._finishing and not self.lost:
                self.lost = True
                log.warning("attempt %s lost ownership of export %s", self.attempt_id, self.job_id)
                self.on_lost()
            return renewed

    @asynccontextmanager
    async def terminal_write(self) -> AsyncIterator[None]:
        """Around the attempt's terminal write. A renewal that finds no row from here on may be this very write's
        doing, so it is not reported as lost ownership (a takeover shows in the write's own result instead);
        renewals stop right after the write."""
        self._finishing = True
        try:
            yield
        finally:
            await self.finish()

    async def finish(self) -> None:
        """Stop renewing, right after the attempt's terminal write. Waits for a renewal in flight; never raises."""
        # Marked before waiting: `_finished` is checked by the renewal in flight when it returns, and set here only
        # once that renewal has released the lock, so without this its empty result would be reported as a loss.
        self._finishing = True
        async with self._lock:  # waits for a renewal in flight rather than interrupting it
            self._finished = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
