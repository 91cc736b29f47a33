"""The pause before a run continues as new (`_wait_for_wake`, patches `cancel-before-continuing-as-new` and
`pause-once-before-continuing-as-new`), with cancels that keep coming: the real ExportWorkflow on a Temporal dev
server of the test's own, whose suggestion to continue as new (and, where said, hard limit on a run's events) is
lowered; its steps are stand-ins (no PostgreSQL). Found by review: a run that paused at every chance could be kept
from continuing as new, and from reading its row, for good."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest
from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHandle, WorkflowUpdateStage
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError
from temporalio.worker import Replayer, Worker

from activities.contracts import (
    TEMPORAL_CANCEL_OPERATOR,
    Admission,
    AdmitInput,
    CancelBatch,
    CancelBatchOutput,
    Evaluation,
    ExportInput,
    ExportResult,
)
from store.models import CancellationOutcome, CancellationResult, JobRow, Status
from tests.helpers.own_temporal import own_server
from tests.helpers.standins import WITH_CANCEL_UPDATE, pauses_before_continuing, records_patch
from tests.helpers.support import eventually
from worker import workflow_interceptors
from workflows import patches
from workflows.export import ExportWorkflow
from workflows.identity import admission_queue, export_workflow_id

SUGGEST_AFTER = 20
HISTORY_LIMIT = 300  # the server's hard limit on a run's events (51,200 by default), lowered as the suggestion is
# A run that paused at every chance never continued as new when (RECORD_TAKES + the 1 s pause) mod PERIOD <
# RECORD_TAKES: each pause ended with the next request in flight (1.5/1.0, 0.6/0.3 and 0.7/0.5 all did).
PERIOD = 1.5  # s between two requests of the trickle
RECORD_TAKES = 1.0  # s a recording takes (a slow database, a lock wait)
TRICKLE_FOR = 40.0


class _World:
    """The stand-in steps: a row held by another attempt (the run waits between attempts), each read counted, and
    recordings that take `record_takes` seconds, then record, or fail for good (`recording_fails`)."""

    def __init__(self, record_takes: float, *, idle_recheck: float | None = None,
                 recording_fails: bool = False) -> None:
        self.job_id, self.tenant_id = uuid.uuid4(), uuid.uuid4()
        self.recorded: list[str] = []
        self.reads: list[float] = []  # when each read of the row came
        self.record_takes = record_takes
        self.idle_recheck = idle_recheck
        self.recording_fails = recording_fails

    def activities(self):
        @activity.defn(name="claim_if_allowed")
        async def claim_if_allowed(_: AdmitInput) -> Admission:
            self.reads.append(time.monotonic())
            # Running, held by an attempt that is not this run's (no claim): the run waits between attempts.
            row = JobRow(id=self.job_id, tenant_id=self.tenant_id, status=Status.RUNNING, version=2,
                         destination_id=uuid.uuid4(), attempt_id=uuid.uuid4(), attempt_count=1,
                         woken_at=datetime.now(UTC), delivery_key="k", created_by="tests",
                         final_name=f"contacts-{self.tenant_id}-k.csv")
            if self.idle_recheck is None:
                return Admission(evaluation=Evaluation(row=row))
            return Admission(evaluation=Evaluation(row=row), idle_recheck_seconds=self.idle_recheck)

        @activity.defn(name="record_cancellations")
        async def record_cancellations(batch: CancelBatch) -> CancelBatchOutput:
            await asyncio.sleep(self.record_takes)
            if self.recording_fails:
                raise ApplicationError("the database refused it (a stand-in)", non_retryable=True)
            self.recorded.extend(request.requested_by for request in batch.requests)
            return CancelBatchOutput(results=[CancellationResult(
                request_id=request.request_id, job_id=self.job_id,
                outcome=CancellationOutcome.STOP_ALREADY_REQUESTED, found_status=Status.RUNNING)
                for request in batch.requests])

        @activity.defn(name="record_cancellation")
        async def record_cancellation(_: object) -> None:
            raise ApplicationError("the database refused it (a stand-in)", non_retryable=True)

        return claim_if_allowed, [record_cancellations, record_cancellation]

    @contextlib.asynccontextmanager
    async def waiting_run(self, client: Client) -> AsyncIterator[WorkflowHandle]:
        """The export's first run, on workers of its own, once it waits between attempts."""
        queue = f"pause-once-{uuid.uuid4().hex[:8]}"
        claim, records = self.activities()
        async with Worker(client, task_queue=admission_queue(queue), activities=[claim]), \
                Worker(client, task_queue=queue, workflows=[ExportWorkflow], activities=records,
                       patch_activation_callback=WITH_CANCEL_UPDATE):
            handle = await client.start_workflow(ExportWorkflow.run, ExportInput(job_id=self.job_id),
                                                 id=export_workflow_id(self.job_id), task_queue=queue,
                                                 result_type=ExportResult)
            first = client.get_workflow_handle(handle.id, run_id=handle.first_execution_run_id)
            await eventually(lambda: _kinds(first), lambda k: EventType.EVENT_TYPE_TIMER_STARTED in k, timeout=30,
                             interval=0.1, what="the run waiting between attempts")
            yield first

    def request(self, request_id: uuid.UUID, operator: str = "ann@example.com") -> dict[str, str]:
        return {"request_id": str(request_id), "tenant": str(self.tenant_id), "operator": operator,
                "reason": "wrong list"}


