"""How much one worker process runs at once (LD1, LD2): builds and uploads, each a pool of slots held by an attempt.

- **A build slot** is held from the claim (cutoff 1) until cutoff 2 is decided. The claim runs on the admission
  task queue, which this worker polls only while a build slot is free (`AdmissionSlots`, the Temporal worker's
  slot supplier): a busy worker takes no claim, and the export waits Queued in Temporal's queue, where no lease
  runs and no worker can be taken for lost. A claim turns the ticket its poll held into its attempt's build slot.
  A build that finds no slot held for its attempt (resumed here after its worker went quiet) waits for one with
  its lease kept and its heartbeats sent: a wait, not a lost worker.
- **An upload slot** is taken before cutoff 2 and held until the attempt's lease keeper ends (its terminal write,
  its hand-back, or its lease given up): cutoff 2 waits for it, lease kept, so an authorized attempt always has an
  upload that can start, and a file is never left unsent for want of capacity.

Holding its build slot while it waits for an upload slot, an attempt keeps the worker from claiming more than it
can upload: slow partners fill the upload slots, and claims stop, rather than files piling up built and waiting.

A slot held for a step that then never comes here (the run moved on) is released after a bound, as the lease
keeper stops after its hand-over bound. Slots are counted on the event loop; the slot supplier's synchronous
callbacks may come from the SDK's own threads, so they only schedule their change onto the loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from uuid import UUID

from temporalio.worker import (
    CustomSlotSupplier,
    SlotMarkUsedContext,
    SlotPermit,
    SlotReleaseContext,
    SlotReserveContext,
)

from activities.process import metrics

log = logging.getLogger(__name__)

Key = tuple[UUID, UUID]  # (job ID, attempt ID)


class Slots:
    """A pool of `limit` slots, each held by one attempt or by a poll's ticket, handed out first come first served.
    Holding counts up to `limit`; a claim's hold may pass it for the moment its ticket is still counted."""

    def __init__(self, kind: str, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"{kind} slots: the limit must be at least 1, not {limit}")
        self.kind = kind
        self.limit = limit
        self._held: dict[Key, asyncio.TimerHandle | None] = {}  # a timer while the attempt's next step is awaited
        self._tickets = 0
        self._granted = 0  # slots handed to a waiter that has not yet taken it
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def in_use(self) -> int:
        return len(self._held) + self._tickets + self._granted

    @property
    def waiting(self) -> int:
        return sum(1 for waiter in self._waiters if not waiter.done())

    @property
    def free(self) -> bool:
        """Whether a slot can be had now, without waiting."""
        return self.in_use < self.limit and not self._waiters

    async def acquire(self, key: Key) -> None:
        """Hold a slot for the attempt: at once if it holds one already, else after every earlier waiter, when one
        is free."""
        if self.adopt(key):
            return
        await self._turn()
        self._held[key] = None
        self._changed()

    def hold(self, key: Key, *, adopt_within: float) -> None:
        """A slot for the attempt without waiting (a claim, whose ticket was counted): released unless its next
        step adopts it within `adopt_within` seconds."""
        self._unwait(key)
        self._held[key] = asyncio.get_running_loop().call_later(adopt_within, self._unadopted, key)
        self._changed()

    def adopt(self, key: Key) -> bool:
        """The attempt's next step has come: its slot no longer lapses. Whether it holds one."""
        if key not in self._held:
            return False
        self._unwait(key)
        return True

    def release(self, key: Key) -> None:
        timer = self._held.pop(key, None)
        if timer is not None:
            timer.cancel()
        self._wake()

    async def ticket(self) -> None:
        """A ticket for a poll: a slot that a claim may turn into its attempt's."""
        await self._turn()
        self._tickets += 1
        self._changed()

    def return_ticket(self) -> None:
        self._tickets = max(0, self._tickets - 1)
        self._wake()

    async def _turn(self) -> bool:
        if self.free:
            return False
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._changed()
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            elif waiter.done() and not waiter.cancelled():
                self._granted -= 1  # granted as it was cancelled: hand the slot on
                self._wake()
            self._changed()
            raise
        self._granted -= 1
        return True

    def _wake(self) -> None:
        while self._waiters and self.in_use < self.limit:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self._granted += 1
        self._changed()

    def _unwait(self, key: Key) -> None:
        timer = self._held.get(key)
        if timer is not None:
            timer.cancel()
        self._held[key] = None

    def _unadopted(self, key: Key) -> None:
        if self._held.get(key) is not None:
            log.info("%s slot of export %s attempt %s released: its next step did not come here", self.kind,
                     *key)
            del self._held[key]
            self._wake()

    def _changed(self) -> None:
        # Attempts only: an idle worker's polls hold tickets too, which would read as work.
        metrics.slots(self.kind, in_use=len(self._held), waiting=self.waiting, limit=self.limit)


class WorkerCapacity:
    """The worker's build and upload slots."""

    def __init__(self, *, max_builds: int, max_uploads: int) -> None:
        self.builds = Slots("build", max_builds)
        self.uploads = Slots("upload", max_uploads)

    def release(self, key: Key) -> None:
        """The attempt's lease keeper ended here: whatever it held is free."""
        self.builds.release(key)
        self.uploads.release(key)


class AdmissionSlots(CustomSlotSupplier):
    """The admission queue's activity slots: one for each build slot free on this worker, so that the worker polls
    for claims only while it could build what it claims."""

    def __init__(self, builds: Slots, loop: asyncio.AbstractEventLoop) -> None:
        self.builds = builds
        self.loop = loop

    async def reserve_slot(self, ctx: SlotReserveContext) -> SlotPermit:
        await self.builds.ticket()
        return SlotPermit()

    def try_reserve_slot(self, ctx: SlotReserveContext) -> SlotPermit | None:
        return None  # no eager tasks: claims come only through a poll

    def mark_slot_used(self, ctx: SlotMarkUsedContext) -> None:
        pass

    def release_slot(self, ctx: SlotReleaseContext) -> None:
        self.loop.call_soon_threadsafe(self.builds.return_ticket)
