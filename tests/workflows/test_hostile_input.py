"""Hostile input never hangs or poisons an export (matrix HI1 to HI4), through the real worker, the Temporal dev
server, PostgreSQL and the SFTP partner: signals and starts as the Temporal UI or CLI send them, a step that the
store refuses for good, and the search attributes an operator filters on."""

from __future__ import annotations

import asyncio
import re
import uuid

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.api.sdk.v1 import WorkflowMetadata
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError

from activities.contracts import ExportInput, ExportResult
from starter.client import ExportsClient
from store.db import asyncpg_dsn
from store.models import Status
from tests.helpers.events import stop_latency
from tests.helpers.harness import Harness, building
from tests.helpers.releases import ROOT
from tests.helpers.support import eventually, exports_command, lock_row, unlock_row
from workflows.identity import EXPORT_STATUS, export_workflow_id

BOUND = 30.0


# --- HI1: a cancel that validates but cannot be stored blocks nothing ----------------------------------------------


@pytest.mark.spec("HI1")
@pytest.mark.parametrize("operator", ["ann\x00@example.com", "   ", "x" * 201])
async def test_a_cancel_that_cannot_be_stored_is_rejected_and_the_next_one_stops_the_build(
        slow_build_harness: Harness, operator: str):
    h = slow_build_harness
    job_id = await h.create()
    await building(h, job_id)
    handle = h.client.get_workflow_handle(export_workflow_id(job_id), result_type=ExportResult)
    await handle.signal("cancel", {"request_id": str(uuid.uuid4()), "tenant": str(h.tenant_id),
                                   "operator": operator, "reason": "bad"})
    valid = uuid.uuid4()
    await handle.signal("cancel", {"request_id": str(valid), "tenant": str(h.tenant_id),
                                   "operator": "ann@example.com", "reason": "wrong list"})
    row = await eventually(lambda: h.store.read_job(job_id), lambda r: r.status.is_settled, timeout=BOUND,
                           interval=0.1, what="the export settled")
    assert row.status is Status.STOPPED and row.stop_request_id == valid
    assert await stop_latency(h.db, job_id, valid) < 1.0
    recorded = await h.db.admin.fetch("SELECT id, requested_by FROM cancellation_requests WHERE job_id = $1", job_id)
    assert [(r["id"], r["requested_by"]) for r in recorded] == [(valid, "ann@example.com")]
    rejected = await handle.query("rejected_signals")
    assert len(rejected) == 1 and "operator" in rejected[0] and "nothing recorded" in rejected[0], rejected
    assert list((h.partner.root / "outbound").iterdir()) == []
    assert (await h.settled(job_id)).status is Status.STOPPED


@pytest.mark.spec("HI1")
async def test_a_cancel_that_validates_but_the_database_refuses_blocks_nothing(slow_build_harness: Harness):
    """Every payload the validators pass is meant to be storable; where the database refuses one all the same (here
    a constraint the validators do not know), the request is reported, recorded nowhere, asked once, and the next
    request still stops the build."""
    h = slow_build_harness
    await h.db.admin.execute("ALTER TABLE cancellation_requests ADD CONSTRAINT test_refused_reason "
                             "CHECK (reason IS DISTINCT FROM 'refused by the database')")
    job_id = await h.create()
    await building(h, job_id)
    handle = h.client.get_workflow_handle(export_workflow_id(job_id), result_type=ExportResult)
    refused = uuid.uuid4()
    await handle.signal("cancel", {"request_id": str(refused), "tenant": str(h.tenant_id),
                                   "operator": "ann@example.com", "reason": "refused by the database"})
    rejected = await eventually(lambda: handle.query("rejected_signals"), bool, timeout=BOUND, interval=0.1,
                                what="the refused request reported")
    assert len(rejected) == 1 and str(refused) in rejected[0] and "not recorded" in rejected[0], rejected
    assert "test_refused_reason" in rejected[0], rejected
    assert (await h.store.read_job(job_id)).status is Status.RUNNING  # the refused request stopped nothing
    valid = uuid.uuid4()
    await handle.signal("cancel", {"request_id": str(valid), "tenant": str(h.tenant_id),
                                   "operator": "ann@example.com", "reason": "wrong list"})
    row = await h.settled(job_id)
    assert row.status is Status.STOPPED and row.stop_request_id == valid
    recorded = await h.db.admin.fetch("SELECT id FROM cancellation_requests WHERE job_id = $1", job_id)
    assert [r["id"] for r in recorded] == [valid]
    # Asked once: a refusal for good is not retried.
    assert [a for a, _, _ in failed_attempts(await handle.fetch_history(), "record_cancellation")] == [1]


