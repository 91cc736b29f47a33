"""Recovery and the sweeper on Temporal: Schedules, and crashes of real worker processes."""

from __future__ import annotations

import hashlib
import uuid
from contextlib import AsyncExitStack
from datetime import UTC, datetime

import pytest

from starter.schedules import (
    FOLLOW_UP_SCHEDULE,
    PARTNER_SWEEP_SCHEDULE,
    RECOVERY_SCHEDULE,
    SWEEPER_SCHEDULE,
    install_schedules,
)
from store.models import Status
from tests.helpers.crash import lease_expired
from tests.helpers.events import events, kinds
from tests.helpers.harness import Harness, WorkerProcess, held_at, open_harness, run_recovery, stranded_in_queued
from tests.helpers.partner import outbound_names
from tests.helpers.support import eventually

SCHEDULES = {RECOVERY_SCHEDULE: "RecoveryWorkflow", SWEEPER_SCHEDULE: "SweeperWorkflow",
             PARTNER_SWEEP_SCHEDULE: "PartnerSweepWorkflow", FOLLOW_UP_SCHEDULE: "EvidenceFollowUpWorkflow"}


async def scheduled_runs(h: Harness, schedule_id: str, workflow_type: str, since: datetime) -> list[str]:
    """Completed runs that the schedule `schedule_id` started (Temporal sets TemporalScheduledById on each), on
    this test's task queue, since `since`: never a run that another test started by hand."""
    query = (f"TemporalScheduledById = '{schedule_id}' AND WorkflowType = '{workflow_type}' "
             f"AND TaskQueue = '{h.settings.task_queue}' AND StartTime >= '{since.isoformat()}' "
             "AND ExecutionStatus = 'Completed'")
    return [w.id async for w in h.client.list_workflows(query)]


@pytest.mark.spec("TW3")
async def test_schedules__installed_twice_changes_nothing_and_they_run(harness: Harness):
    settings = harness.settings.model_copy(update={"recovery_interval_seconds": 3600.0,
                                                   "sweeper_interval_seconds": 3600.0,
                                                   "partner_sweep_interval_seconds": 3600.0,
                                                   "follow_up_interval_seconds": 3600.0})
    installed_at = datetime.now(UTC)
    first = await install_schedules(harness.client, settings)
    try:
        described = {i: (await harness.client.get_schedule_handle(i).describe()).schedule
                     for i in SCHEDULES}
        second = await install_schedules(harness.client, settings)
        assert first == dict.fromkeys(SCHEDULES, "created")
        assert second == dict.fromkeys(SCHEDULES, "updated")
        ids = [s.id async for s in await harness.client.list_schedules()]
        assert sorted(i for i in ids if i.startswith("exports-")) == sorted(SCHEDULES)
        for schedule_id, before in described.items():
            after = (await harness.client.get_schedule_handle(schedule_id).describe()).schedule
            assert (after.action, after.spec, after.policy) == (before.action, before.spec, before.policy)
            assert after.spec.intervals[0].every.total_seconds() == 3600
            assert after.policy.overlap.name == "SKIP"
            assert after.action.task_queue == settings.task_queue
        # Each schedule's run is a real workflow on this test's worker: triggered now, not in an hour.
        for schedule_id, workflow_type in SCHEDULES.items():
            await harness.client.get_schedule_handle(schedule_id).trigger()
            await eventually(lambda: scheduled_runs(harness, schedule_id, workflow_type, installed_at),
                             lambda runs: len(runs) >= 1, timeout=30, interval=0.5,
                             what=f"a completed {workflow_type} started by schedule {schedule_id}")
    finally:
        for schedule_id in SCHEDULES:
            await harness.client.get_schedule_handle(schedule_id).delete()


