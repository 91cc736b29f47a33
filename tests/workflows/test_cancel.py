"""Cancellation through the real worker, the Temporal dev server, PostgreSQL and an SFTP partner: the CLI's row
write plus signal, raw signals as the Temporal UI or CLI send them, the LISTEN/NOTIFY path alone, Temporal's own
cancel and terminate, and a correction of the original racing a replacement (TW6, TW7, CO1)."""

from __future__ import annotations

import asyncio
import json
import uuid
from contextlib import AsyncExitStack
from datetime import UTC, datetime
from pathlib import Path

import pytest
from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowExecutionStatus
from temporalio.worker import Worker

from activities.checkpoints import BUILD_CANCELLED, Checkpoints
from activities.contracts import (
    Admission,
    AdmitInput,
    AttemptInput,
    AuthorizeInput,
    AuthorizeOutput,
    BuildOutput,
    ClaimOutput,
    DeliverInput,
    DeliverOutput,
    Evaluation,
    ExportInput,
    ExportResult,
    Wake,
)
from activities.process.dispatcher import OutboxDispatcher
from starter.localstack.temporal import temporal_binary
from store.db import asyncpg_dsn, make_engine
from store.models import (
    AuthorizationResult,
    BuiltFile,
    CancellationOutcome,
    ClaimResult,
    FailureCode,
    JobRow,
    Status,
)
from store.outbox import Outbox
from store.reconciliation import Reconciliation
from tests.helpers.events import events, kinds, stop_latency
from tests.helpers.harness import Harness, building, open_harness, run_recovery
from tests.helpers.partner import assert_partner_holds, outbound_names, temp_names
from tests.helpers.standins import woken_while_recording_a_cancel
from tests.helpers.store_states import drive
from tests.helpers.support import eventually
from workflows import patches
from workflows.export import ExportWorkflow
from workflows.identity import admission_queue, export_workflow_id

STOP_BOUND_SECONDS = 1.0


# --- helpers -------------------------------------------------------------------------------------------------------

async def requests_for(db, job_id: uuid.UUID) -> list[dict]:
    rows = await db.admin.fetch(
        "SELECT id, requested_by, reason, outcome, found_status FROM cancellation_requests WHERE job_id = $1",
        job_id)
    return [dict(r) for r in rows]


def assert_nothing_at_partner(h: Harness) -> None:
    assert outbound_names(h.partner) == [] and temp_names(h.partner) == []


async def activity_names(h: Harness, job_id: uuid.UUID, run_id: str | None = None) -> list[str]:
    history = await h.client.get_workflow_handle(export_workflow_id(job_id), run_id=run_id).fetch_history()
    return [e.activity_task_scheduled_event_attributes.activity_type.name for e in history.events
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED]


def assert_stopped_clean(h: Harness, row) -> None:
    assert row.status is Status.STOPPED and row.delivery_authorized_at is None
    assert_nothing_at_partner(h)
    assert not list(Path(h.settings.work_dir).glob("*.csv*")), "the partial file was not removed"


@pytest.fixture
async def building_harness(db, store, client, tmp_path):
    """About 90 kB of contacts built at 60 kB/s: long enough to stop, short enough to finish quickly."""
    async with AsyncExitStack() as stack:
        yield await open_harness(stack, db, store, client, tmp_path, contacts=1000,
                                 build_throttle_bytes_per_second=60_000)


# --- TW6: the cancel signal, from the CLI or raw ---------------------------------------------------------------------

@pytest.mark.spec("TW6")
async def test_cancel__client_cancel_stops_a_building_export_within_one_second(slow_build_harness: Harness):
    h = slow_build_harness
    job_id = await h.create()
    await building(h, job_id)
    result = await h.exports.cancel(tenant_id=h.tenant_id, job_id=job_id, requested_by="ann@example.com",
                                    reason="wrong list")
    assert result.outcome is CancellationOutcome.STOP_REQUESTED
    row = await h.settled(job_id)
    assert_stopped_clean(h, row)
    assert row.stop_request_id == result.request_id
    latency = await stop_latency(h.db, job_id, result.request_id)
    print(f"\nTW6 client cancel: stop request committed -> Stopped in {latency * 1000:.0f} ms (DB clock)")
    assert latency < STOP_BOUND_SECONDS, latency
    assert kinds(await events(h.db, job_id)) == ["Claimed", "BuildStarted", "Stopped"]
    assert [(r["requested_by"], r["outcome"], r["found_status"]) for r in await requests_for(h.db, job_id)] == [
        ("ann@example.com", "StopRequested", "Running")]


