"""Runs of the real export workflow whose steps are stand-ins the test controls: for interleavings that real steps
cannot be held at (a wake-up that reaches a settled run while it still records a cancellation)."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

from temporalio import activity
from temporalio.client import Client, WorkflowHandle
from temporalio.worker import Worker

from activities.contracts import (
    Admission,
    AdmitInput,
    CancelOutput,
    CancelRequest,
    Evaluation,
    ExportInput,
    ExportResult,
    Wake,
)
from store.models import CancellationOutcome, CancellationResult, FailureCode, JobRow, Status
from tests.helpers.support import eventually
from workflows import patches
from workflows.export import ExportWorkflow
from workflows.identity import admission_queue, export_workflow_id


async def woken_while_recording_a_cancel(client: Client) -> tuple[WorkflowHandle, ExportResult, list[Status]]:
    """A run reads its row Failed (settled) while it records a cancellation; meanwhile the row is corrected to
    Completed and the correction's wake-up reaches the run. Returns the run, its result and the states it read."""
    job_id, tenant_id = uuid.uuid4(), uuid.uuid4()
    now = datetime.now(UTC)
    states = {"status": Status.FAILED}
    first_read, recording = asyncio.Event(), asyncio.Event()
    reads: list[Status] = []

    def row() -> JobRow:
        failed = states["status"] is Status.FAILED
        return JobRow(id=job_id, tenant_id=tenant_id, status=states["status"], version=1,
                      destination_id=uuid.uuid4(), woken_at=now, delivery_key="k", created_by="tests",
                      final_name=f"contacts-{tenant_id}-k.csv",
                      failure_reason=FailureCode.NOT_DELIVERED if failed else None,
                      confirmed_by=None if failed else "correction")

    @activity.defn(name="claim_if_allowed")
    async def claim_if_allowed(_: AdmitInput) -> Admission:
        if not reads:
            await asyncio.wait_for(first_read.wait(), 30)  # held until the cancellation is in flight
        reads.append(states["status"])
        return Admission(evaluation=Evaluation(row=row()))

    @activity.defn(name="record_cancellation")
    async def record_cancellation(request: CancelRequest) -> CancelOutput:
        await asyncio.wait_for(recording.wait(), 30)  # held while the row settles and is corrected
        return CancelOutput(result=CancellationResult(request_id=request.request_id, job_id=job_id,
                                                      outcome=CancellationOutcome.ALREADY_ENDED,
                                                      found_status=states["status"]))

    queue = f"late-wake-{uuid.uuid4().hex[:8]}"
    async with Worker(client, task_queue=queue, workflows=[ExportWorkflow], activities=[record_cancellation],
                      patch_activation_callback=patches.activates), \
            Worker(client, task_queue=admission_queue(queue), activities=[claim_if_allowed]):
        handle = await client.start_workflow(ExportWorkflow.run, ExportInput(job_id=job_id),
                                             id=export_workflow_id(job_id), task_queue=queue,
                                             result_type=ExportResult)
        await handle.signal("cancel", {"request_id": str(uuid.uuid4()), "tenant": str(tenant_id),
                                       "operator": "ann@example.com"})
        first_read.set()  # the run reads Failed, settled, and waits for the cancellation it is recording
        await eventually(lambda: asyncio.sleep(0, list(reads)), lambda r: r == [Status.FAILED], timeout=10,
                         what="the first read")
        states["status"] = Status.COMPLETED  # a correction, whose outbox row wakes the run
        await handle.signal("wake", Wake(message_id=uuid.uuid4()))
        recording.set()
        result = await asyncio.wait_for(handle.result(), 30)
    return handle, result, reads
