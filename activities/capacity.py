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

- **A destination's share** (LD4): at most `share` attempts to one destination are in flight here at once (from
  the claim until the attempt holds neither slot). A claim for a destination at its share waits in its step, its
  poll's ticket parked (not counted) meanwhile, so the worker goes on claiming for other destinations: one slow
  partner fills its share, not every upload slot and then every build slot.

A slot held for a step that then never comes here (the run moved on) is released after a bound, as the lease
keeper stops after its hand-over bound. Slots are counted on the event loop; the slot supplier's synchronous
callbacks may come from the SDK's own threads, so they only schedule their change onto the loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from collections.abc import Callable
from uuid import UUID

from temporalio.worker import (
    CustomSlotSupplier,
    SlotMarkUsedContext,
    SlotPermit,
    SlotReleaseContext,
    SlotReserveContext,
)

from activities.process import metrics
from store.settings import default_destination_share

log = logging.getLogger(__name__)

Key = tuple[UUID, UUID]  # (job ID, attempt ID)


class Broadcast:
    """Waiters that look again whenever something may have been freed: `wait` until the next `notify`, or a
    deadline."""

    def __init__(self) -> None:
        self._waiters: list[asyncio.Future[None]] = []

    async def wait(self, timeout: float | None = None) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            pass
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


class ClaimStep:
    """A claim step counted among those running on the worker, until it ends or its attempt holds a slot."""

    def __init__(self) -> None:
        self.running = True


class Slots:
    """A pool of `limit` slots, each held by one attempt or by a poll's ticket, handed out first come first served.
    Holding counts up to `limit`; a claim's hold may pass it for the moment its ticket is still counted."""

    def __init__(self, kind: str, limit: int, on_change: Callable[[], None] = lambda: None) -> None:
        if limit < 1:
            raise ValueError(f"{kind} slots: the limit must be at least 1, not {limit}")
        self.kind = kind
        self.limit = limit
        self.on_change = on_change
        self._held: dict[Key, asyncio.TimerHandle | None] = {}  # a timer while the attempt's next step is awaited
        self._tickets = 0
        self._parked = 0  # tickets whose step waits without counting them (`park`)
        self._claims = 0  # claim steps running here (not those parked): with the attempts held, the real load
        self._unparking = Broadcast()
        self._granted = 0  # slots handed to a waiter that has not yet taken it
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def in_use(self) -> int:
        return len(self._held) + self._tickets - self._parked + self._granted

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

    def hold(self, key: Key, *, adopt_within: float, claim: ClaimStep | None = None) -> None:
        """A slot for the attempt without waiting (a claim, whose ticket was counted): released unless its next
        step adopts it within `adopt_within` seconds."""
        if claim is not None:
            self.claim_ended(claim)
        self._unwait(key)
        self._held[key] = asyncio.get_running_loop().call_later(adopt_within, self._unadopted, key)
        self._changed()

    def adopt(self, key: Key) -> bool:
        """The attempt's next step has come: its slot no longer lapses. Whether it holds one."""
        if key not in self._held:
            return False
        self._unwait(key)
        return True

    def holds(self, key: Key) -> bool:
        return key in self._held

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

    def claim_started(self) -> ClaimStep | None:
        """A claim step begins: its place among the claims running, or None if it does not fit (attempts held
        and claims running over the limit). A poll's ticket guarantees it fits, except after a claim that waited
        for its destination went ahead of an idle poll (`unpark`): then this one does not claim here."""
        self._claims += 1
        step = ClaimStep()
        if len(self._held) + self._claims > self.limit:
            self.claim_ended(step)
            return None
        return step

    def claim_ended(self, step: ClaimStep) -> None:
        """The claim step ends, or its attempt now holds its build slot (`hold`): it counts once, not twice."""
        if step.running:
            step.running = False
            self._claims -= 1
            self._changed()

    def park(self) -> bool:
        """A claim step stops counting while it waits (for its destination's share), and so does its poll's
        ticket, so that the worker polls again; whether it had a ticket to park (a worker without the admission
        slot supplier has none). Its poll's release still returns the ticket, whatever the order: a parked step
        always unparks (`unpark`) before it ends."""
        self._claims -= 1
        parked = self._tickets - self._parked > 0
        if parked:
            self._parked += 1
        self._wake()
        return parked

    async def unpark(self, *, ticket: bool, wait: bool) -> None:
        """The parked step counts again, with its ticket if it parked one: if `wait` (it goes on to claim), once
        the attempts held and the claims running leave room, ahead of polls (an idle poll's ticket is no load,
        and its long poll may last a minute); at once otherwise (it gives up, and its release comes next)."""
        try:
            if wait:
                while len(self._held) + self._claims >= self.limit:
                    await self._unparking.wait()
        finally:
            self._claims += 1
            if ticket:
                self._parked -= 1
            self._changed()

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
        self._unparking.notify()
        self.on_change()