# --- HI2: no step retries without bound on a deterministic error ---------------------------------------------------


def failed_attempts(history, activity_type: str) -> list[tuple[int, str, bool]]:
    """(attempt, message, non_retryable) of each failed run of one activity type, from the workflow's history."""
    scheduled = {e.event_id: e.activity_task_scheduled_event_attributes.activity_type.name for e in history.events
                 if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED}
    started = {e.event_id: e.activity_task_started_event_attributes.attempt for e in history.events
               if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED}
    out = []
    for e in history.events:
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED:
            attrs = e.activity_task_failed_event_attributes
            if scheduled[attrs.scheduled_event_id] == activity_type:
                failure = attrs.failure
                out.append((started[attrs.started_event_id], failure.message,
                            failure.application_failure_info.non_retryable))
    return out


@pytest.mark.spec("HI2")
async def test_a_step_the_store_refuses_for_good_ends_at_once_and_the_workflow_waits_on_the_row(harness: Harness):
    """The application role loses its read of destinations (a deterministic privilege error): the policy step
    fails once, visibly, with one line, and is not retried; the workflow waits on the row, and delivers once the
    grant is back and the job is woken."""
    h = harness
    await h.db.admin.execute("REVOKE SELECT ON destinations FROM exports_app")
    job_id = await h.create()
    handle = h.client.get_workflow_handle(export_workflow_id(job_id), result_type=ExportResult)

    async def failures():
        try:
            return failed_attempts(await handle.fetch_history(), "claim_if_allowed")
        except RPCError:
            return []  # the dispatcher has not started the workflow yet

    failed = await eventually(failures, bool, timeout=BOUND, interval=0.2, what="the policy step failed")
    await asyncio.sleep(3)  # the retry policy's first intervals: a retried step would fail again meanwhile
    failed = await failures()
    assert len(failed) == 1, failed
    attempt, message, non_retryable = failed[0]
    assert attempt == 1 and non_retryable and "\n" not in message and "permission denied" in message, failed[0]
    assert (await handle.describe()).status is WorkflowExecutionStatus.RUNNING
    assert (await h.store.read_job(job_id)).status is Status.QUEUED

    await h.db.admin.execute("GRANT SELECT ON destinations TO exports_app")
    from activities.contracts import Wake
    await handle.signal("wake", Wake(message_id=uuid.uuid4()))
    row = await h.settled(job_id)
    assert row.status is Status.COMPLETED and row.attempt_count == 1


# --- HI3: a malformed start fails at once and writes nothing --------------------------------------------------------


def _create(job_id: uuid.UUID, h: Harness, **overrides) -> dict:
    return {"job_id": str(job_id), "tenant_id": str(h.tenant_id), "destination_id": str(h.destination_id),
            "created_by": "platform-team", "delivery_key": f"k{uuid.uuid4().hex[:10]}", **overrides}


