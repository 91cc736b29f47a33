"""What an operator sees, and a terms edit racing a claim, through a real worker and the Temporal dev server."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from temporalio.api.enums.v1 import EventType

from activities import checkpoints
from starter.localstack.partner import LocalPartner
from starter.localstack.seed import seed_destination
from store.models import JobRow, Status
from tests.helpers.harness import Harness
from tests.helpers.support import eventually
from workflows.identity import export_workflow_id


async def listed(h: Harness, query: str) -> list[str]:
    return sorted([w.id async for w in h.client.list_workflows(f"ExportTenant = '{h.tenant_id}' AND {query}")])


@pytest.mark.spec("TW5")
async def test_search_attributes_follow_the_row_and_the_query_returns_it(harness: Harness):
    h = harness
    completed = [await h.create() for _ in range(2)]
    for job_id in completed:
        await h.settled(job_id)

    # The partner drops the connection right after this export's rename: the outcome is unknown.
    async def drop_after_rename(old: str, new: str) -> None:
        h.partner.close_connections()

    h.partner.hooks.after_rename = drop_after_rename
    unknown = await h.create()
    row = await h.settled(unknown)
    h.partner.hooks.after_rename = None
    assert row.status is Status.OUTCOME_UNKNOWN

    await eventually(lambda: listed(h, "ExportStatus = 'OutcomeUnknown'"),
                     lambda ids: ids == [export_workflow_id(unknown)],
                     timeout=20, interval=0.2, what="visibility finds exactly the OutcomeUnknown export")
    assert await listed(h, "ExportStatus = 'Completed'") == sorted(export_workflow_id(j) for j in completed)
    by_key = f"DeliveryKey = '{row.delivery_key}' AND ExportAttempts = 1"
    assert await listed(h, by_key) == [export_workflow_id(unknown)]

    # The query returns the row as the workflow last read it, which is the row as it stands.
    for job_id in (*completed, unknown):
        queried = await h.client.get_workflow_handle(export_workflow_id(job_id)).query("row", result_type=JobRow)
        assert queried == await h.store.read_job(job_id)

    # `exports list` shows what the UI shows, beside the row.
    shown = await h.exports.list(status="OutcomeUnknown", tenant_id=h.tenant_id)
    assert [(e.job_id, e.status, r.status) for e, r in shown] == [(unknown, "OutcomeUnknown", Status.OUTCOME_UNKNOWN)]


class HoldAt(checkpoints.Checkpoints):
    def __init__(self, name: str) -> None:
        self.name = name
        self.reached_event = asyncio.Event()
        self.release = asyncio.Event()
        self.times = 0

    async def reached(self, name: str, job_id: uuid.UUID) -> None:
        if name == self.name and self.times == 0:
            self.times += 1
            self.reached_event.set()
            await asyncio.wait_for(self.release.wait(), timeout=30)


@pytest.mark.spec("CR1")
async def test_terms_edit__old_version_claim_fails_and_the_edit_wakes_the_new_terms(harness: Harness, tmp_path):
    h = harness
    second = LocalPartner(tmp_path / "second-partner")
    await second.start()
    try:
        dest = second.destination()
        second_destination = await seed_destination(
            h.db.admin, h.tenant_id, name="second partner", host=dest.host, port=dest.port, username=dest.username,
            final_dir=dest.final_dir, temp_dir=dest.temp_dir, host_key=dest.host_key,
            credential_ref=dest.credential_ref)
        hold = HoldAt(checkpoints.CLAIM)
        h.activities.checkpoints = hold
        job_id = await h.create()
        await asyncio.wait_for(hold.reached_event.wait(), timeout=20)
        # The worker evaluated version 1 and is about to claim it; the terms change under it.
        assert await h.store.edit_terms(tenant_id=h.tenant_id, job_id=job_id, expected_version=1,
                                destination_id=second_destination)
        edit_message = await h.db.admin.fetchval(
            "SELECT message_id FROM outbox WHERE job_id = $1 ORDER BY created_at DESC LIMIT 1", job_id)
        hold.release.set()
        row = await h.settled(job_id)
        assert (row.status, row.version, row.destination_id) == (Status.COMPLETED, 2, second_destination)
        claims = await h.db.admin.fetch(
            "SELECT version FROM export_attempt_events WHERE job_id = $1 AND kind = 'Claimed'", job_id)
        assert [c["version"] for c in claims] == [2]  # the old version's claim failed and built nothing
        assert (second.root / "outbound" / row.final_name).exists()
        assert list((h.partner.root / "outbound").iterdir()) == []
        # The claim lost, then the edit's own wake-up brought the job back for a fresh evaluation.
        history = await h.client.get_workflow_handle(export_workflow_id(job_id)).fetch_history()
        steps = []
        for e in history.events:
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                steps.append(e.activity_task_scheduled_event_attributes.activity_type.name)
            elif e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
                payload = e.workflow_execution_signaled_event_attributes.input.payloads[0].data
                steps.append("wake (edit)" if str(edit_message).encode() in payload else "wake")
        assert steps[:4] == ["wake", "claim_if_allowed", "wake (edit)", "claim_if_allowed"], steps
    finally:
        await second.stop()