class DestinationShares:
    """At most `limit` attempts to one destination in flight on this worker: reserved by a claim under way, then
    counted while the attempt holds a build or an upload slot here (so every way an attempt ends here, or never
    comes, frees its place with its slots)."""

    def __init__(self, limit: int, pools: tuple[Slots, ...]) -> None:
        if limit < 1:
            raise ValueError(f"a destination's share must be at least 1, not {limit}")
        self.limit = limit
        self._pools = pools
        self._claiming: dict[Key, UUID] = {}
        self._claimed: dict[Key, UUID] = {}
        self._freed = Broadcast()
        # Attempts in flight by destination, counted once after each change (the pools report theirs to
        # `changed`, WorkerCapacity sees to it): every waiting claim asks after each, and a hundred claims parked
        # behind one destination each counted every attempt, at every slot's change.
        self._counts: Counter[UUID] | None = None

    def in_flight(self, destination: UUID) -> int:
        if self._counts is None:
            for key in [key for key in self._claimed if not any(pool.holds(key) for pool in self._pools)]:
                del self._claimed[key]
            self._counts = Counter((*self._claimed.values(), *self._claiming.values()))
        return self._counts[destination]

    def has_room(self, destination: UUID, key: Key) -> bool:
        """Whether `reserve` would give the attempt a place now (it changes nothing)."""
        return key in self._claiming or key in self._claimed or self.in_flight(destination) < self.limit

    def reserve(self, destination: UUID, key: Key) -> bool:
        """A place for the attempt's claim, if its destination is under its share."""
        if key in self._claiming or key in self._claimed:
            return True
        if not self.has_room(destination, key):
            return False
        self._claiming[key] = destination
        self._counts = None
        return True

    async def wait_for_room(self, destination: UUID, key: Key, within: float) -> bool:
        """`reserve`, waiting up to `within` seconds for a place to free; whether it got one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while not self.reserve(destination, key):
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            await self._freed.wait(remaining)
        return True

    def adopt(self, destination: UUID, key: Key) -> None:
        """An attempt that holds a slot here without this worker's claim having reserved its place (a claim's retry
        that finds its own commit, a build resumed here, an upload that takes its slot again): counted among its
        destination's attempts from now on, whatever the share, since it exists already. Call it once the attempt
        holds its slot (or with no await before it takes it): an attempt that holds none is not counted."""
        if key in self._claimed:
            return
        self._claiming.pop(key, None)
        self._claimed[key] = destination
        self.changed()

    def settle(self, key: Key, *, claimed: bool) -> None:
        """The claim's answer: a claimed attempt keeps its place while it holds a slot; any other gives it up."""
        destination = self._claiming.pop(key, None)
        if claimed and destination is not None:
            self._claimed[key] = destination
        self.changed()

    def changed(self) -> None:
        """A slot or a place was freed, perhaps: every waiter looks again."""
        self._counts = None
        self._freed.notify()


class WorkerCapacity:
    """The worker's build and upload slots, and each destination's share of them."""

    def __init__(self, *, max_builds: int, max_uploads: int, destination_share: int | None = None) -> None:
        self.builds = Slots("build", max_builds)
        self.uploads = Slots("upload", max_uploads)
        self.shares = DestinationShares(destination_share or default_destination_share(max_builds, max_uploads),
                                        (self.builds, self.uploads))
        # A slot freed may be a destination's place freed: its waiting claims look again.
        self.builds.on_change = self.uploads.on_change = self.shares.changed

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