@pytest.mark.spec("HI3")
@pytest.mark.parametrize("case", ["missing tenant", "not a uuid", "ids disagree", "wrong workflow id", "no input"])
async def test_a_malformed_raw_start_fails_at_once_with_one_clear_error_and_writes_nothing(quiet_harness: Harness,
                                                                                         case: str):
    h = quiet_harness
    job_id = uuid.uuid4()
    workflow_id = export_workflow_id(job_id)
    args: list = []
    if case == "missing tenant":
        create = _create(job_id, h)
        del create["tenant_id"]
        args = [{"job_id": str(job_id), "create": create}]
    elif case == "not a uuid":
        workflow_id = "export-nope"
        args = [{"job_id": "nope"}]
    elif case == "ids disagree":
        args = [{"job_id": str(job_id), "create": _create(uuid.uuid4(), h)}]
    elif case == "wrong workflow id":
        workflow_id = f"my-export-{job_id}"
        args = [{"job_id": str(job_id), "create": _create(job_id, h)}]
    handle = await h.client.start_workflow("ExportWorkflow", args=args, id=workflow_id,
                                           task_queue=h.settings.task_queue)
    with pytest.raises(WorkflowFailureError) as failed:
        await asyncio.wait_for(handle.result(), BOUND)
    cause = failed.value.cause
    assert isinstance(cause, ApplicationError) and cause.non_retryable and cause.type == "InvalidExportInput"
    assert "nothing written" in cause.message and "\n" not in cause.message, cause.message
    assert (await handle.describe()).status is WorkflowExecutionStatus.FAILED
    for table in ("export_jobs", "deliveries", "outbox", "export_attempt_events"):
        assert await h.db.admin.fetchval(f"SELECT count(*) FROM {table}") == 0, table


# --- HI4: search attributes follow the row in every state -----------------------------------------------------------


async def listed(h: Harness, job_id: uuid.UUID, status: str) -> bool:
    query = f"WorkflowId = 'export-{job_id}' AND ExportStatus = '{status}'"
    return bool([w async for w in h.client.list_workflows(query)])


async def shows_while_it_lasts(h: Harness, state: str) -> None:
    job_id = await h.create()
    await eventually(lambda: h.store.read_job(job_id), lambda r: r.status.value == state, timeout=BOUND,
                     interval=0.05, what=f"the row {state}")
    found = await eventually(lambda: listed(h, job_id, state), bool, timeout=10, interval=0.2,
                             what=f"ExportStatus = '{state}' finds the export")
    assert found and (await h.store.read_job(job_id)).status.value == state  # and the row still says so
    assert (await h.settled(job_id)).status is Status.COMPLETED
    assert await eventually(lambda: listed(h, job_id, "Completed"), bool, timeout=10, interval=0.2,
                            what="ExportStatus = 'Completed'")


@pytest.mark.spec("HI4")
async def test_export_status_is_running_while_it_builds(slow_build_harness: Harness):
    await shows_while_it_lasts(slow_build_harness, "Running")


@pytest.mark.spec("HI4")
async def test_export_status_is_delivering_while_it_uploads(slow_upload_harness: Harness):
    await shows_while_it_lasts(slow_upload_harness, "Delivering")


async def latest_status(h: Harness, job_id: uuid.UUID) -> str | None:
    described = await h.client.get_workflow_handle(export_workflow_id(job_id)).describe()
    return described.typed_search_attributes.get(EXPORT_STATUS)


@pytest.mark.spec("HI4")
async def test_a_correction_after_the_workflow_closed_moves_its_export_status(harness: Harness):
    h = harness
    job_id = await h.create()
    row = await h.settled(job_id)
    assert await eventually(lambda: listed(h, job_id, "Completed"), bool, timeout=10, interval=0.2,
                            what="ExportStatus = 'Completed'")
    exports = ExportsClient(h.store, h.client, task_queue=h.settings.task_queue,
                            reconciliation_url=h.settings.reconciliation_database_url)
    assert await exports.correct(tenant_id=h.tenant_id, job_id=job_id, attempt_id=row.attempt_id,
                                 recorded="Completed", corrected="Failed", failure_reason="NotDelivered",
                                 corrected_by="ops@example.com", evidence_ref="partner ticket 9",
                                 why="the partner never received it")
    # The export's latest run (a new one: the workflow had closed) reads the corrected row.
    assert await eventually(lambda: latest_status(h, job_id), lambda s: s == "Failed", timeout=BOUND,
                            interval=0.2, what="ExportStatus 'Failed' after the correction")
    assert await eventually(lambda: listed(h, job_id, "Failed"), bool, timeout=10, interval=0.2,
                            what="ExportStatus = 'Failed' finds it")
    result = await h.client.get_workflow_handle(export_workflow_id(job_id), result_type=ExportResult).result()
    assert result.status is Status.FAILED  # the latest run read the corrected row