@pytest.mark.spec("RI4")
async def test_crash_after_cutoff_2_before_upload_is_sent_round_again_never_a_second_upload(crash_harness):
    """The worker dies after cutoff 2, before it sends a byte. Its attempt never passed its rename fence, so it never
    renamed and, once recovery takes it back, never can: recovery requeues it (it used to end OutcomeUnknown, a
    ticket for a person) and a second attempt delivers the file, once."""
    h = crash_harness
    crashing = await WorkerProcess(h.settings, hold_at="before_upload").start()
    try:
        job_id = await h.create()
        await held_at(h.settings, "before_upload", job_id)
        first = await h.store.read_job(job_id)
        assert first.status is Status.DELIVERING
        crashing.kill()
        await eventually(lambda: lease_expired(h, job_id), bool, timeout=20, what="the dead worker's lease expired")
    finally:
        crashing.kill()
    survivor = await WorkerProcess(h.settings).start()
    try:
        report = await run_recovery(h.client, h.settings)
        assert [t.recorded for t in report.taken_over if t.job_id == job_id] == ["RequeuedByRecovery"]
        row = await h.settled(job_id)
    finally:
        await survivor.stop()
    assert row.status is Status.COMPLETED and row.attempt_id != first.attempt_id and row.attempt_count == 2
    # Completed only on destination evidence: the one file at the partner is the second attempt's, byte for byte.
    assert outbound_names(h.partner) == [row.final_name]
    delivered = (h.partner.root / "outbound" / row.final_name).read_bytes()
    assert hashlib.sha256(delivered).digest() == row.expected_file_sha256 == first.expected_file_sha256
    evts = await events(h.db, job_id)
    assert kinds(evts, first.attempt_id) == ["Claimed", "BuildStarted", "DeliveryAuthorized", "RequeuedByRecovery"]
    renames = [e["attempt_id"] for e in evts if e["kind"] == "DeliveryEvidence" and '"step": "rename"' in e["detail"]]
    assert renames == [row.attempt_id]  # only the second attempt passed its fence


@pytest.mark.spec("TW3", "SW1")
async def test_sweeper_workflow__republishes_a_job_whose_wake_up_was_lost_and_it_runs(harness: Harness):
    from activities.contracts import SweepInput

    h = harness
    job_id = await stranded_in_queued(h)
    swept = await h.client.execute_workflow(
        "SweeperWorkflow", SweepInput(threshold_seconds=1800, batch=10), id=f"sweep-{uuid.uuid4().hex[:8]}",
        task_queue=h.settings.task_queue, result_type=int)
    assert swept == 1
    row = await h.settled(job_id)  # the sweep's outbox row reached the dispatcher, which started the workflow
    assert (row.status, row.sweep_count) == (Status.COMPLETED, 1)
    assert await h.db.admin.fetchval("SELECT count(*) FROM outbox WHERE job_id = $1", job_id) == 2


async def test_recovery_workflow__clears_a_backlog_larger_than_its_batch_in_one_run(db, store, client, tmp_path):
    """25 expired attempts and a batch of 10: one run nominates again after each batch until the backlog is gone,
    taking several over at once, instead of leaving 15 to the next runs."""
    from activities.contracts import RecoveryInput, RecoveryReport

    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path, dispatcher=False)
        jobs = [uuid.uuid4() for _ in range(25)]
        await h.db.admin.execute("""
            WITH numbered AS (SELECT id, gen_random_uuid() AS attempt, id::text AS key FROM unnest($3::uuid[]) AS id),
            delivery AS (INSERT INTO deliveries (tenant_id, delivery_key, original_job_id)
                         SELECT $1, key, id FROM numbered),
            job AS (INSERT INTO export_jobs (id, tenant_id, status, version, destination_id, delivery_key,
                                             final_name, created_by, woken_at, attempt_id, attempt_count, claimed_by,
                                             lease_expires_at)
                    SELECT id, $1, 'Running', 1, $2, key, 'contacts-' || $1::text || '-' || key || '.csv', 'tests',
                           clock_timestamp(), attempt, 1, 'dead/0', clock_timestamp() - interval '1 minute'
                    FROM numbered RETURNING id, attempt_id)
            INSERT INTO export_attempt_events (job_id, attempt_id, kind, version, worker_id, recorded_at)
            SELECT id, attempt_id, 'Claimed', 1, 'dead/0', clock_timestamp() FROM job""",
            h.tenant_id, h.destination_id, jobs)
        report = await h.client.execute_workflow(
            "RecoveryWorkflow", RecoveryInput(limit=10), id=f"recovery-{uuid.uuid4().hex[:8]}",
            task_queue=h.settings.task_queue, result_type=RecoveryReport)
        assert report.nominated == 25
        assert sorted(str(t.job_id) for t in report.taken_over if t.recorded == "RequeuedByRecovery") == sorted(
            map(str, jobs))
        statuses = await h.db.admin.fetch("SELECT status FROM export_jobs WHERE id = ANY($1::uuid[])", jobs)
        assert {r["status"] for r in statuses} == {Status.QUEUED.value}