class HoldUntilTemporalCancels(Checkpoints):
    """Holds a build that its stop watcher cancelled, lease still kept and heartbeating, until Temporal has also
    delivered the workflow's cancel of the activity: two cancels reaching one build before its stop is written."""

    def __init__(self) -> None:
        self.temporal_cancelled = False

    async def reached(self, name: str, job_id: uuid.UUID) -> None:
        if name != BUILD_CANCELLED:
            return
        assert not activity.is_cancelled(), "the stop watcher's cancel was to come first"
        try:
            async with asyncio.timeout(20):  # not wait_for: on 3.11 it can swallow the very cancel awaited here
                await activity.wait_for_cancelled()
                await asyncio.sleep(0.2)  # a step of the stop's cleanup, where the second cancel lands
        finally:
            self.temporal_cancelled = activity.is_cancelled()


@pytest.mark.spec("TW6")
async def test_cancel__second_cancel_during_the_stop_write_does_not_cut_it_off(slow_build_harness: Harness):
    h = slow_build_harness
    hold = HoldUntilTemporalCancels()
    h.activities.checkpoints = hold
    job_id = await h.create()
    await building(h, job_id)
    result = await h.exports.cancel(tenant_id=h.tenant_id, job_id=job_id, requested_by="ann@example.com",
                                    reason="twice heard")
    assert result.outcome is CancellationOutcome.STOP_REQUESTED
    row = await h.settled(job_id)
    assert hold.temporal_cancelled, "the workflow's cancel of the build never reached it"
    assert_stopped_clean(h, row)
    assert kinds(await events(h.db, job_id)) == ["Claimed", "BuildStarted", "Stopped"]
    # The build recorded its own stop: the workflow needed no stop_attempt of its own.
    assert "stop_attempt" not in await activity_names(h, job_id)


@pytest.mark.spec("TW6")
async def test_cancel__raw_signal_with_aliases_twice_then_client_records_one_request(slow_build_harness: Harness):
    h = slow_build_harness
    job_id = await h.create()
    await building(h, job_id)
    request_id = uuid.uuid4()
    # As the Temporal UI sends it: plain JSON, with the short field names.
    raw = {"request_id": str(request_id), "tenant": str(h.tenant_id), "operator": "ann@example.com",
           "reason": "wrong list"}
    handle = h.client.get_workflow_handle(export_workflow_id(job_id))
    await handle.signal("cancel", raw)
    await handle.signal("cancel", raw)
    row = await h.settled(job_id)
    assert_stopped_clean(h, row)
    assert row.stop_request_id == request_id
    latency = await stop_latency(h.db, job_id, request_id)
    print(f"\nTW6 raw signal: stop request committed -> Stopped in {latency * 1000:.0f} ms (DB clock)")
    assert latency < STOP_BOUND_SECONDS, latency
    # The same request once more through the client: the outcome already recorded, and no second record.
    again = await h.exports.cancel(tenant_id=h.tenant_id, job_id=job_id, requested_by="ann@example.com",
                                   reason="a different reason", request_id=request_id)
    assert again.outcome is CancellationOutcome.STOP_REQUESTED and again.request_id == request_id
    recorded = await requests_for(h.db, job_id)
    assert [(r["id"], r["requested_by"], r["reason"], r["outcome"]) for r in recorded] == [
        (request_id, "ann@example.com", "wrong list", "StopRequested")]
    assert await h.db.admin.fetchval("SELECT count(*) FROM cancellation_requests WHERE id = $1", request_id) == 1
    # Both raw signals were served by the workflow (each an activity), and both found the one record.
    assert (await activity_names(h, job_id)).count("record_cancellation") == 2
    assert kinds(await events(h.db, job_id)).count("Stopped") == 1