# --- HI5: who, why, what, without opening JSON ----------------------------------------------------------------------


async def current_details(h: Harness, job_id: uuid.UUID) -> str:
    handle = h.client.get_workflow_handle(export_workflow_id(job_id))
    metadata = await handle.query("__temporal_workflow_metadata", result_type=WorkflowMetadata)
    return metadata.current_details


async def shown_by_cli(h: Harness, job_id: uuid.UUID) -> str:
    ran = await exports_command(h.settings, "show", str(job_id), "--tenant", str(h.tenant_id), cwd=ROOT, bound=BOUND)
    assert ran.code == 0, ran
    return ran.stdout


@pytest.mark.spec("HI5")
async def test_the_ui_details_say_who_stopped_an_export_and_why(slow_build_harness: Harness):
    h = slow_build_harness
    job_id = await h.create()
    await building(h, job_id)
    stop = await h.exports.cancel(tenant_id=h.tenant_id, job_id=job_id, requested_by="ann@example.com",
                                  reason="wrong list")
    assert (await h.settled(job_id)).status is Status.STOPPED
    details = await eventually(lambda: current_details(h, job_id), lambda d: "cancel by" in d, timeout=10,
                               what="the details name the cancel")
    assert details.startswith("**Stopped**")
    assert f'cancel by ann@example.com: "wrong list" → {stop.outcome.value}' in details, details
    assert await h.client.get_workflow_handle(export_workflow_id(job_id)).query("rejected_signals") == []
    # `exports show` says it too, from the row: who asked, why, what it found and what it recorded.
    shown = await shown_by_cli(h, job_id)
    request = next(line for line in shown.splitlines() if str(stop.request_id) in line and "│" in line)
    for said in ("ann@example.com", "wrong list", stop.outcome.value, "Running"):
        assert said in request, shown
    assert re.search(r"^\s*status\s+Stopped\s*$", shown, re.M), shown


@pytest.mark.spec("HI5")
async def test_the_ui_details_say_which_file_went_out_and_a_late_cancel_was_too_late(slow_upload_harness: Harness):
    h = slow_upload_harness
    job_id = await h.create()
    await eventually(lambda: h.store.read_job(job_id), lambda r: r.status is Status.DELIVERING, timeout=BOUND,
                     what="Delivering")
    await h.exports.cancel(tenant_id=h.tenant_id, job_id=job_id, requested_by="bob@example.com", reason="late")
    row = await h.settled(job_id)
    assert row.status is Status.COMPLETED
    details = await eventually(lambda: current_details(h, job_id), lambda d: "TooLate" in d, timeout=10,
                               what="the details name the late cancel")
    assert details.startswith("**Completed**")
    assert (f"file {row.expected_file_name}, {row.expected_file_bytes} bytes, "
            f"sha256 {row.expected_file_sha256.hex()}") in details, details
    assert "confirmed by" in details  # how the delivery was confirmed
    assert 'cancel by bob@example.com: "late" → TooLate' in details
    # `exports show` names the file that went out, how it was confirmed, and the late request.
    shown = await shown_by_cli(h, job_id)
    for name, value in (("status", "Completed"), ("final_name", row.final_name),
                        ("expected_file_bytes", str(row.expected_file_bytes)),
                        ("expected_file_sha256", row.expected_file_sha256.hex()), ("confirmed_by", row.confirmed_by)):
        assert re.search(rf"^\s*{name}\s+{re.escape(value)}\s*$", shown, re.M), (name, shown)
    late = next(line for line in shown.splitlines() if "bob@example.com" in line)
    assert "late" in late and "TooLate" in late and "Delivering" in late, shown


