"""Records the histories that test_replay.py replays. Run it with `make histories`.

`make test` does not collect this module (pytest collects test_*.py files only); named on the command line, it
runs each case against the real components, the way the suite's own tests produce that outcome, checks that the
run ended as the case says, and writes the run's history to histories/<case>.json, replacing the file of that
name. docs/changing-workflows.md says when to record again, and which files to keep first.
"""

from __future__ import annotations

import asyncio
import uuid
from contextlib import AsyncExitStack

from temporalio.client import Client

from activities.contracts import PartnerSweepOutput, RecoveryInput, RecoveryReport, SweepInput
from store.models import CancellationOutcome, Status
from tests.helpers.crash import (
    crash_world,
    processes,
    recorded_for,
    recovery_only_worker,
    start_worker,
    wait_lease_expired,
)
from tests.helpers.harness import Harness, building, held_at, open_harness, stranded_in_queued, unknown_original
from tests.helpers.support import eventually
from tests.replay.history_files import save
from worker import running_worker
from workflows.identity import export_workflow_id


async def record(client: Client, workflow_id: str, case: str) -> None:
    save(case, await client.get_workflow_handle(workflow_id).fetch_history())


async def record_export(h: Harness, job_id: uuid.UUID, case: str) -> None:
    await record(h.client, export_workflow_id(job_id), case)


async def test_export_completed(harness: Harness):
    job_id = await harness.create()
    assert (await harness.settled(job_id)).status is Status.COMPLETED
    await record_export(harness, job_id, "export_completed")


async def test_export_stopped_by_cancel(slow_build_harness: Harness):
    h = slow_build_harness
    job_id = await h.create()
    await building(h, job_id)
    result = await h.exports.cancel(tenant_id=h.tenant_id, job_id=job_id, requested_by="ops@example.com",
                                    reason="wrong list")
    assert result.outcome is CancellationOutcome.STOP_REQUESTED
    assert (await h.settled(job_id)).status is Status.STOPPED
    await record_export(h, job_id, "export_stopped_by_cancel")


async def test_export_stopped_by_temporal_cancel(slow_build_harness: Harness):
    h = slow_build_harness
    job_id = await h.create()
    await building(h, job_id)
    await h.client.get_workflow_handle(export_workflow_id(job_id)).cancel()
    assert (await h.settled(job_id)).status is Status.STOPPED
    await record_export(h, job_id, "export_stopped_by_temporal_cancel")


async def test_export_canceled_while_queued(db, store, client, tmp_path):
    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path, in_process_worker=False)
        job_id = await h.create()
        result = await h.exports.cancel(tenant_id=h.tenant_id, job_id=job_id, requested_by="ops@example.com",
                                        reason="not this week")
        assert result.outcome is CancellationOutcome.CANCELED_WHILE_QUEUED
        # The worker (and its dispatcher) only now: the workflow starts on a row that is already Canceled.
        async with running_worker(h.settings, h.client):
            # The row is settled already: wait for the dispatcher's start of the workflow before its result.
            await eventually(lambda: h.db.admin.fetchval(
                "SELECT count(*) FROM outbox WHERE job_id = $1 AND published_at IS NULL", job_id),
                lambda unpublished: unpublished == 0, timeout=30, what=f"the wake-up of {job_id} published")
            assert (await h.settled(job_id)).status is Status.CANCELED
        await record_export(h, job_id, "export_canceled_while_queued")


async def test_export_rejected(harness: Harness):
    await harness.db.admin.execute("UPDATE destinations SET enabled = false WHERE id = $1", harness.destination_id)
    job_id = await harness.create()
    assert (await harness.settled(job_id)).status is Status.REJECTED
    await record_export(harness, job_id, "export_rejected")


async def test_export_outcome_unknown(harness: Harness):
    job_id, _ = await unknown_original(harness)
    await record_export(harness, job_id, "export_outcome_unknown")


async def test_export_resumed_after_crash(db, store, client, tmp_path):
    """The building worker is killed; another resumes the build under the same attempt and delivers."""
    async with crash_world(db, store, client, tmp_path) as h, processes(h) as started:
        crashing = await start_worker(started, h, hold_at="build_started")
        job_id = await h.create()
        await held_at(h.settings, "build_started", job_id)
        await start_worker(started, h)
        crashing.kill()
        row = await h.settled(job_id)
        assert (row.status, row.attempt_count) == (Status.COMPLETED, 1)
        await record_export(h, job_id, "export_resumed_after_crash")


async def test_export_requeued_by_recovery_and_recovery_run(db, store, client, tmp_path):
    """The building worker is killed while no other runs; recovery requeues the attempt, and a new worker's
    second attempt delivers. Records both the export and the recovery run that took it over."""
    async with crash_world(db, store, client, tmp_path) as h, processes(h) as started:
        crashing = await start_worker(started, h, hold_at="build_started")
        job_id = await h.create()
        await held_at(h.settings, "build_started", job_id)
        crashing.kill()
        await wait_lease_expired(h, job_id)
        recovery_id = f"recovery-{uuid.uuid4().hex[:8]}"
        async with recovery_only_worker(h) as queue:
            report = await asyncio.wait_for(h.client.execute_workflow(
                "RecoveryWorkflow", RecoveryInput(limit=h.settings.recovery_batch), id=recovery_id,
                task_queue=queue, result_type=RecoveryReport), timeout=30)
        assert recorded_for(report, job_id) == ["RequeuedByRecovery"]
        await start_worker(started, h)
        row = await h.settled(job_id)
        assert (row.status, row.attempt_count) == (Status.COMPLETED, 2)
        await record_export(h, job_id, "export_requeued_by_recovery")
        await record(h.client, recovery_id, "recovery_requeued_one")


async def test_sweeper_swept_one(harness: Harness):
    h = harness
    job_id = await stranded_in_queued(h)
    sweep_id = f"sweep-{uuid.uuid4().hex[:8]}"
    swept = await asyncio.wait_for(h.client.execute_workflow(
        "SweeperWorkflow", SweepInput(threshold_seconds=1800, batch=10), id=sweep_id,
        task_queue=h.settings.task_queue, result_type=int), timeout=30)
    assert swept == 1
    assert (await h.settled(job_id)).status is Status.COMPLETED
    await record(h.client, sweep_id, "sweeper_swept_one")


async def test_partner_sweep(harness: Harness):
    sweep_id = f"partner-sweep-{uuid.uuid4().hex[:8]}"
    swept = await asyncio.wait_for(harness.client.execute_workflow(
        "PartnerSweepWorkflow", id=sweep_id, task_queue=harness.settings.task_queue,
        result_type=list[PartnerSweepOutput]), timeout=30)
    assert [s.destination_id for s in swept] == [harness.destination_id]
    await record(harness.client, sweep_id, "partner_sweep_one_destination")
