"""The hand-over between an attempt's steps (activities/export_base.py): every step after the build, held at its
start for about a lease, finds the lease kept meanwhile, and the export completes in its one attempt.

Which steps: those a completed export of this release ran on the claiming worker's own task queue (its recorded
history), so a step added to the workflow is held here too once its histories are recorded; each must be marked
`@attempt_step`. A step that does not hand the lease keeper on lets the lease lapse during the hold of the step
after it; one that does not adopt it is named in the log as it ends. (The build is not held: it is the first, and
nothing is handed to it.)
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack
from uuid import UUID

import pytest

from activities.checkpoints import AFTER_CLAIM, BEFORE_STEP, Checkpoints
from activities.export_base import is_attempt_step
from activities.exports import ExportActivities
from activities.lease import heartbeat
from store.models import Status
from tests.helpers.harness import open_harness
from tests.helpers.releases import current_version
from tests.replay.history_files import HISTORIES, load

# The hand-over window is one lease plus one renewal interval; a hold just under it is longer than the lease
# minus a renewal interval, so a keeper that stopped at the previous step's end lets the lease lapse meanwhile.
LEASE, RENEW, HOLD = 4.0, 0.5, 4.2


def steps_on_the_worker() -> list[str]:
    """The activity types of a completed export that ran on the claiming worker's own queue, in order."""
    history = load(HISTORIES / current_version() / "export_completed.json")
    shared = history.events[0].workflow_execution_started_event_attributes.task_queue.name
    return [e.activity_task_scheduled_event_attributes.activity_type.name for e in history.events
            if e.HasField("activity_task_scheduled_event_attributes")
            and e.activity_task_scheduled_event_attributes.task_queue.name != shared]


class HoldAtStart(Checkpoints):
    """Holds one step at its start, heartbeating (a step may have a heartbeat timeout of one lease)."""

    def __init__(self, step: str, hold: float = HOLD, *, checkpoint: str | None = None) -> None:
        self.name = checkpoint or f"{BEFORE_STEP}{step}"
        self.hold = hold
        self.held_from: float | None = None
        self.held_until: float | None = None

    async def reached(self, name: str, job_id: UUID) -> None:
        if name != self.name:
            return
        self.held_from = time.monotonic()
        while time.monotonic() - self.held_from < self.hold:
            heartbeat()  # noted, as the step's own heartbeats are: the run still waits for this step
            await asyncio.sleep(0.2)
        self.held_until = time.monotonic()


def test_step_hand_over__every_step_on_the_worker_is_an_attempt_step():
    steps = steps_on_the_worker()
    assert steps[0] == "build" and len(steps) > 1, steps
    unmarked = [step for step in steps if not is_attempt_step(getattr(ExportActivities, step))]
    assert not unmarked, f"steps on the claiming worker without @attempt_step (activities/export_base.py): {unmarked}"


@pytest.mark.spec("LK1")
@pytest.mark.parametrize("step", steps_on_the_worker()[1:])
async def test_step_hand_over__a_step_held_at_its_start_for_about_a_lease_finds_the_lease_kept(
        db, store, client, tmp_path, caplog, step):
    await a_held_step_finds_the_lease_kept(db, store, client, tmp_path, caplog, step, HOLD)


# A run's next workflow task waits on the sticky queue of the worker that has it cached: one that was paused or
# killed delays it by the sticky timeout (then Temporal's workflow task timeout, if the worker that took it dies).
STICKY = 6.0


@pytest.mark.spec("LK1", "LV6", "LD1")
async def test_step_hand_over__a_step_late_by_a_sticky_timeout_still_finds_the_lease_kept(
        db, store, client, tmp_path, caplog):
    """The next step comes only after the run's workflow task has waited out the sticky timeout of a paused worker
    (the chaos run's full profile: exports built on a healthy worker lapsed, were requeued and ended
    AttemptsExhausted, with no fault of that worker to explain it). Its worker still holds the file and renews:
    the hand-over lasts as long as that delay may, not one lease (seen failing: the lease lapsed during the
    hold)."""
    await a_held_step_finds_the_lease_kept(db, store, client, tmp_path, caplog, steps_on_the_worker()[1],
                                           LEASE + RENEW + STICKY - 0.5, sticky_queue_timeout_seconds=STICKY)


@pytest.mark.spec("LK1", "LV6", "LD1")
async def test_step_hand_over__a_build_late_by_a_sticky_timeout_still_finds_the_claims_lease_kept(
        db, store, client, tmp_path, caplog):
    """The same delay between the claim and the build (here the claim step held after its claim committed, as a
    late workflow task would hold the build's scheduling): the claiming worker's keeper renews the claim's lease
    until the build comes (seen failing: the claim's lease lapsed during the hold; in the full chaos profile
    recovery requeued such claims and counted them against the attempt cap, with no fault of their worker)."""
    await a_held_step_finds_the_lease_kept(db, store, client, tmp_path, caplog, "claim_if_allowed",
                                           LEASE + RENEW + STICKY - 0.5, checkpoint=AFTER_CLAIM,
                                           sticky_queue_timeout_seconds=STICKY)


async def a_held_step_finds_the_lease_kept(db, store, client, tmp_path, caplog, step: str, held_for: float, *,
                                           checkpoint: str | None = None, **settings: object) -> None:
    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path, lease_seconds=LEASE, renew_every_seconds=RENEW,
                               **settings)
        assert h.activities is not None
        hold = HoldAtStart(step, held_for, checkpoint=checkpoint)
        h.activities.checkpoints = hold
        job_id = await h.create()
        lapsed: list[tuple[str, float]] = []

        async def watch_the_lease() -> None:
            while True:
                row = await h.db.admin.fetchrow(
                    "SELECT status, lease_expires_at < clock_timestamp() AS lapsed FROM export_jobs WHERE id = $1",
                    job_id)
                if row["status"] in ("Running", "Delivering") and row["lapsed"]:
                    lapsed.append((row["status"], time.monotonic()))
                await asyncio.sleep(0.1)

        watcher = asyncio.create_task(watch_the_lease())
        try:
            row = await h.settled(job_id)
        finally:
            watcher.cancel()
    assert hold.held_from is not None and hold.held_until is not None, f"{step} was never held"
    assert hold.held_until - hold.held_from >= held_for
    assert not lapsed, f"the lease lapsed while {step} was held: {lapsed}"
    broken = [r.getMessage() for r in caplog.records if r.name == "activities.export_base" and r.levelname == "ERROR"]
    assert not broken, broken
    assert (row.status, row.attempt_count) == (Status.COMPLETED, 1)