@pytest.mark.spec("TW6")
async def test_cancel__malformed_raw_signal_is_rejected_visibly_and_records_nothing(building_harness: Harness):
    h = building_harness
    job_id = await h.create()
    await building(h, job_id)
    handle = h.client.get_workflow_handle(export_workflow_id(job_id), result_type=ExportResult)
    await handle.signal("cancel", {"request_id": "not-a-uuid", "operator": "ann@example.com", "reason": "typo"})
    await handle.signal("cancel", "stop it please")
    rejected = await eventually(lambda: handle.query("rejected_signals"), lambda r: len(r) == 2,
                                what="both malformed signals listed")
    assert "request_id" in rejected[0] and "tenant_id" in rejected[0], rejected
    assert all(r.startswith("cancel rejected, nothing recorded") for r in rejected), rejected
    row = await h.settled(job_id)
    assert row.status is Status.COMPLETED and row.stop_request_id is None
    assert_partner_holds(h.partner, row)
    assert await h.db.admin.fetchval("SELECT count(*) FROM cancellation_requests") == 0
    assert "record_cancellation" not in await activity_names(h, job_id)
    assert len(await handle.query("rejected_signals")) == 2  # still listed after the run ended


@pytest.mark.spec("TW6")
async def test_cancel__row_write_alone_stops_the_build_through_the_notification(slow_build_harness: Harness):
    h = slow_build_harness
    job_id = await h.create()
    await building(h, job_id)
    request_id = uuid.uuid4()
    # The row write only: no signal reaches the workflow, so only the LISTEN/NOTIFY watcher can stop the build.
    result = await h.store.request_cancellation(tenant_id=h.tenant_id, job_id=job_id, request_id=request_id,
                                                requested_by="ann@example.com", reason="row only")
    assert result.outcome is CancellationOutcome.STOP_REQUESTED
    row = await h.settled(job_id)
    assert_stopped_clean(h, row)
    latency = await stop_latency(h.db, job_id, request_id)
    print(f"\nTW6 notification only: stop request committed -> Stopped in {latency * 1000:.0f} ms (DB clock)")
    assert latency < STOP_BOUND_SECONDS, latency
    history = await h.client.get_workflow_handle(export_workflow_id(job_id)).fetch_history()
    assert not [e for e in history.events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
                and e.workflow_execution_signaled_event_attributes.signal_name == "cancel"]
    assert "record_cancellation" not in await activity_names(h, job_id)
    assert kinds(await events(h.db, job_id)) == ["Claimed", "BuildStarted", "Stopped"]


@pytest.mark.spec("TW6")
async def test_cancel__raw_signal_from_the_temporal_cli_stops_the_build(slow_build_harness: Harness):
    h = slow_build_harness
    job_id = await h.create()
    await building(h, job_id)
    request_id = uuid.uuid4()
    payload = json.dumps({"request_id": str(request_id), "tenant": str(h.tenant_id), "operator": "cli-operator",
                          "reason": "sent with the temporal CLI"})
    process = await asyncio.create_subprocess_exec(
        temporal_binary(), "workflow", "signal", "--address", h.client.service_client.config.target_host,
        "--namespace", h.client.namespace, "--workflow-id", export_workflow_id(job_id), "--name", "cancel",
        "--input", payload, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.DEVNULL)
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout=20)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    assert process.returncode == 0, (out, err)
    row = await h.settled(job_id)
    assert_stopped_clean(h, row)
    assert row.stop_request_id == request_id
    assert [(r["id"], r["requested_by"], r["outcome"]) for r in await requests_for(h.db, job_id)] == [
        (request_id, "cli-operator", "StopRequested")]
    latency = await stop_latency(h.db, job_id, request_id)
    print(f"\nTW6 temporal CLI signal: stop request committed -> Stopped in {latency * 1000:.0f} ms (DB clock)")
    assert latency < STOP_BOUND_SECONDS, latency


# --- TW7: Temporal's own cancel, and terminate ---------------------------------------------------------------------

@pytest.mark.spec("TW7")
async def test_temporal_cancel__of_a_building_export_is_one_recorded_stop_request(slow_build_harness: Harness):
    h = slow_build_harness
    job_id = await h.create()
    await building(h, job_id)
    handle = h.client.get_workflow_handle(export_workflow_id(job_id), result_type=ExportResult)
    await handle.cancel()
    await handle.cancel()  # repeated: still the same request
    row = await h.settled(job_id)
    assert_stopped_clean(h, row)
    result = await handle.result()
    assert result.status is Status.STOPPED and result.job_id == job_id
    recorded = await requests_for(h.db, job_id)
    assert [(r["outcome"], r["found_status"]) for r in recorded] == [("StopRequested", "Running")]
    # The operator is the identity Temporal recorded for the cancel: here, the test's own client.
    assert recorded[0]["requested_by"] == f"temporal-cancel: {h.client.identity}"
    assert row.stop_request_id == recorded[0]["id"]
    latency = await stop_latency(h.db, job_id, recorded[0]["id"])
    print(f"\nTW7 Temporal cancel: stop request committed -> Stopped in {latency * 1000:.0f} ms (DB clock)")
    assert latency < STOP_BOUND_SECONDS, latency
    assert kinds(await events(h.db, job_id)) == ["Claimed", "BuildStarted", "Stopped"]
    assert (await handle.describe()).status is WorkflowExecutionStatus.COMPLETED


