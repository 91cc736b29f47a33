"""A Queued export cancelled while its claim waits for a build slot: the run follows its row at once, instead of
when another export's build ends (found by review). The branch is the patch `canceled-while-claiming`, which this
release understands and the next one writes (workflows/patches.py): here its worker activates it early."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.common import Priority

from activities import checkpoints
from activities.contracts import TEMPORAL_CANCEL_OPERATOR, ExportInput, ExportResult
from store.models import Status
from tests.helpers.crash import claim_waiting_for_a_build_slot, processes, start_worker
from tests.helpers.harness import held_at, release_held
from tests.helpers.support import eventually
from tests.workflows.test_crash import activity_runs, named
from workflows import patches
from workflows.identity import EXPORT_STATUS, export_workflow_id


@pytest.mark.spec("HI4", "LD1")
async def test_an_export_canceled_while_its_claim_waits_for_a_build_slot_ends_at_once(crash_harness):
    h = crash_harness
    async with processes(h) as started:
        await start_worker(started, h, hold_at=checkpoints.BUILD_STARTED, max_builds=1,
                           early_patches=patches.CANCELED_WHILE_CLAIMING)
        first, second = await claim_waiting_for_a_build_slot(h)
        try:
            cancel = await h.exports.cancel(tenant_id=h.tenant_id, job_id=second, requested_by="op",
                                            reason="not needed")
            assert cancel.outcome.value == "CanceledWhileQueued"
            handle = h.client.get_workflow_handle(export_workflow_id(second), result_type=ExportResult)
            try:
                result = await asyncio.wait_for(handle.result(), timeout=30)
            except TimeoutError:
                described = await handle.describe()
                raise AssertionError(
                    "the row is Canceled, but the run did not return within 30 s while the other build held the "
                    f"only slot: its ExportStatus says {described.typed_search_attributes.get(EXPORT_STATUS)!r}; "
                    f"its steps: {[(r.name, r.outcome) for r in await activity_runs(h, second)]}") from None
            assert result.status is Status.CANCELED
            assert (await h.store.read_job(first)).status is Status.RUNNING  # the slot was still held
            described = await handle.describe()
            assert described.typed_search_attributes.get(EXPORT_STATUS) == Status.CANCELED.value
            # The claim was given up before any worker took it, and the row read on the shared queue.
            history = await handle.fetch_history()
            types = [e.event_type for e in history.events]
            assert EventType.EVENT_TYPE_ACTIVITY_TASK_CANCEL_REQUESTED in types
            runs = await activity_runs(h, second)
            assert [r.outcome for r in named(runs, "claim_if_allowed")] != ["completed"]
            assert [r.outcome for r in named(runs, "evaluate_policy")] == ["completed"]
        finally:
            release_held(h.settings, checkpoints.BUILD_STARTED, first)
        assert (await h.settled(first)).status is Status.COMPLETED


@pytest.mark.spec("HI4")
async def test_without_the_patch_the_run_keeps_waiting_for_its_claim(crash_harness):
    """This release's default (the patch understood, not written, so that a rollback to 0.2.0 replays every run):
    the run learns of the cancellation when a build slot frees, and then ends Canceled. No marker is written."""
    h = crash_harness
    async with processes(h) as started:
        await start_worker(started, h, hold_at=checkpoints.BUILD_STARTED, max_builds=1)
        first, second = await claim_waiting_for_a_build_slot(h)
        handle = h.client.get_workflow_handle(export_workflow_id(second), result_type=ExportResult)
        try:
            cancel = await h.exports.cancel(tenant_id=h.tenant_id, job_id=second, requested_by="op",
                                            reason="not needed")
            assert cancel.outcome.value == "CanceledWhileQueued"
            await eventually(lambda: activity_runs(h, second),
                             lambda runs: any(r.name.startswith("record_cancellation") and r.outcome == "completed"
                                              for r in runs),
                             timeout=30, interval=0.2, what="the run recording the cancellation")
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(asyncio.shield(handle.result()), timeout=3)
        finally:
            release_held(h.settings, checkpoints.BUILD_STARTED, first)
        assert (await asyncio.wait_for(handle.result(), timeout=60)).status is Status.CANCELED
        history = await handle.fetch_history()
        assert not any(e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED
                       and patches.CANCELED_WHILE_CLAIMING.encode() in e.SerializeToString() for e in history.events)


@pytest.mark.spec("HI4", "LD1")
async def test_temporal_cancel_while_the_claim_waits_for_a_build_slot_cancels_the_queued_export(crash_harness):
    """The UI's Cancel (Temporal's cancel of the run) before the run has read its row: the run knows its tenant
    from its start, so it asks at once, and the export ends CanceledWhileQueued. Before, the request waited for the
    row, which came with the claim: once a build slot freed, the export was claimed, its build started, and the
    stop then ended it `Stopped`, a build late."""
    h = crash_harness
    async with processes(h) as started:
        await start_worker(started, h, hold_at=checkpoints.BUILD_STARTED, max_builds=1,
                           early_patches=patches.CANCELED_WHILE_CLAIMING)
        first, second = await claim_waiting_for_a_build_slot(h)
        handle = h.client.get_workflow_handle(export_workflow_id(second), result_type=ExportResult)
        try:
            await handle.cancel()
            await eventually(lambda: h.store.read_job(second), lambda r: r.status is not Status.QUEUED,
                             timeout=30, interval=0.2, what="the Temporal cancel reaching the row")
        finally:
            release_held(h.settings, checkpoints.BUILD_STARTED, first)
        result = await asyncio.wait_for(handle.result(), timeout=60)
        row = await h.store.read_job(second)
        assert (result.status, row.status, row.attempt_count) == (Status.CANCELED, Status.CANCELED, 0)
        requests = await h.db.admin.fetch(
            "SELECT requested_by, outcome FROM cancellation_requests WHERE job_id = $1", second)
        assert [r["outcome"] for r in requests] == ["CanceledWhileQueued"]
        assert requests[0]["requested_by"].startswith(TEMPORAL_CANCEL_OPERATOR)  # with the canceller's identity
        assert (await h.settled(first)).status is Status.COMPLETED


async def test_a_temporal_cancel_asked_for_a_wrong_start_tenant_is_asked_again_for_the_rows(crash_harness):
    """A run started by hand keyed to another tenant: the request asked before the row was read finds no export
    (and records nothing); once the claim reads the row, the row's tenant is asked, so the cancel is never lost."""
    h = crash_harness
    async with processes(h) as started:
        await start_worker(started, h, hold_at=checkpoints.BUILD_STARTED, max_builds=1,
                           early_patches=patches.CANCELED_WHILE_CLAIMING)
        first = await h.create()
        await held_at(h.settings, checkpoints.BUILD_STARTED, first)
        second = uuid.uuid4()
        handle = await h.client.start_workflow(
            "ExportWorkflow", ExportInput(job_id=second), id=export_workflow_id(second),
            task_queue=h.settings.task_queue, result_type=ExportResult,
            priority=Priority(fairness_key=str(uuid.uuid4())))
        await h.store.create_job(job_id=second, tenant_id=h.tenant_id, destination_id=h.destination_id,
                                 delivery_key=second.hex, created_by="tests")
        try:
            await handle.cancel()
            await eventually(lambda: activity_runs(h, second),
                             lambda runs: any(r.name.startswith("record_cancellation") and r.outcome == "completed"
                                              for r in runs),
                             timeout=30, interval=0.2, what="the request for the start's tenant asked")
            assert (await h.store.read_job(second)).status is Status.QUEUED  # that tenant has no such export
        finally:
            release_held(h.settings, checkpoints.BUILD_STARTED, first)
        result = await asyncio.wait_for(handle.result(), timeout=60)
        # Asked again for the row's tenant once the claim read the row (and claimed it: the slot had freed).
        assert result.status in (Status.STOPPED, Status.CANCELED)
        requests = await h.db.admin.fetch(
            "SELECT tenant_id, requested_by FROM cancellation_requests WHERE job_id = $1", second)
        assert [r["tenant_id"] for r in requests] == [h.tenant_id]
        assert requests[0]["requested_by"].startswith(TEMPORAL_CANCEL_OPERATOR)


