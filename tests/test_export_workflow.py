"""One export end to end through a real worker, the Temporal dev server, PostgreSQL and an SFTP partner."""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path

import pytest
from sqlalchemy import text
from temporalio.api.enums.v1 import EventType

from starter.client import ExportsClient
from starter.dispatcher import OutboxDispatcher
from store.db import asyncpg_dsn, make_engine
from store.models import CancellationOutcome, Status
from tests.support import eventually
from tests.workflow_support import Harness


async def kinds(db, job_id: uuid.UUID) -> list[str]:
    rows = await db.admin.fetch("SELECT kind FROM export_attempt_events WHERE job_id = $1 ORDER BY id", job_id)
    return [r["kind"] for r in rows]


def assert_partner_holds(partner_root: Path, row) -> None:
    data = (partner_root / "outbound" / row.final_name).read_bytes()
    assert (len(data), hashlib.sha256(data).digest()) == (row.expected_file_bytes, row.expected_file_sha256)
    assert list((partner_root / "incoming-tmp").iterdir()) == []


@pytest.mark.spec("TW1")
async def test_workflow__one_export_runs_every_step_as_an_activity(harness: Harness):
    job_id = await harness.create()
    row = await harness.settled(job_id)
    assert row.status is Status.COMPLETED and row.attempt_count == 1
    assert_partner_holds(harness.partner.root, row)
    events = await kinds(harness.db, job_id)
    assert events[:2] == ["Claimed", "DeliveryAuthorized"] and events[-1] == "Finished"
    assert "DeliveryEvidence" in events
    # One workflow, and each step an activity of it.
    history = await harness.client.get_workflow_handle(f"export-{job_id}").fetch_history()
    activities = [e.activity_task_scheduled_event_attributes.activity_type.name for e in history.events
                  if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED]
    assert activities == ["evaluate_policy", "claim", "build", "authorize_delivery", "deliver", "evaluate_policy"]
    assert not list(Path(harness.settings.work_dir).glob("*.csv")), "the local file was not removed"


@pytest.mark.spec("TW4")
async def test_workflow__platform_team_starts_with_plain_client_call(harness: Harness):
    exports = ExportsClient(harness.store, harness.client, task_queue=harness.settings.task_queue)
    handle = await exports.start(tenant_id=harness.tenant_id, destination_id=harness.destination_id,
                                 created_by="platform-team")
    result = await handle.result(rpc_timeout=None)
    assert result.status is Status.COMPLETED
    row = await harness.store.read_job(result.job_id)
    assert row.status is Status.COMPLETED and row.created_by == "platform-team"
    assert_partner_holds(harness.partner.root, row)


@pytest.mark.spec("TW8")
async def test_dispatcher__publishes_every_row_and_retries_with_its_message_id(quiet_harness: Harness, db):
    harness = quiet_harness  # its worker runs no dispatcher; this one runs under the dispatcher role
    engine = make_engine(db.url("dispatcher"))
    failures = {"left": 1}

    class FlakyDispatcher(OutboxDispatcher):
        async def publish(self, message_id, job_id):
            if failures["left"]:
                failures["left"] -= 1
                raise ConnectionError("Temporal unreachable")
            await super().publish(message_id, job_id)

    dispatcher = FlakyDispatcher(harness.client, engine, asyncpg_dsn(db.url("dispatcher")),
                                 task_queue=harness.settings.task_queue, poll_seconds=0.2)
    try:
        job_id = await harness.store_create()
        message_id = await db.admin.fetchval("SELECT message_id FROM outbox WHERE job_id = $1", job_id)
        assert await dispatcher.dispatch_once() == 0  # the publication failed: the row stays unpublished
        assert await db.admin.fetchval("SELECT published_at FROM outbox WHERE job_id = $1", job_id) is None
        assert await dispatcher.dispatch_once() == 1
        assert await db.admin.fetchval("SELECT published_at FROM outbox WHERE job_id = $1", job_id) is not None
        row = await harness.settled(job_id)
        assert row.status is Status.COMPLETED
        history = await harness.client.get_workflow_handle(f"export-{job_id}").fetch_history()
        signals = [e for e in history.events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED]
        payload = signals[0].workflow_execution_signaled_event_attributes.input.payloads[0].data
        assert str(message_id).encode() in payload
        async with engine.connect() as conn:
            assert (await conn.execute(text("SELECT current_user"))).scalar() == "exports_dispatcher"
    finally:
        await engine.dispose()


@pytest.mark.spec("TW8")
async def test_dispatcher__created_job_reaches_a_worker_without_a_sweep(harness: Harness):
    dispatching_harness = harness
    job_ids = [await dispatching_harness.store_create() for _ in range(3)]
    for job_id in job_ids:
        assert (await dispatching_harness.settled(job_id)).status is Status.COMPLETED
    assert await dispatching_harness.db.admin.fetchval(
        "SELECT count(*) FROM outbox WHERE published_at IS NULL") == 0
    assert await dispatching_harness.db.admin.fetchval("SELECT max(sweep_count) FROM export_jobs") == 0


@pytest.mark.spec("AR3")
async def test_cancel__stop_before_cutoff_2_ends_stopped_with_nothing_delivered(slow_build_harness: Harness):
    h = slow_build_harness
    job_id = await h.create()
    await eventually(lambda: h.store.read_job(job_id), lambda r: r.status is Status.RUNNING, what="Running")
    result = await h.exports.cancel(tenant_id=h.tenant_id, job_id=job_id, requested_by="op", reason="stop")
    assert result.outcome is CancellationOutcome.STOP_REQUESTED
    row = await h.settled(job_id)
    assert row.status is Status.STOPPED and row.stop_request_id == result.request_id
    assert row.delivery_authorized_at is None
    assert "DeliveryAuthorized" not in await kinds(h.db, job_id) and "Stopped" in await kinds(h.db, job_id)
    assert list((h.partner.root / "outbound").iterdir()) == []
    assert list((h.partner.root / "incoming-tmp").iterdir()) == []
    assert not list(Path(h.settings.work_dir).glob("*.csv")), "the partial file was not removed"


@pytest.mark.spec("AR4")
async def test_cancel__after_cutoff_2_is_too_late_and_delivery_completes(slow_upload_harness: Harness):
    h = slow_upload_harness
    job_id = await h.create()
    await eventually(lambda: h.store.read_job(job_id), lambda r: r.status is Status.DELIVERING, what="Delivering")
    result = await h.exports.cancel(tenant_id=h.tenant_id, job_id=job_id, requested_by="op", reason="late")
    assert result.outcome is CancellationOutcome.TOO_LATE
    row = await h.settled(job_id)
    assert row.status is Status.COMPLETED and row.stop_request_id is None
    assert_partner_holds(h.partner.root, row)
    recorded = await h.db.admin.fetchrow("SELECT outcome, found_status FROM cancellation_requests")
    assert tuple(recorded) == ("TooLate", "Delivering")