@pytest.mark.spec("TW7")
async def test_temporal_cancel__during_upload_is_too_late_and_delivery_completes(slow_upload_harness: Harness):
    h = slow_upload_harness
    job_id = await h.create()
    await eventually(lambda: h.store.read_job(job_id), lambda r: r.status is Status.DELIVERING, what="Delivering")
    handle = h.client.get_workflow_handle(export_workflow_id(job_id), result_type=ExportResult)
    await handle.cancel()
    recorded = await eventually(lambda: requests_for(h.db, job_id), lambda r: len(r) == 1,
                                what="the Temporal cancel recorded")
    assert (await h.store.read_job(job_id)).status is Status.DELIVERING, "recorded after the upload; slow it down"
    assert [(r["outcome"], r["found_status"]) for r in recorded] == [("TooLate", "Delivering")]
    assert recorded[0]["requested_by"] == f"temporal-cancel: {h.client.identity}"
    row = await h.settled(job_id)
    assert row.status is Status.COMPLETED and row.stop_request_id is None
    assert_partner_holds(h.partner, row)
    assert (await handle.result()).status is Status.COMPLETED
    assert "Stopped" not in kinds(await events(h.db, job_id))
    assert (await activity_names(h, job_id)).count("deliver") == 1


@pytest.fixture
async def terminate_harness(db, store, client, tmp_path):
    """Short leases, so a terminated attempt's lease expires in seconds; a build slow enough to interrupt."""
    async with AsyncExitStack() as stack:
        yield await open_harness(stack, db, store, client, tmp_path, contacts=1000,
                                 build_throttle_bytes_per_second=40_000, lease_seconds=2.0,
                                 renew_every_seconds=0.5)


@pytest.mark.spec("TW7")
async def test_temporal_terminate__mid_build_is_a_crash_that_recovery_resolves(terminate_harness: Harness):
    h = terminate_harness
    job_id = await h.create()
    first_attempt = await building(h, job_id)
    handle = h.client.get_workflow_handle(export_workflow_id(job_id))
    first_run = (await handle.describe()).run_id
    await handle.terminate(reason="test: like a crash")
    assert (await h.client.get_workflow_handle(export_workflow_id(job_id), run_id=first_run).describe()).status \
        is WorkflowExecutionStatus.TERMINATED
    # No stop was requested: nothing writes Stopped, and the row stays Running until its lease expires.
    expired = await eventually(
        lambda: h.db.admin.fetchrow(
            "SELECT status, attempt_id, lease_expires_at < clock_timestamp() AS expired FROM export_jobs "
            "WHERE id = $1", job_id),
        lambda r: r["expired"] or r["status"] != "Running", timeout=10, interval=0.1,
        what="the terminated attempt's lease expired")
    assert (expired["status"], expired["attempt_id"]) == ("Running", first_attempt)
    assert kinds(await events(h.db, job_id)) == ["Claimed", "BuildStarted"]
    assert await h.db.admin.fetchval("SELECT count(*) FROM cancellation_requests") == 0

    report = await run_recovery(h.client, h.settings)
    assert [t.recorded for t in report.taken_over if t.job_id == job_id] == ["RequeuedByRecovery"]
    # The dispatcher publishes recovery's new outbox row: a new run of the same workflow ID.
    row = await h.settled(job_id)
    assert row.status is Status.COMPLETED and row.attempt_count == 2 and row.attempt_id != first_attempt
    assert_partner_holds(h.partner, row)
    found = kinds(await events(h.db, job_id))
    assert found[:5] == ["Claimed", "BuildStarted", "RequeuedByRecovery", "Claimed", "BuildStarted"]
    assert found[-1] == "Finished"
    assert "Stopped" not in found
    assert (await handle.describe()).run_id != first_run
    assert not list(Path(h.settings.work_dir).glob("*.csv*"))