@pytest.mark.spec("HI5")
async def test_the_ui_details_say_why_an_export_was_rejected(harness: Harness):
    h = harness
    await h.db.admin.execute("UPDATE destinations SET enabled = false WHERE id = $1", h.destination_id)
    job_id = await h.create()
    assert (await h.settled(job_id)).status is Status.REJECTED
    details = await current_details(h, job_id)
    assert details.startswith("**Rejected**") and "rejected: destination 'partner' is disabled" in details, details
    # The row keeps the reason, so `exports show` says it too, whichever run an operator looks at.
    assert (await h.exports.show(job_id)).row.rejection_reason == "destination 'partner' is disabled"


# --- a cancel signal that found the row busy is asked again ---------------------------------------------------------


@pytest.mark.spec("RQ4", "TW6")
async def test_a_cancel_signal_that_finds_the_row_busy_is_asked_again_and_then_stops_the_build(
        slow_build_harness: Harness):
    h = slow_build_harness
    job_id = await h.create()
    await building(h, job_id)
    locker = await lock_row(asyncpg_dsn(h.db.url("owner")), job_id)
    try:
        handle = h.client.get_workflow_handle(export_workflow_id(job_id), result_type=ExportResult)
        request_id = uuid.uuid4()
        await handle.signal("cancel", {"request_id": str(request_id), "tenant": str(h.tenant_id),
                                       "operator": "ann@example.com", "reason": "busy row"})
        busy = await eventually(lambda: current_details(h, job_id), lambda d: "Busy" in d or "busy" in d,
                                timeout=10, interval=0.1, what="the first answer was Busy")
        assert busy  # the lock outlasted lock_timeout: nothing recorded yet
        assert await h.db.admin.fetchval("SELECT count(*) FROM cancellation_requests") == 0
    finally:
        await unlock_row(locker)
    row = await h.settled(job_id)
    assert row.status is Status.STOPPED and row.stop_request_id == request_id
    assert await h.db.admin.fetchval("SELECT count(*) FROM cancellation_requests") == 1


# --- an operator's ID prefix ----------------------------------------------------------------------------------------


@pytest.mark.spec("HI6")
async def test_show_accepts_a_unique_id_prefix_and_refuses_an_ambiguous_or_unknown_one(db, store):
    from starter.client import InputError
    from tests.helpers.support import create_job, seed_tenant

    tenant_id, destination_id = await seed_tenant(db.admin)
    first = await create_job(store, tenant_id, destination_id)
    exports = ExportsClient(store, None)
    assert (await exports.show(str(first)[:8])).row.id == first
    assert (await exports.show(str(first)[:13])).row.id == first  # with its dash
    twin = uuid.UUID(str(first)[:8] + "0" * 4 + str(uuid.uuid4())[13:].replace("-", "")[:20])
    await store.create_job(job_id=twin, tenant_id=tenant_id, destination_id=destination_id,
                           delivery_key=f"k{twin.hex[:12]}", created_by="tests")
    with pytest.raises(InputError, match="more than one"):
        await exports.show(str(first)[:8])
    with pytest.raises(InputError, match="no export ID starts with"):
        await exports.show("ffff0000")
    with pytest.raises(InputError, match="not a UUID"):
        await exports.show("xyz")


# --- arbitrary JSON as a cancel signal (property-based) -------------------------------------------------------------