async def _kinds(handle: WorkflowHandle) -> list[int]:
    return [e.event_type for e in (await handle.fetch_history()).events]


async def _pauses_started(handle: WorkflowHandle) -> int:
    return pauses_before_continuing(await handle.fetch_history())


async def _status(handle: WorkflowHandle) -> str:
    return (await handle.describe()).status.name


@pytest.mark.spec("LD7")
@pytest.mark.parametrize("via", ["signal", "update"])
async def test_a_steady_trickle_of_cancels_does_not_keep_a_run_asked_to_continue_as_new_from_doing_so(tmp_path, via):
    """One valid cancel every 1.5 s (the same request sent again by a script until the export ends, or a new Update
    each time), each recorded in 1 s: the run is free half of the time. It pauses once, and continues as new at the
    next moment it is free; a run that paused at every chance never did, each pause ending with the next request
    in flight, until the server's cap on its history ended it."""
    world = _World(RECORD_TAKES)
    config = {"limit.historyCount.suggestContinueAsNew": SUGGEST_AFTER,
              "limit.historyCount.error": HISTORY_LIMIT, "limit.historyCount.warn": HISTORY_LIMIT // 2}
    async with own_server(tmp_path, config) as client, world.waiting_run(client) as first:
        latest = client.get_workflow_handle(first.id)
        request_id = uuid.uuid4()
        sent, start = 0, time.monotonic()
        try:
            while time.monotonic() - start < TRICKLE_FOR and await _status(first) == "RUNNING":
                with contextlib.suppress(RPCError, TimeoutError):
                    if via == "signal":  # the same request, sent again
                        await latest.signal("cancel", world.request(request_id))
                    else:  # a new request each time (one asked again would be answered from the run)
                        await asyncio.wait_for(latest.start_update(
                            "cancel", world.request(uuid.uuid4()), result_type=CancellationResult,
                            wait_for_stage=WorkflowUpdateStage.ACCEPTED), PERIOD)
                sent += 1
                await asyncio.sleep(max(0.0, start + sent * PERIOD - time.monotonic()))
            status = await _status(first)
            kinds = await _kinds(first)
            pauses = await _pauses_started(first)
        finally:
            with contextlib.suppress(RPCError):
                await latest.terminate("test over")
    assert sent >= 2, sent  # the trickle ran: requests came while the run was suggested to continue as new
    assert status == "CONTINUED_AS_NEW", (
        f"first run {status} after {time.monotonic() - start:.0f} s: {len(kinds)} events (suggested from "
        f"{SUGGEST_AFTER}), {sent} requests sent, {len(world.recorded)} recorded, {pauses} pauses before "
        f"continuing as new begun, none ending in it")
    assert pauses == 1, pauses


@pytest.mark.spec("LD7")
async def test_a_cancel_update_and_temporals_cancel_during_the_pause_are_recorded_before_the_run_continues_as_new(
        tmp_path):
    """Junk signals bring Temporal's suggestion; once the run has begun its pause, a cancel Update and Temporal's
    cancel reach it. Both are recorded before the run continues as new (the pause ends with them in flight, and the
    run waits what is left of its idle recheck), the Update is answered, the run pauses no second time, and its
    history replays."""
    world = _World(1.5)
    async with own_server(tmp_path, {"limit.historyCount.suggestContinueAsNew": SUGGEST_AFTER}) as client, \
            world.waiting_run(client) as first:
        try:
            for _ in range(30):
                await first.signal("cancel", {"junk": True})
            await eventually(lambda: _pauses_started(first), lambda n: n >= 1, timeout=30, interval=0.02,
                             what="the pause before continuing as new")
            update = await first.start_update("cancel", world.request(uuid.uuid4()),
                                              result_type=CancellationResult,
                                              wait_for_stage=WorkflowUpdateStage.ACCEPTED)
            await first.cancel()
            answer = await asyncio.wait_for(update.result(), 30)
            assert answer.outcome is CancellationOutcome.STOP_ALREADY_REQUESTED, answer
            await eventually(lambda: _status(first), lambda s: s != "RUNNING", timeout=30, interval=0.2,
                             what="the first run closed")
            status = await _status(first)
            history = await first.fetch_history()
            pauses = await _pauses_started(first)
        finally:
            with contextlib.suppress(RPCError):
                await client.get_workflow_handle(first.id).terminate("test over")
    assert sorted(world.recorded) == sorted(["ann@example.com", TEMPORAL_CANCEL_OPERATOR]), world.recorded
    assert status == "CONTINUED_AS_NEW", status
    assert pauses == 1, pauses
    # The pause ended with the requests in flight: the run waited again, which records the patch's marker.
    assert records_patch(history, patches.PAUSE_ONCE_BEFORE_CONTINUING_AS_NEW)
    replayer = Replayer(workflows=[ExportWorkflow], data_converter=pydantic_data_converter,
                        interceptors=workflow_interceptors())
    await replayer.replay_workflow(history)


@pytest.mark.spec("LD7")
async def test_a_trickle_of_cancels_whose_recording_fails_does_not_put_the_row_read_off(tmp_path):
    """The same trickle (one valid cancel every 0.6 s), each recording failing after 0.3 s, so that no answer wakes
    the run. A run that paused at every chance ended each pause with the next request in flight, neither woken nor
    due, waited again with a fresh idle recheck, and never read its row again (nor continued as new). The row is
    read at least every two idle rechecks."""
    recheck, period, takes, trickle_for = 3.0, 0.6, 0.3, 18.0
    world = _World(takes, idle_recheck=recheck, recording_fails=True)
    reads = world.reads
    async with own_server(tmp_path, {"limit.historyCount.suggestContinueAsNew": SUGGEST_AFTER}) as client, \
            world.waiting_run(client) as first:
        latest = client.get_workflow_handle(first.id)
        request = world.request(uuid.uuid4())
        sent, start = 0, time.monotonic()
        try:
            while time.monotonic() - start < trickle_for:
                with contextlib.suppress(RPCError):
                    await latest.signal("cancel", request)
                sent += 1
                await asyncio.sleep(max(0.0, start + sent * period - time.monotonic()))
            end = time.monotonic()
            runs = len([w async for w in client.list_workflows(f"WorkflowId = '{first.id}'")])
            events = len((await latest.fetch_history()).events)
        finally:
            with contextlib.suppress(RPCError):
                await latest.terminate("test over")
    gaps = [b - a for a, b in zip(reads, [*reads[1:], end], strict=True)]
    assert max(gaps) <= 2 * recheck, (
        f"row read at {[round(r - start, 1) for r in reads]} s (trickle 0-{end - start:.0f} s), longest gap "
        f"{max(gaps):.1f} s with an idle recheck of {recheck} s; {runs} run(s), the latest {events} events")
