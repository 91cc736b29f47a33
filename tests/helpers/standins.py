"""Runs of the real export workflow whose steps are stand-ins the test controls: for interleavings that real steps
cannot be held at (a wake-up that reaches a settled run while it still records a cancellation)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHandle, WorkflowHistory
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError
from temporalio.worker import PatchActivationInput, Worker

from activities.contracts import (
    Admission,
    AdmitInput,
    AttemptInput,
    AuthorizeInput,
    AuthorizeOutput,
    BuildOutput,
    CancelBatch,
    CancelBatchOutput,
    CancelOutput,
    CancelRequest,
    Evaluation,
    ExportInput,
    ExportResult,
    Wake,
)
from store.models import CancellationOutcome, CancellationResult, FailureCode, JobRow, Status
from tests.helpers.store_states import built_file
from tests.helpers.support import eventually
from workflows import patches
from workflows.export import _BEFORE_CONTINUING_AS_NEW, ExportWorkflow
from workflows.identity import admission_queue, export_workflow_id


def cutoff_2_given_up_steps(queue: str, fail_when: asyncio.Event | None = None) -> list:
    """A build that hands its file to `queue`, and a cutoff 2 that fails as one Temporal gave up does (once
    `fail_when` is set, if given): the steps before the run's read after a give-up."""

    @activity.defn(name="build")
    async def build(attempt: AttemptInput) -> BuildOutput:
        return BuildOutput(file=built_file(attempt.job.final_name), worker_task_queue=queue)

    @activity.defn(name="authorize_delivery")
    async def authorize_delivery(_: AuthorizeInput) -> AuthorizeOutput:
        if fail_when is not None:
            await asyncio.wait_for(fail_when.wait(), 60)
        raise ApplicationError("stand-in: Temporal gave cutoff 2 up", non_retryable=True)

    return [build, authorize_delivery]


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


_JUNK_SIGNALS = 30


@dataclass
class CancelBeforeTheRow:
    recorded: list[str]  # who asked for each request the run recorded
    runs: int  # of the workflow
    marked: bool  # the first run recorded the marker of `cancel-before-continuing-as-new`
    first_run: WorkflowHistory


WITH_CANCEL_UPDATE = patches.activation(frozenset({patches.CANCEL_UPDATE}))


def cancel_update_alone(request: PatchActivationInput) -> bool:
    """What a worker activated before `cancel-before-continuing-as-new` came with `cancel-update`."""
    return patches.activates(request) or request.patch_id == patches.CANCEL_UPDATE


def pause_at_every_chance(request: PatchActivationInput) -> bool:
    """What a worker activated before `pause-once-before-continuing-as-new` came with `cancel-update`: the pause
    before each chance to continue as new."""
    return patches.activates(request) or request.patch_id in (patches.CANCEL_UPDATE,
                                                              patches.CANCEL_BEFORE_CONTINUING_AS_NEW)


