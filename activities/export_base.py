"""What the export activities of one worker share: the store, the settings and the worker's identity and task
queue, its checkpoints, and each attempt's lease keeper, handed from one step of the attempt to the next."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from uuid import UUID

from activities import checkpoints
from activities.lease import LeaseKeeper, heartbeating
from store.jobs import JobStore
from store.settings import Settings


class ExportActivitiesBase:
    def __init__(self, store: JobStore, settings: Settings, *, worker_id: str, worker_task_queue: str) -> None:
        self.store = store
        self.settings = settings
        self.worker_id = worker_id
        self.worker_task_queue = worker_task_queue
        self.checkpoints = checkpoints.Checkpoints()
        # Each attempt's lease keeper on this worker, from its build's start to its terminal write.
        self.keepers: dict[tuple[UUID, UUID], LeaseKeeper] = {}

    def _keeper(self, job_id: UUID, attempt_id: UUID, holder: str | None,
                on_lost: Callable[[], None] = lambda: None) -> LeaseKeeper:
        """The attempt's lease keeper on this worker, adopted by the current step: the one the previous step handed
        over, or a new one (the first step, or one whose keeper gave up waiting)."""
        key = (job_id, attempt_id)
        keeper = self.keepers.get(key)
        if keeper is None or keeper.done or keeper.holder != holder:
            keeper = LeaseKeeper(self.store, job_id, attempt_id, holder, renew_every=self.settings.renew_every_seconds,
                                 on_done=lambda done: self._forget(key, done)).start()
            self.keepers[key] = keeper
        keeper.adopt(on_lost)
        return keeper

    async def close(self) -> None:
        """The worker shuts down: stop every lease keeper still renewing here."""
        for keeper in list(self.keepers.values()):
            await keeper.finish()

    def _forget(self, key: tuple[UUID, UUID], keeper: LeaseKeeper) -> None:
        if self.keepers.get(key) is keeper:
            del self.keepers[key]

    def _hand_over(self, keeper: LeaseKeeper) -> None:
        # The next step of the attempt is scheduled on this worker with a schedule-to-start timeout of one lease.
        keeper.hand_over(within=self.settings.lease_seconds + self.settings.renew_every_seconds)

    def _heartbeating(self, details: Callable[[], Any]) -> Any:
        return heartbeating(self.settings.heartbeat_throttle_seconds, details)
