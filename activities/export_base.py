"""What the export activities of one worker share: the store, the settings and the worker's identity and task
queue, its checkpoints, and each attempt's lease keeper, handed from one step of the attempt to the next.

The hand-over protocol of an attempt's steps. From its build to its terminal write, an attempt runs on the worker
that claimed it (that worker's own task queue, where its file is), as several activities: `build`, then each step
marked `@attempt_step`. One lease keeper renews the row's lease for the whole attempt, without a gap:

- the claim starts a keeper for the claim's lease and hands it over (`_keep_claimed`); the build ends it and
  starts its own (`_keeper`) once it holds the attempt's build slot;
- a step that continues the attempt ends with `_hand_over(keeper)`: the keeper goes on renewing until the next
  step adopts it, for at most `hand_over_window` (below), then stops and lets the lease lapse for recovery;
- a step adopts the keeper first thing (`_keeper`), and ends by handing it on or with the attempt's terminal write
  (`keeper.terminal_write()`, then `finish`).

A step that forgets either half lets the lease lapse between steps. tests/hardening/test_step_hand_over.py holds
the start of every step after the build for about a lease and fails if the lease lapses meanwhile.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from uuid import UUID

from activities import checkpoints
from activities.capacity import Slots, WorkerCapacity
from activities.lease import LeaseKeeper, beats, heartbeating
from activities.process import metrics
from store import errors
from store.jobs import JobStore
from store.models import JobRow
from store.settings import Settings

log = logging.getLogger(__name__)

# How long a step waits for a place in its destination's share before it looks again (the wait itself is bounded
# by the step: its lease lost, or its worker shutting down).
_PLACE_WAIT_SECONDS = 60.0

# Temporal's default workflow task timeout, which the exports' starts keep: a workflow task taken by a worker that
# then dies is given to another after it.
WORKFLOW_TASK_TIMEOUT_SECONDS = 10.0


def hand_over_window(lease: float, renew_every: float, sticky_queue_timeout: float) -> float:
    """How long a handed-over keeper waits for the next step. The step comes once the run's workflow task has
    scheduled it, and that task waits first on the sticky queue of the worker that has the run cached: a worker
    paused or killed holds it for the sticky timeout, and a worker that dies holding it, for a workflow task
    timeout. Then the step is started within one lease (its schedule-to-start timeout, workflows/export.py
    `_on_worker`). This worker holds the file and is alive meanwhile, so its attempt is not lost: one lease alone
    let a pause of another worker lapse it, and recovery count it against the attempt cap (the chaos run's full
    profile). A run that never schedules the step costs the attempt this long before recovery takes it back."""
    return lease + renew_every + sticky_queue_timeout + WORKFLOW_TASK_TIMEOUT_SECONDS


Step = TypeVar("Step", bound=Callable[..., Awaitable[Any]])
# The lease keeper the running step adopted (each activity runs in a context of its own).
_adopted: contextvars.ContextVar[LeaseKeeper | None] = contextvars.ContextVar("adopted_lease_keeper", default=None)


def attempt_step(method: Step) -> Step:
    """Marks an activity as a step of an attempt on the claiming worker's own task queue: it starts or adopts the
    attempt's lease keeper, and hands it on or ends the attempt (the protocol above). Its start passes the
    checkpoint `before:<name>`, where a test holds it. Two bugs are logged as errors when the step ends: a keeper
    still held (neither handed over nor finished), which would renew the lease for good, past the attempt's end, so
    it is finished then and the lease lapses for recovery; and a keeper the previous step handed over that this step
    never adopted, which stops renewing one lease after the hand-over, however long this step runs."""

    @functools.wraps(method)
    async def step(self: ExportActivitiesBase, request: Any) -> Any:
        beats()  # from here on, every heartbeat of the step is noted (activities/lease.py)
        await self.checkpoints.reached(f"{checkpoints.BEFORE_STEP}{method.__name__}", request.job.id)
        try:
            return await method(self, request)
        finally:
            keeper = _adopted.get()
            if keeper is not None and keeper.held:
                log.error("step %s of export %s attempt %s ended with its lease keeper still held (neither handed "
                          "over nor finished): finished now, the lease lapses for recovery", method.__name__,
                          keeper.job_id, keeper.attempt_id)
                await keeper.finish()
            waiting = self.keepers.get((request.job.id, request.attempt_id))
            if keeper is None and waiting is not None and waiting.handed_over:
                log.error("step %s of export %s attempt %s never adopted the lease keeper that the previous step "
                          "handed over: it renews only until its hand-over ends", method.__name__, request.job.id,
                          request.attempt_id)

    step.__attempt_step__ = True  # type: ignore[attr-defined]
    return step  # type: ignore[return-value]


def is_attempt_step(function: object) -> bool:
    return bool(getattr(function, "__attempt_step__", False))


def activity_methods(instance: object) -> list[Any]:
    """Every activity an instance defines (its `@activity.defn` methods, bound), in name order: what a worker
    registers, derived rather than listed by hand."""
    return [member for _, member in inspect.getmembers(instance, inspect.ismethod)
            if hasattr(member, "__temporal_activity_definition")]


class ExportActivitiesBase:
    def __init__(self, store: JobStore, settings: Settings, *, worker_id: str, worker_task_queue: str) -> None:
        self.store = store
        self.settings = settings
        self.worker_id = worker_id
        self.worker_task_queue = worker_task_queue
        self.checkpoints = checkpoints.Checkpoints()
        # How many builds and uploads run here at once (activities/capacity.py).
        self.capacity = WorkerCapacity(max_builds=settings.max_builds, max_uploads=settings.max_uploads,
                                       destination_share=settings.destination_share)
        # Attempts here that hold a session at their partner (take_partner_session.sql), given back at their end.
        self.partner_sessions: set[tuple[UUID, UUID]] = set()
        # Attempts whose upload runs here: it keeps its upload slot and partner session until it ends, even when its
        # lease keeper ends first (the lease lost: the upload goes on).
        self.uploading: set[tuple[UUID, UUID]] = set()
        # Partner sessions being given back, by attempt: a late upload that takes its session again waits for its own.
        self._session_releases: dict[tuple[UUID, UUID], asyncio.Task[None]] = {}
        # Each attempt's lease keeper on this worker, from its build's start to its terminal write.
        self.keepers: dict[tuple[UUID, UUID], LeaseKeeper] = {}

    def _keeper(self, job_id: UUID, attempt_id: UUID, holder: str | None,
                on_lost: Callable[[], None] = lambda: None, *, on_lapsing: Callable[[], None] = lambda: None,
                leased_at: float | None = None) -> LeaseKeeper:
        """The attempt's lease keeper on this worker, adopted by the current step: the one the previous step handed
        over, or a new one (the first step, or one whose keeper gave up waiting), told when its lease was last set
        (`leased_at`, the event loop's clock) if that is known."""
        key = (job_id, attempt_id)
        keeper = self.keepers.get(key)
        if keeper is None or keeper.done or keeper.holder != holder:
            keeper = LeaseKeeper(self.store, job_id, attempt_id, holder, renew_every=self.settings.renew_every_seconds,
                                 on_done=lambda done: self._forget(key, done), leased_at=leased_at).start()
            self.keepers[key] = keeper
        keeper.adopt(on_lost, on_lapsing)
        _adopted.set(keeper)
        return keeper

    async def close(self) -> None:
        """The worker has shut down: stop every lease keeper still renewing here, and hand back what waits between
        two steps (`hand_back_between_steps`)."""
        await self.hand_back_between_steps()
        for keeper in list(self.keepers.values()):
            await keeper.finish()

    async def hand_back_between_steps(self) -> None:
        """The worker begins to shut down: an attempt handed over between two steps (built, its next step not begun
        here, and now never to begin here) is handed back as a build is: its lease ends at once, so that recovery
        requeues it at its next run rather than a lease later. At the start of the shutdown, not after it: that
        waits for the uploads in flight, which do not stop for it. The statement matches only a Running attempt of
        this holder: a Delivering one is left to lapse, for recovery to judge."""
        for keeper in [keeper for keeper in self.keepers.values() if keeper.handed_over]:
            await keeper.finish()
            if keeper.holder is None:
                continue
            try:
                released = await self.store.release_lease(keeper.job_id, keeper.attempt_id, keeper.holder)
            except Exception as exc:
                log.warning("could not end the lease of %s attempt %s: %s", keeper.job_id, keeper.attempt_id,
                            errors.describe(exc))
                continue
            if released:
                log.info("worker shutting down: built attempt %s of %s handed back before its next step",
                         keeper.attempt_id, keeper.job_id)

    def _forget(self, key: tuple[UUID, UUID], keeper: LeaseKeeper) -> None:
        if self.keepers.get(key) is keeper:
            del self.keepers[key]
            if key not in self.uploading:  # else the upload frees them as it ends
                self._free(key)

    def _free(self, key: tuple[UUID, UUID]) -> None:
        """The attempt is over here: its build or upload slot, and its partner session, are free."""
        self.capacity.release(key)
        if key in self.partner_sessions:
            self.partner_sessions.discard(key)
            task = asyncio.create_task(self._release_partner_session(key))
            self._session_releases[key] = task
            task.add_done_callback(lambda done: self._session_releases.pop(key, None)
                                   if self._session_releases.get(key) is done else None)

    async def _session_released(self, key: tuple[UUID, UUID]) -> None:
        """The attempt's partner session, if it is being given back, given back first: a session taken again before
        that (a late upload's) would find the old row, and the release would then delete it."""
        pending = self._session_releases.get(key)
        if pending is not None:
            await asyncio.wait({pending})  # it logs its own failure; a cancel of this wait leaves it running

    async def _release_partner_session(self, key: tuple[UUID, UUID]) -> None:
        # Else the slot is free once the row no longer names the attempt and its upload's hold has lapsed.
        try:
            await self.store.release_partner_session(*key)
        except Exception as exc:
            log.info("export %s attempt %s: its partner session is freed by its row instead: %s", *key,
                     errors.describe(exc))

    def _keep_claimed(self, job_id: UUID, attempt_id: UUID, leased_at: float | None) -> None:
        """After a claim: this worker's keeper renews the claim's lease (its holder is the worker) and is handed
        over to the build, so that the lease is kept while the run's next workflow task may still be on its way
        (LK1). The build ends it first thing (`_end_claim_keeper`): its own statement sets its holder and lease."""
        key = (job_id, attempt_id)
        keeper = LeaseKeeper(self.store, job_id, attempt_id, self.worker_id,
                             renew_every=self.settings.renew_every_seconds,
                             on_done=lambda done: self._forget(key, done), leased_at=leased_at).start()
        self.keepers[key] = keeper
        self._hand_over(keeper)

    async def _end_claim_keeper(self, job_id: UUID, attempt_id: UUID) -> LeaseKeeper | None:
        """The keeper the claim handed over here, stopped; None if there is none. Taken out of `keepers` first, so
        that the build slot it kept stays the build's."""
        key = (job_id, attempt_id)
        keeper = self.keepers.get(key)
        if keeper is None or keeper.holder != self.worker_id:
            return None
        del self.keepers[key]
        await keeper.finish()
        return keeper

    def _hand_over(self, keeper: LeaseKeeper) -> None:
        keeper.hand_over(within=hand_over_window(self.settings.lease_seconds, self.settings.renew_every_seconds,
                                                 self.settings.sticky_queue_timeout_seconds))

    async def _slot(self, slots: Slots, job: JobRow, attempt_id: UUID, details: dict[str, Any]) -> None:
        """The attempt's slot in `slots`: the one it holds here, or one it waits for, first come first served, while
        its lease keeper renews and its heartbeats go on (so the wait is never taken for a lost worker: LD1). The
        wait shows in the step's heartbeat details. An attempt that has no place in its destination's share here
        (a build resumed here, an upload taking its slot again) first waits for one, as a claim does, so that no
        destination holds more than its share of the worker (LD4); held, the slot keeps the place."""
        key = (job.id, attempt_id)
        await self._place(job.destination_id, key, details)
        try:
            await self._slot_for(slots, key, details)
        except BaseException:
            self.capacity.shares.settle(key, claimed=False)  # a place reserved here and not used is given up
            raise
        self.capacity.shares.adopt(job.destination_id, key)

    async def _place(self, destination_id: UUID, key: tuple[UUID, UUID], details: dict[str, Any]) -> None:
        """A place in the destination's share of this worker: the one the attempt has, or one it waits for (its lease
        kept, its heartbeats sent, the wait in its heartbeat details)."""
        if self.capacity.shares.reserve(destination_id, key):
            return
        log.info("export %s attempt %s waits for a place among the %d attempts to its destination this worker holds "
                 "at once", *key, self.capacity.shares.limit)
        metrics.slot_wait("destination")
        details["waiting"] = "for a place among its destination's attempts here"
        try:
            while not await self.capacity.shares.wait_for_room(destination_id, key, _PLACE_WAIT_SECONDS):
                pass
        finally:
            details.pop("waiting", None)

    async def _slot_for(self, slots: Slots, key: tuple[UUID, UUID], details: dict[str, Any]) -> None:
        job_id, attempt_id = key
        if slots.adopt(key):
            return
        if slots.free:
            await slots.acquire(key)  # at once: no other step waits, and no await comes between
            return
        log.info("export %s attempt %s waits for a free %s slot (%d of %d held here)", job_id, attempt_id, slots.kind,
                 slots.in_use, slots.limit)
        metrics.slot_wait(slots.kind)
        details["waiting"] = f"for a free {slots.kind} slot"
        try:
            await slots.acquire(key)
        finally:
            details.pop("waiting", None)

    def _heartbeating(self, details: Callable[[], Any]) -> Any:
        return heartbeating(self.settings.heartbeat_seconds, details)
