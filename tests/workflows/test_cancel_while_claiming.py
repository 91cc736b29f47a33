"""A Queued export cancelled while its claim waits for a build slot: the run follows its row at once, instead of
when another export's build ends (found by review). The branch is the patch `canceled-while-claiming`, which this
release understands and the next one writes (workflows/patches.py): here its worker activates it early."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.api.enums.v1 import EventType

from activities import checkpoints
from activities.contracts import ExportResult
from store.models import Status
from tests.helpers.crash import claim_waiting_for_a_build_slot, processes, start_worker
from tests.helpers.harness import release_held
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
