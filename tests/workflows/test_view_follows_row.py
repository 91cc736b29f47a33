"""The view never lies after a run closed early (matrix FG2, LV7, FG5), against real PostgreSQL, Temporal and SFTP.

A run terminated after cutoff 2 (the README's way to simulate a crash) leaves the upload to finish, or recovery to
resolve it; a run terminated while its export is Queued leaves nothing to drive it; a second raw start of an export
that exists fails. In each case the latest run of the export's workflow must come to say what the row says, within
one recovery interval: its result and its ExportStatus.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError

from activities.contracts import ExportResult, RecoveryInput, RecoveryReport
from store.models import Status
from tests.helpers.crash import processes, recorded_for, start_worker, wait_lease_expired
from tests.helpers.harness import Harness, held_at, run_recovery
from tests.helpers.partner import outbound_names
from tests.helpers.support import eventually
from workflows.identity import EXPORT_STATUS, export_workflow_id

BOUND = 30.0
# How long the latest run may take to tell the row's state once recovery has run (or, without recovery, once the
# row settled): a dispatcher's publication and one run's first step, far less than any recovery interval.
TELLS_WITHIN = 10.0


async def run_id(h: Harness, job_id: uuid.UUID) -> str:
    return (await h.client.get_workflow_handle(export_workflow_id(job_id)).describe()).run_id


async def latest_tells(h: Harness, job_id: uuid.UUID, status: Status, *, not_run: str) -> ExportResult:
    """The latest run of the export's workflow is a new one, closed with the row's state as result and as its
    ExportStatus, within TELLS_WITHIN seconds."""
    handle: WorkflowHandle = h.client.get_workflow_handle(export_workflow_id(job_id), result_type=ExportResult)

    async def latest() -> tuple[str, WorkflowExecutionStatus | None, str | None]:
        described = await handle.describe()
        return described.run_id, described.status, described.typed_search_attributes.get(EXPORT_STATUS)

    await eventually(latest, lambda found: found[0] != not_run and found[1] is WorkflowExecutionStatus.COMPLETED
                     and found[2] == status.value, timeout=TELLS_WITHIN, interval=0.2,
                     what=f"the latest run of {job_id} to say {status.value}")
    result = await asyncio.wait_for(handle.result(), BOUND)
    assert result.status is status
    return result


async def terminated_showing(h: Harness, job_id: uuid.UUID, run: str) -> str | None:
    described = await h.client.get_workflow_handle(export_workflow_id(job_id), run_id=run).describe()
    assert described.status is WorkflowExecutionStatus.TERMINATED
    return described.typed_search_attributes.get(EXPORT_STATUS)


@pytest.mark.spec("FG2")
async def test_terminated_during_the_upload__the_next_run_says_completed(slow_upload_harness: Harness):
    """The upload runs on past the Terminate and makes its terminal write; having been told its run is gone (the
    activity's cancellation), it wakes the export, and a new run says Completed."""
    h = slow_upload_harness
    job_id = await h.create()
    await eventually(lambda: h.store.read_job(job_id), lambda r: r.status is Status.DELIVERING, timeout=BOUND,
                     interval=0.05, what="cutoff 2")
    # Bytes on their way: the upload has begun (a Terminate before the step starts leaves it to recovery).
    await eventually(lambda: asyncio.sleep(0, list((h.partner.root / "incoming-tmp").iterdir())), bool,
                     timeout=BOUND, interval=0.05, what="the upload under way")
    first = await run_id(h, job_id)
    await h.client.get_workflow_handle(export_workflow_id(job_id)).terminate(reason="simulating a crash")
    row = await eventually(lambda: h.store.read_job(job_id), lambda r: r.status.is_settled, timeout=BOUND,
                           interval=0.1, what="the upload's terminal write")
    assert row.status is Status.COMPLETED
    assert outbound_names(h.partner) == [row.final_name]
    # The terminal write woke the export: its own outbox row, besides the creation's.
    kinds = await h.db.admin.fetch("SELECT kind FROM outbox WHERE job_id = $1 ORDER BY created_at", job_id)
    assert [k["kind"] for k in kinds] == ["ExportReady", "ExportChanged"]
    assert await terminated_showing(h, job_id, first) == "Delivering"
    await latest_tells(h, job_id, Status.COMPLETED, not_run=first)


@pytest.mark.spec("FG2")
async def test_terminated_then_its_worker_killed_after_cutoff_2__recovery_makes_the_next_run_say_so(crash_harness):
    """Cutoff 2 committed, the run terminated, the worker killed before it sent a byte. Recovery takes the attempt
    back (it never passed its rename fence), and its statement wakes the export: a new run delivers it and says
    Completed."""
    h = crash_harness
    async with processes(h) as started:
        crashing = await start_worker(started, h, hold_at="before_upload")
        job_id = await h.create()
        await held_at(h.settings, "before_upload", job_id)
        first = await run_id(h, job_id)
        await h.client.get_workflow_handle(export_workflow_id(job_id)).terminate(reason="simulating a crash")
        crashing.kill()
        await start_worker(started, h)
        await wait_lease_expired(h, job_id)
        report = await asyncio.wait_for(run_recovery(h.client, h.settings), timeout=BOUND)
        assert recorded_for(report, job_id) == ["RequeuedByRecovery"]
        assert await terminated_showing(h, job_id, first) == "Delivering"
        await latest_tells(h, job_id, Status.COMPLETED, not_run=first)
    row = await h.store.read_job(job_id)
    assert row.status is Status.COMPLETED and row.attempt_count == 2
    assert outbound_names(h.partner) == [row.final_name]


async def _claim_failed(h: Harness, job_id: uuid.UUID) -> WorkflowHandle:
    """The export's run, once its claim step has failed (the application role lost a grant): waiting for a wake-up."""
    handle = h.client.get_workflow_handle(export_workflow_id(job_id))

    async def claim_failed() -> bool:
        try:
            history = await handle.fetch_history()
        except RPCError:
            return False  # the dispatcher has not started the workflow yet
        return any(e.HasField("activity_task_failed_event_attributes") for e in history.events)

    await eventually(claim_failed, bool, timeout=BOUND, interval=0.1, what="the claim step failed")
    return handle


@pytest.mark.spec("LV7", "FG2")
async def test_terminated_while_queued__recovery_wakes_it_and_it_is_delivered(harness: Harness):
    """The run's claim step fails for good (the application role lost a grant) and the run waits for a wake-up;
    it is terminated there, the grant comes back, and the row stays Queued with no run to drive it. The next
    recovery run finds the closed run and wakes the export; a new run claims and delivers it."""
    h = harness
    await h.db.admin.execute("REVOKE SELECT ON destinations FROM exports_app")
    try:
        job_id = await h.create()
        handle = await _claim_failed(h, job_id)
        first = await run_id(h, job_id)
        await handle.terminate(reason="simulating a crash")
    finally:
        await h.db.admin.execute("GRANT SELECT ON destinations TO exports_app")
    await asyncio.sleep(1.0)  # a wake-up would have come by now, were one on its way
    assert (await h.store.read_job(job_id)).status is Status.QUEUED
    assert await h.db.admin.fetchval("SELECT count(*) FROM outbox WHERE job_id = $1 AND published_at IS NULL",
                                     job_id) == 0

    await asyncio.wait_for(run_recovery(h.client, h.settings), timeout=BOUND)
    await latest_tells(h, job_id, Status.COMPLETED, not_run=first)
    row = await h.store.read_job(job_id)
    assert row.status is Status.COMPLETED and row.attempt_count == 1
    assert outbound_names(h.partner) == [row.final_name]


@pytest.mark.spec("FG5")
async def test_a_second_raw_start_of_a_completed_export_never_becomes_the_run_that_tells(harness: Harness):
    """Started again by a raw client with other terms (another created_by), the export's workflow fails with
    ExportIdTaken and writes nothing; by the next recovery run, the latest run says Completed again."""
    h = harness
    job_id = uuid.uuid4()
    create = {"job_id": str(job_id), "tenant_id": str(h.tenant_id), "destination_id": str(h.destination_id),
              "created_by": "platform-team", "delivery_key": f"k{job_id.hex[:10]}"}
    first = await h.client.start_workflow("ExportWorkflow", {"job_id": str(job_id), "create": create},
                                          id=export_workflow_id(job_id), task_queue=h.settings.task_queue,
                                          result_type=ExportResult)
    assert (await asyncio.wait_for(first.result(), BOUND)).status is Status.COMPLETED
    before = await h.db.admin.fetch("SELECT * FROM export_jobs WHERE id = $1", job_id)

    second = await h.client.start_workflow(
        "ExportWorkflow", {"job_id": str(job_id), "create": {**create, "created_by": "someone-else",
                                                            "delivery_key": "another-key"}},
        id=export_workflow_id(job_id), task_queue=h.settings.task_queue)
    with pytest.raises(WorkflowFailureError) as failed:
        await asyncio.wait_for(second.result(), BOUND)
    assert isinstance(failed.value.cause, ApplicationError)
    assert await h.db.admin.fetch("SELECT * FROM export_jobs WHERE id = $1", job_id) == before

    await asyncio.wait_for(run_recovery(h.client, h.settings), timeout=BOUND)
    await latest_tells(h, job_id, Status.COMPLETED, not_run=second.result_run_id or "")


@pytest.mark.spec("FG5")
async def test_a_raw_start_naming_an_unknown_destination_fails_with_the_clis_line(quiet_harness: Harness):
    h = quiet_harness
    job_id = uuid.uuid4()
    create = {"job_id": str(job_id), "tenant_id": str(h.tenant_id), "destination_id": str(uuid.uuid4()),
              "created_by": "platform-team", "delivery_key": f"k{job_id.hex[:10]}"}
    handle = await h.client.start_workflow("ExportWorkflow", {"job_id": str(job_id), "create": create},
                                           id=export_workflow_id(job_id), task_queue=h.settings.task_queue)
    with pytest.raises(WorkflowFailureError) as failed:
        await asyncio.wait_for(handle.result(), BOUND)
    cause = failed.value.cause
    assert isinstance(cause, ApplicationError) and cause.non_retryable
    assert cause.message == "the export was not created: no such destination for this tenant", cause.message
    for table in ("export_jobs", "deliveries", "outbox", "export_attempt_events"):
        assert await h.db.admin.fetchval(f"SELECT count(*) FROM {table}") == 0, table


async def _recovery(h: Harness, limit: int) -> RecoveryReport:
    return await asyncio.wait_for(h.client.execute_workflow(
        "RecoveryWorkflow", RecoveryInput(limit=limit), id=f"recovery-{uuid.uuid4().hex[:8]}",
        task_queue=h.settings.task_queue, result_type=RecoveryReport), 30)


@pytest.mark.spec("LV7", "FG2")
async def test_terminated_queued_exports_beyond_one_batch_are_each_replaced(harness: Harness):
    """Two exports terminated while Queued, recovery's batch of one. The first run replaces one of them; the next
    run must replace the other (LV7: within one recovery interval; here, two). The replaced export's old,
    terminated run still matches recovery's visibility query (it closed showing Queued), and is only skipped once
    listed: it took the batch's one place, and the other export was never found (seen failing so; the look now
    counts the latest runs it finds, not the runs it lists)."""
    h = harness
    await h.db.admin.execute("REVOKE SELECT ON destinations FROM exports_app")
    jobs = []
    try:
        for _ in range(2):
            job_id = await h.create()
            handle = await _claim_failed(h, job_id)
            await handle.terminate(reason="simulating a crash")
            jobs.append(job_id)
            await asyncio.sleep(1.1)  # distinct close times
    finally:
        await h.db.admin.execute("GRANT SELECT ON destinations TO exports_app")

    for _ in range(3):  # three recovery intervals
        await asyncio.sleep(1.5)  # beyond the activity's one-look-per-run gap
        await _recovery(h, limit=1)
        await asyncio.sleep(3.0)  # a woken export is claimed and delivered well within this
    rows = {j: (await h.store.read_job(j)).status for j in jobs}
    views = {}
    for j in jobs:
        d = await h.client.get_workflow_handle(export_workflow_id(j)).describe()
        views[j] = (d.status, d.typed_search_attributes.get(EXPORT_STATUS))
    assert all(s is Status.COMPLETED for s in rows.values()), (
        f"after three recovery runs (batch 1) rows are {[(str(j)[:8], s.value) for j, s in rows.items()]}, latest "
        f"runs {[(str(j)[:8], v[0].name if v[0] else None, v[1]) for j, v in views.items()]}")