def _hostile_cancel_payloads(tenant_id: uuid.UUID) -> list:
    """Payloads drawn by hypothesis: arbitrary JSON, and cancels that look right but name another tenant or carry
    text no column should store. None names the export's own tenant, so none may record anything."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                    max_size=4), max_leaves=8)
    other_tenant = st.uuids().filter(lambda u: u != tenant_id).map(str)
    lookalike = st.fixed_dictionaries({
        "request_id": st.uuids().map(str) | st.text(max_size=40),
        "tenant": other_tenant | st.text(max_size=40),
        "operator": st.text(max_size=250),
        "reason": st.none() | st.text(max_size=60),
    })
    drawn: list = []

    @settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.one_of(json, lookalike))
    def draw(payload) -> None:
        drawn.append(payload)

    draw()
    return drawn


@pytest.mark.spec("HI1")
async def test_arbitrary_json_sent_as_cancel_records_nothing_and_a_valid_cancel_is_still_recorded(
        quiet_harness: Harness):
    from pydantic import ValidationError

    from activities.contracts import CancelRequest
    from tests.helpers.store_states import drive

    h = quiet_harness
    job_id = uuid.uuid4()
    await h.store.create_job(job_id=job_id, tenant_id=h.tenant_id, destination_id=h.destination_id,
                             delivery_key=f"k{job_id.hex[:12]}", created_by="tests")
    await drive(h.store, job_id, Status.RUNNING)  # held by an attempt of the test's: the workflow only waits
    handle = await h.client.start_workflow("ExportWorkflow", ExportInput(job_id=job_id),
                                           id=export_workflow_id(job_id),
                                           task_queue=h.settings.task_queue, result_type=ExportResult)
    try:
        payloads = _hostile_cancel_payloads(h.tenant_id)
        invalid = 0
        for payload in payloads:
            try:
                CancelRequest.model_validate(payload)
            except ValidationError:
                invalid += 1
            await handle.signal("cancel", payload)
        valid = uuid.uuid4()
        await handle.signal("cancel", {"request_id": str(valid), "tenant": str(h.tenant_id),
                                       "operator": "ann@example.com", "reason": "after the noise"})
        await eventually(lambda: h.db.admin.fetchval("SELECT count(*) FROM cancellation_requests"),
                         lambda n: n >= 1, timeout=BOUND, interval=0.2, what="the valid cancel recorded")
        recorded = await h.db.admin.fetch("SELECT id, outcome FROM cancellation_requests")
        assert [(r["id"], r["outcome"]) for r in recorded] == [(valid, "StopRequested")]
        assert len(await handle.query("rejected_signals")) == invalid
        assert (await handle.describe()).status is WorkflowExecutionStatus.RUNNING
    finally:
        await handle.terminate("test over")


@pytest.mark.spec("LD7")
async def test_a_flood_of_malformed_cancels_keeps_the_runs_memory_bounded_and_the_next_valid_cancel_records(
        quiet_harness: Harness):
    """Many malformed cancel signals: the run keeps the last hundred for the query and counts the rest in its
    details (its memory no longer grows with every one), and a valid cancel after them is still recorded."""
    from tests.helpers.store_states import drive

    h = quiet_harness
    job_id = uuid.uuid4()
    await h.store.create_job(job_id=job_id, tenant_id=h.tenant_id, destination_id=h.destination_id,
                             delivery_key=f"k{job_id.hex[:12]}", created_by="tests")
    await drive(h.store, job_id, Status.RUNNING)  # held by an attempt of the test's: the workflow only waits
    handle = await h.client.start_workflow("ExportWorkflow", ExportInput(job_id=job_id),
                                           id=export_workflow_id(job_id),
                                           task_queue=h.settings.task_queue, result_type=ExportResult)
    flood = 250
    try:
        await asyncio.gather(*(handle.signal("cancel", {"request_id": f"junk {n}"}) for n in range(flood)))
        valid = uuid.uuid4()
        await handle.signal("cancel", {"request_id": str(valid), "tenant": str(h.tenant_id),
                                       "operator": "ann@example.com", "reason": "after the flood"})
        await eventually(lambda: h.db.admin.fetchval("SELECT count(*) FROM cancellation_requests"),
                         lambda n: n >= 1, timeout=BOUND, interval=0.2, what="the valid cancel recorded")
        rejected = await handle.query("rejected_signals")
        assert len(rejected) == 100 and "request_id" in rejected[-1], (len(rejected), rejected[-1:])
        details = await eventually(lambda: current_details(h, job_id), lambda d: f"{flood} signal(s)" in d,
                                   timeout=10, interval=0.2, what="the details counting every rejected signal")
        assert "the last 100" in details, details
    finally:
        await handle.terminate("test over")