# --- CO1: a correction of the original before the replacement's cutoff 2 ---------------------------------------

async def failed_original_with_replacement(h: Harness) -> tuple[uuid.UUID, uuid.UUID, uuid.UUID]:
    """An original that really ran an attempt and Failed with NotDelivered, and its queued replacement."""
    original = await h.store_create()
    attempt_id = await drive(h.store, original, Status.FAILED, FailureCode.NOT_DELIVERED)
    row = await h.store.read_job(original)
    assert (row.status, row.failure_reason, row.attempt_id) == (Status.FAILED, FailureCode.NOT_DELIVERED, attempt_id)
    replacement = await h.exports.replace(tenant_id=h.tenant_id, original_job_id=original, created_by="tests",
                                          reason="the original never arrived")
    return original, attempt_id, replacement


async def correct_to_completed(h: Harness, original: uuid.UUID, attempt_id: uuid.UUID) -> None:
    engine = make_engine(h.db.url("reconciler"))
    try:
        assert await Reconciliation(engine).correct(tenant_id=h.tenant_id, job_id=original, attempt_id=attempt_id,
                             recorded_status=Status.FAILED, corrected_status=Status.COMPLETED, failure_reason=None,
                             corrected_by="reconciler@example.com", evidence_ref="partner ack 42",
                             why="the partner confirmed receipt")
    finally:
        await engine.dispose()


async def assert_original_delivered(h: Harness, original: uuid.UUID, replacement: uuid.UUID) -> None:
    row = await h.settled(replacement)
    assert (row.status, row.failure_reason) == (Status.FAILED, FailureCode.ORIGINAL_DELIVERED)
    assert row.attempt_count == 1 and row.delivery_authorized_at is None and row.replaces_job_id == original
    found = kinds(await events(h.db, replacement))
    assert found[0] == "Claimed" and "DeliveryAuthorized" not in found and "DeliveryEvidence" not in found
    assert (await h.store.read_job(original)).status is Status.COMPLETED
    assert "Corrected" in kinds(await events(h.db, original))
    assert_nothing_at_partner(h)
    assert not list(Path(h.settings.work_dir).glob("*.csv*")), "the unauthorized file was not removed"


async def publish_once(h: Harness, db) -> int:
    """One pass of an outbox dispatcher under the dispatcher role, as a worker runs it; how many rows it published."""
    engine = make_engine(db.url("dispatcher"))
    try:
        dispatcher = OutboxDispatcher(h.client, Outbox(engine), asyncpg_dsn(db.url("dispatcher")),
                                      task_queue=h.settings.task_queue, poll_seconds=0.2)
        return await dispatcher.dispatch_once()
    finally:
        await engine.dispose()


@pytest.mark.spec("CO1")
async def test_correction__before_a_queued_replacement_runs_ends_it_original_delivered(quiet_harness: Harness, db):
    h = quiet_harness  # no dispatcher: the replacement stays queued until this test publishes it
    original, attempt_id, replacement = await failed_original_with_replacement(h)
    assert (await h.store.read_job(replacement)).status is Status.QUEUED
    await correct_to_completed(h, original, attempt_id)
    # The original's creation row, the correction's wake-up of the original, and the replacement's.
    assert await publish_once(h, db) == 3
    await assert_original_delivered(h, original, replacement)


@pytest.fixture
async def quiet_slow_build_harness(db, store, client, tmp_path):
    """No dispatcher (the original must not run before it is driven), and a build slow enough to correct
    the original during it."""
    async with AsyncExitStack() as stack:
        yield await open_harness(stack, db, store, client, tmp_path, dispatcher=False, contacts=2000,
                                 build_throttle_bytes_per_second=60_000)


@pytest.mark.spec("CO1")
async def test_correction__during_the_replacements_build_ends_it_original_delivered(
        quiet_slow_build_harness: Harness, db):
    h = quiet_slow_build_harness
    original, attempt_id, replacement = await failed_original_with_replacement(h)
    assert await publish_once(h, db) == 2
    await building(h, replacement)
    await correct_to_completed(h, original, attempt_id)
    assert (await h.store.read_job(replacement)).status is Status.RUNNING, "the correction came after the build"
    await assert_original_delivered(h, original, replacement)
    corrected_at = await db.admin.fetchval(
        "SELECT recorded_at FROM export_attempt_events WHERE job_id = $1 AND kind = 'Corrected'", original)
    failed_at = await db.admin.fetchval(
        "SELECT max(recorded_at) FROM export_attempt_events WHERE job_id = $1", replacement)
    assert corrected_at < failed_at