async def test_a_temporal_cancel_whose_early_ask_found_the_row_busy_is_never_asked_again(crash_harness):
    """With the canceled-while-claiming branch, Temporal's cancel before the row is read is asked at once for the
    start's tenant, and `_temporal_cancel_asked_for` then suppresses the ask made once the row is read, whether or
    not the early ask recorded anything. When the early ask found the row locked (Busy through its five retries:
    "not recorded"), the cancel is simply gone: the claim then reads the row, claims it and builds, and no request
    is ever recorded (Temporal does not deliver a second cancel of the same run, so the UI cannot send it again).
    Without the patch the request waits for the row's read and is recorded then (StopRequested)."""
    early = True  # False (this release's default branch): the request is recorded once the row is read; passes
    h = crash_harness
    async with processes(h) as started:
        await start_worker(started, h, hold_at=checkpoints.BUILD_STARTED, max_builds=1,
                           **({"early_patches": patches.CANCELED_WHILE_CLAIMING} if early else {}))
        first, second = await claim_waiting_for_a_build_slot(h)
        handle = h.client.get_workflow_handle(export_workflow_id(second))
        locker = await h.db.connect("owner")
        try:
            transaction = locker.transaction()
            await transaction.start()
            await locker.execute("SELECT 1 FROM export_jobs WHERE id = $1 FOR UPDATE", second)
            await handle.cancel()
            if early:
                await eventually(lambda: handle.query("rejected_signals"),
                                 lambda said: any("stayed busy" in line for line in said), timeout=45, interval=0.5,
                                 what="the early ask given up as Busy")
            else:
                await asyncio.sleep(15)
            await transaction.rollback()  # the row free again, before the run reads it
            release_held(h.settings, checkpoints.BUILD_STARTED, first)  # the slot frees: the claim reads the row

            async def requests() -> list:
                return await h.db.admin.fetch(
                    "SELECT outcome FROM cancellation_requests WHERE job_id = $1", second)

            try:
                await eventually(requests, bool, timeout=30, interval=0.5,
                                 what="Temporal's cancel recorded for the export")
            except Exception as exc:
                row = await h.store.read_job(second)
                raise AssertionError(
                    f"Temporal's cancel, whose early ask was Busy, was never asked again once the row was read: no "
                    f"request recorded; the row went on to {row.status.value} (attempt {row.attempt_count})") from exc
        finally:
            await locker.close()
            release_held(h.settings, checkpoints.BUILD_STARTED, first)
            release_held(h.settings, checkpoints.BUILD_STARTED, second)