async def temporal_cancel_before_the_row(
        client: Client, *, cancel_comes: str = "apart",
        activates: Callable[[PatchActivationInput], bool] = WITH_CANCEL_UPDATE,
) -> CancelBeforeTheRow:
    """A run that takes the cancel Update (the worker `activates` its patch) whose first claim failed, so
    it has never read its row, is cancelled through Temporal; junk signals make Temporal suggest continuing as new
    (the server the caller connected to suggests it early), and only then does the claim read the row.

    `cancel_comes`: "apart", the cancel and then the signals to a polled queue; "with-signals", both while no worker
    polls the run's queue (a worker paused or replaced), so that one workflow task brings them; "with-the-pause",
    the signals first, and the cancel while no worker polls, once the run has started its pause before continuing
    as new and that pause has passed, so that one task brings the cancel and the pause's end."""
    job_id, tenant_id = uuid.uuid4(), uuid.uuid4()
    claim_fails = asyncio.Event()
    claim_fails.set()
    recorded: list[str] = []

    @activity.defn(name="claim_if_allowed")
    async def claim_if_allowed(_: AdmitInput) -> Admission:
        if claim_fails.is_set():
            raise ApplicationError("the database is away (a stand-in)", non_retryable=True)
        return Admission(evaluation=Evaluation(row=JobRow(
            id=job_id, tenant_id=tenant_id, status=Status.QUEUED, version=1, destination_id=uuid.uuid4(),
            woken_at=datetime.now(UTC), delivery_key="k", created_by="tests",
            final_name=f"contacts-{tenant_id}-k.csv")))

    @activity.defn(name="record_cancellations")
    async def record_cancellations(batch: CancelBatch) -> CancelBatchOutput:
        recorded.extend(request.requested_by for request in batch.requests)
        return CancelBatchOutput(results=[CancellationResult(request_id=request.request_id, job_id=job_id,
                                                             outcome=CancellationOutcome.STOP_REQUESTED,
                                                             found_status=Status.QUEUED)
                                          for request in batch.requests])

    async def junk(handle: WorkflowHandle) -> None:
        for _ in range(_JUNK_SIGNALS):
            await handle.signal("cancel", {"junk": True})

    async def wake_once_taken(handle: WorkflowHandle) -> CancelBeforeTheRow:
        if cancel_comes == "apart":  # it took the cancel and the signals: it continued as new, or took them
            await eventually(lambda: _events(first, EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED), lambda n: n >= 3,
                             timeout=30, interval=0.1, what="the run took the cancel and the signals")
        else:  # it continued as new, or its pause before continuing ended
            await eventually(lambda: _events(first, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW,
                                             EventType.EVENT_TYPE_TIMER_FIRED), lambda n: n >= 1,
                             timeout=30, interval=0.1, what="the run took the cancel and the signals")
        claim_fails.clear()
        await handle.signal("wake", Wake(message_id=uuid.uuid4()))
        await eventually(lambda: _recorded_or_nothing_to_record(handle, recorded), bool, timeout=20, interval=0.2,
                         what="a request recorded, or the row read with none to record, after the wake-up")
        if recorded:  # then the first run, with nothing left to record, continues as new
            await eventually(lambda: _events(first, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW),
                             lambda n: n == 1, timeout=20, interval=0.2, what="the first run continued as new")
        runs = len([w async for w in client.list_workflows(f"WorkflowId = '{handle.id}'")])
        with contextlib.suppress(RPCError):  # closed already: the run ended Canceled, as a workflow, unrecorded
            await handle.terminate("test over")
        history = await first.fetch_history()
        return CancelBeforeTheRow(list(recorded), runs, records_patch(history, patches.CANCEL_BEFORE_CONTINUING_AS_NEW),
                                  history)

    queue = f"early-cancel-{uuid.uuid4().hex[:8]}"

    def workflow_worker() -> Worker:
        return Worker(client, task_queue=queue, workflows=[ExportWorkflow], activities=[record_cancellations],
                      patch_activation_callback=activates)

    async with Worker(client, task_queue=admission_queue(queue), activities=[claim_if_allowed]):
        async with workflow_worker():
            handle = await client.start_workflow(ExportWorkflow.run, ExportInput(job_id=job_id),
                                                 id=export_workflow_id(job_id), task_queue=queue,
                                                 result_type=ExportResult)
            first = client.get_workflow_handle(handle.id, run_id=handle.first_execution_run_id)
            await eventually(lambda: _events(handle, EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED), lambda n: n >= 1,
                             timeout=30, interval=0.1, what="the first claim failed")
            if cancel_comes == "apart":
                await handle.cancel()
                await junk(handle)
                return await wake_once_taken(handle)
            # The idle recheck's timer: the run has ended the task that took the failure, and waits.
            await eventually(lambda: _events(handle, EventType.EVENT_TYPE_TIMER_STARTED), lambda n: n >= 1,
                             timeout=30, interval=0.1, what="the run waiting for a wake-up")
            if cancel_comes == "with-the-pause":
                sending = asyncio.create_task(junk(handle))
                # Stopped at once (the worker stops in milliseconds): the pause's end finds no worker.
                await eventually(lambda: _events(first, EventType.EVENT_TYPE_TIMER_STARTED), lambda n: n >= 2,
                                 timeout=30, interval=0.02, what="the run's pause before continuing as new")
        if cancel_comes == "with-the-pause":
            await sending
            await asyncio.sleep(_BEFORE_CONTINUING_AS_NEW.total_seconds() + 0.5)
            await handle.cancel()
            brought_with_the_cancel = EventType.EVENT_TYPE_TIMER_FIRED, 1
        else:
            await handle.cancel()
            await junk(handle)
            brought_with_the_cancel = EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED, _JUNK_SIGNALS
        async with workflow_worker():
            taken = await wake_once_taken(handle)
        assert await _one_task_with_the_cancel(first, *brought_with_the_cancel), \
            f"the cancel and {cancel_comes.removeprefix('with-').replace('-', ' ')} did not reach the run in one task"
        return taken


async def _one_task_with_the_cancel(handle: WorkflowHandle, kind: int, count: int) -> bool:
    """Whether the workflow task that brought Temporal's cancel to the run also brought `count` events of `kind`
    (and none came after the task before it), Temporal suggesting to continue as new."""
    events = list((await handle.fetch_history()).events)
    kinds = [event.event_type for event in events]
    cancel = kinds.index(EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CANCEL_REQUESTED)
    before = max(i for i, k in enumerate(kinds[:cancel]) if k == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED)
    after = kinds.index(EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED, cancel)
    started = [event for event in events[cancel:after]
               if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED][-1]
    return (kinds[before:after].count(kind) == count
            and started.workflow_task_started_event_attributes.suggest_continue_as_new)


async def _recorded_or_nothing_to_record(handle: WorkflowHandle, recorded: list[str]) -> bool:
    """Whether a request was recorded, or the latest run read its row (a step completed; the stand-ins' only other
    step records) and completed the task that took the row without scheduling a record: a cancel it knew of would
    be a request by then."""
    if recorded:
        return True
    kinds = [event.event_type for event in (await handle.fetch_history()).events]
    if EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED not in kinds:
        return False
    read = len(kinds) - 1 - kinds[::-1].index(EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED)
    after = kinds[read:]
    return (EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED in after
            and EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED not in after)


def records_patch(history: WorkflowHistory, patch_id: str) -> bool:
    """Whether the run recorded the patch's marker (took its branch)."""
    return any(event.event_type == EventType.EVENT_TYPE_MARKER_RECORDED
               and patch_id.encode() in event.SerializeToString() for event in history.events)


def pauses_before_continuing(history: WorkflowHistory) -> int:
    """How many pauses before continuing as new (`_wait_for_wake`) the run began: its timers of that length."""
    return sum(1 for event in history.events if event.event_type == EventType.EVENT_TYPE_TIMER_STARTED
               and event.timer_started_event_attributes.start_to_fire_timeout.ToTimedelta()
               == _BEFORE_CONTINUING_AS_NEW)


async def _events(handle: WorkflowHandle, *kinds: int) -> int:
    return sum(1 for event in (await handle.fetch_history()).events if event.event_type in kinds)