async def test_a_wake_up_while_the_last_cancellation_is_recorded_is_read_before_the_run_returns(client):
    """Seen in the chaos run: an OutcomeUnknown export was reconciled and corrected while its run, the row already
    settled, was still recording a cancellation. Both outbox wake-ups reached that run, which returned the old
    state, so the latest run and its ExportStatus disagreed with the row for good. Here with the workflow's own
    steps replaced by stand-ins the test controls: the run must read the row again before it returns."""
    _, result, reads = await woken_while_recording_a_cancel(client)
    assert result.status is Status.COMPLETED, (result, reads)


async def test_a_wake_up_during_the_delivery_is_read_before_the_run_ends_with_the_row_it_returned(client):
    """Seen in the chaos run: an export ended OutcomeUnknown and was reconciled at once, while its run was still
    taking in the delivery's answer. The run ended with the row the delivery returned and dropped the wake-up, so
    its result and ExportStatus stayed OutcomeUnknown. With stand-ins for the attempt's steps: a wake-up that
    comes while the delivery runs makes the run read the row again."""
    job_id, tenant_id = uuid.uuid4(), uuid.uuid4()
    queue = f"wake-in-delivery-{uuid.uuid4().hex[:8]}"
    states = {"status": Status.QUEUED}
    delivering, answer = asyncio.Event(), asyncio.Event()

    def row() -> JobRow:
        return JobRow(id=job_id, tenant_id=tenant_id, status=states["status"], version=1,
                      destination_id=uuid.uuid4(), woken_at=datetime.now(UTC), delivery_key="k",
                      created_by="tests", final_name=f"contacts-{tenant_id}-k.csv",
                      confirmed_by="reconciliation" if states["status"] is Status.COMPLETED else None)

    @activity.defn(name="claim_if_allowed")
    async def claim_if_allowed(_: AdmitInput) -> Admission:
        evaluation = Evaluation(row=row(), allowed=states["status"] is Status.QUEUED)
        if not evaluation.allowed:
            return Admission(evaluation=evaluation)
        states["status"] = Status.RUNNING
        return Admission(evaluation=evaluation, attempt=1, claim=ClaimOutput(
            result=ClaimResult.CLAIMED, worker_task_queue=queue, lease_seconds=30))

    @activity.defn(name="build")
    async def build(_: AttemptInput) -> BuildOutput:
        return BuildOutput(file=BuiltFile(path="/nowhere", final_name=row().final_name, size=1, sha256_hex="00"),
                           worker_task_queue=queue)

    @activity.defn(name="authorize_delivery")
    async def authorize_delivery(_: AuthorizeInput) -> AuthorizeOutput:
        states["status"] = Status.DELIVERING
        return AuthorizeOutput(result=AuthorizationResult.AUTHORIZED)

    @activity.defn(name="deliver")
    async def deliver(_: DeliverInput) -> DeliverOutput:
        states["status"] = Status.OUTCOME_UNKNOWN
        returned = row()  # the row as the terminal write left it
        delivering.set()
        await asyncio.wait_for(answer.wait(), 30)  # meanwhile: reconciled, and the run woken
        return DeliverOutput(outcome=Status.OUTCOME_UNKNOWN, summary="unknown", written=True, row=returned)

    async with Worker(client, task_queue=queue, workflows=[ExportWorkflow],
                      activities=[build, authorize_delivery, deliver], patch_activation_callback=patches.activates), \
            Worker(client, task_queue=admission_queue(queue), activities=[claim_if_allowed]):
        handle = await client.start_workflow(ExportWorkflow.run, ExportInput(job_id=job_id),
                                             id=export_workflow_id(job_id),
                                             task_queue=queue)
        await asyncio.wait_for(delivering.wait(), 30)
        states["status"] = Status.COMPLETED  # reconciled; its outbox row wakes the run
        await handle.signal("wake", Wake(message_id=uuid.uuid4()))
        answer.set()
        result = await asyncio.wait_for(handle.result(), 30)
    assert result.status is Status.COMPLETED, result
