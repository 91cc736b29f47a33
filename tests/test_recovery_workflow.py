"""Recovery and the sweeper on Temporal: Schedules, and crashes of real worker processes."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
from temporalio.api.enums.v1 import EventType

from starter.schedules import RECOVERY_SCHEDULE, SWEEPER_SCHEDULE, install_schedules
from store.models import Status
from tests.support import eventually
from tests.workflow_support import Harness, WorkerProcess, held_at, open_harness, run_recovery


@pytest.fixture
async def crash_harness(db, store, client, tmp_path):
    """A tenant and a partner, but no in-process worker: worker processes are started (and killed) by the test."""
    async with AsyncExitStack() as stack:
        yield await open_harness(stack, db, store, client, tmp_path, in_process_worker=False,
                                 lease_seconds=2.0, renew_every_seconds=0.5)


async def lease_expired(h: Harness, job_id) -> bool:
    return await h.db.admin.fetchval(
        "SELECT lease_expires_at < clock_timestamp() FROM export_jobs WHERE id = $1", job_id)


@pytest.mark.spec("TW3")
async def test_schedules__installed_twice_changes_nothing_and_they_run(harness: Harness):
    settings = harness.settings.model_copy(update={"recovery_interval_seconds": 3600.0})
    first = await install_schedules(harness.client, settings)
    second = await install_schedules(harness.client, settings)
    assert first == {RECOVERY_SCHEDULE: "created", SWEEPER_SCHEDULE: "created"}
    assert second == {RECOVERY_SCHEDULE: "updated", SWEEPER_SCHEDULE: "updated"}
    try:
        ids = [s.id async for s in await harness.client.list_schedules()]
        assert sorted(i for i in ids if i.startswith("exports-")) == [RECOVERY_SCHEDULE, SWEEPER_SCHEDULE]
        recovery = await harness.client.get_schedule_handle(RECOVERY_SCHEDULE).describe()
        assert recovery.schedule.spec.intervals[0].every.total_seconds() == 3600
        assert recovery.schedule.policy.overlap.name == "SKIP"
        # A triggered run is a real RecoveryWorkflow on this worker.
        await harness.client.get_schedule_handle(RECOVERY_SCHEDULE).trigger()

        async def recovery_runs() -> int:
            return len([w async for w in harness.client.list_workflows(
                "WorkflowType = 'RecoveryWorkflow' AND ExecutionStatus = 'Completed'")])

        await eventually(recovery_runs, lambda n: n >= 1, timeout=30, interval=0.5, what="a recovery run")
    finally:
        for schedule_id in (RECOVERY_SCHEDULE, SWEEPER_SCHEDULE):
            await harness.client.get_schedule_handle(schedule_id).delete()


@pytest.mark.spec("RI4")
async def test_crash_after_cutoff_2_before_upload_ends_outcome_unknown_never_a_second_upload(crash_harness):
    h = crash_harness
    crashing = await WorkerProcess(h.settings, hold_at="before_upload").start()
    try:
        job_id = await h.create()
        await held_at(h.settings, "before_upload", job_id)
        assert (await h.store.read_job(job_id)).status is Status.DELIVERING
        crashing.kill()
        await eventually(lambda: lease_expired(h, job_id), bool, timeout=20, what="the dead worker's lease expired")
    finally:
        crashing.kill()
    survivor = await WorkerProcess(h.settings).start()
    try:
        report = await run_recovery(h.client, h.settings)
        assert [t.recorded for t in report.taken_over if t.job_id == job_id] == ["ResolvedByRecovery"]
        row = await h.settled(job_id)
    finally:
        await survivor.stop()
    assert row.status is Status.OUTCOME_UNKNOWN  # no receipt, and an absent file proves nothing
    assert list((h.partner.root / "outbound").iterdir()) == []
    history = await h.client.get_workflow_handle(f"export-{job_id}").fetch_history()
    delivers = [e for e in history.events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
                and e.activity_task_scheduled_event_attributes.activity_type.name == "deliver"]
    assert len(delivers) == 1
