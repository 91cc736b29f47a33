"""The evidence follow-up (matrix LV2), against real PostgreSQL, Temporal and SFTP.

An OutcomeUnknown export is looked at again by EvidenceFollowUpWorkflow, as its schedule starts it, for a bounded
time after it became OutcomeUnknown. It is settled Completed only by proof of content: the final file's SHA-256
read back, or the partner's acknowledgment naming it. Absence and a file of the right size never settle it. What
settled it is recorded (ConfirmedByFollowUp, observed by the follow-up's run), and operators see what is pending,
what is left for them, and what was confirmed.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from pathlib import Path

import asyncpg
import pytest

from activities.contracts import ExportResult, FollowUpInput, FollowUpReport
from starter.schedules import FOLLOW_UP_SCHEDULE, install_schedules, remove_schedules, schedules
from store.follow_up import FollowUp
from store.models import Status
from tests.helpers.harness import Harness, set_contract, unknown_original
from tests.helpers.partner import outbound, outbound_names
from tests.helpers.support import eventually, exports_command
from workflows.identity import EXPORT_CONFIRMED_BY, EXPORT_STATUS, export_workflow_id

BOUND = 60.0


async def follow_up(h: Harness, window_seconds: float = 3600.0) -> FollowUpReport:
    """One run of the follow-up, as its schedule starts it, on the test's task queue."""
    return await asyncio.wait_for(h.client.execute_workflow(
        "EvidenceFollowUpWorkflow", FollowUpInput(limit=50, window_seconds=window_seconds),
        id=f"follow-up-{uuid.uuid4().hex[:8]}", task_queue=h.settings.task_queue, result_type=FollowUpReport), BOUND)


async def overview(h: Harness, job_id: uuid.UUID, window_seconds: float = 3600.0) -> dict:
    found = [f for f in await FollowUp(h.store.engine).overview(window_seconds=window_seconds)
             if f["job_id"] == job_id]
    assert len(found) == 1, found
    return found[0]


def concluded(report: FollowUpReport, job_id: uuid.UUID) -> str:
    return next(o.concluded for o in report.outputs if o.job_id == job_id)


@pytest.mark.spec("LV2")
async def test_an_unknown_delivery_whose_file_reads_back_right_is_settled_completed_with_its_provenance(
        harness: Harness, tmp_path: Path):
    h = harness
    job_id, content = await unknown_original(h)
    assert (await overview(h, job_id))["state"] == "pending"

    report = await follow_up(h)
    assert concluded(report, job_id) == "Completed", report

    row = await h.store.read_job(job_id)
    assert (row.status, row.confirmed_by) == (Status.COMPLETED, "sha256")
    events, _ = await h.store.history(job_id)
    proof = [e for e in events if e["kind"] == "ConfirmedByFollowUp"]
    assert len(proof) == 1 and proof[0]["attempt_id"] == row.attempt_id, events
    assert proof[0]["observed_by"].startswith("follow-up/")
    assert hashlib.sha256(content).hexdigest() in proof[0]["detail"]
    seen = await overview(h, job_id)
    assert (seen["state"], seen["looks"]) == ("confirmed", 1) and "read back" in seen["finding"]

    # The export's workflow follows the row (the statement's outbox row wakes it), and nothing was sent again.
    handle = h.client.get_workflow_handle(export_workflow_id(job_id), result_type=ExportResult)

    async def shown() -> tuple[str | None, str | None]:
        attributes = (await handle.describe()).typed_search_attributes
        return attributes.get(EXPORT_STATUS), attributes.get(EXPORT_CONFIRMED_BY)

    await eventually(shown, lambda s: s == ("Completed", "sha256"), timeout=20, interval=0.2,
                     what=f"the view of {job_id} to say Completed, confirmed by sha256")
    assert (await asyncio.wait_for(handle.result(), BOUND)).status is Status.COMPLETED
    assert outbound_names(h.partner) == [row.final_name]

    # Settled: the next run does not look at it again.
    assert job_id not in [o.job_id for o in (await follow_up(h)).outputs]

    # What operators see.
    listed = await exports_command(h.settings, "follow-ups", "--json", "--tenant", str(h.tenant_id), cwd=tmp_path)
    assert listed.code == 0, listed
    shown = [f for f in json.loads(listed.stdout) if f["job_id"] == str(job_id)]
    assert [(f["state"], f["looks"]) for f in shown] == [("confirmed", 1)], listed.stdout


@pytest.mark.spec("LV2")
async def test_an_acknowledgment_never_outweighs_other_bytes_read_back_at_the_final_name(harness: Harness):
    """Found by review: the delivery and recovery judge a read-back before an acknowledgment (other bytes at the
    final name make the outcome unknown, whatever the acknowledgment names); the follow-up settled Completed on the
    same evidence. Once the partner has taken the file, the acknowledgment is all there is, and settles it."""
    h = harness
    job_id, content = await unknown_original(h)
    row = await h.store.read_job(job_id)
    final = outbound(h.partner) / row.final_name
    await set_contract(h, acknowledgment_dir="/acks")
    (h.partner.root / "acks").mkdir()
    (h.partner.root / "acks" / f"{row.final_name}.ack").write_text(f"sha256={hashlib.sha256(content).hexdigest()}\n")
    final.write_bytes(bytes(b ^ 0xFF for b in content))  # the right size, other bytes

    assert concluded(await follow_up(h), job_id) == "OutcomeUnknown"
    assert "not the expected file's" in (await overview(h, job_id))["finding"]
    assert (await h.store.read_job(job_id)).status is Status.OUTCOME_UNKNOWN

    final.unlink()  # the partner took it: only the acknowledgment is left
    assert concluded(await follow_up(h), job_id) == "Completed"
    assert (await h.store.read_job(job_id)).confirmed_by == "acknowledgment"


@pytest.mark.spec("LV2")
async def test_absence_and_size_never_settle__an_acknowledgment_naming_the_file_does(harness: Harness):
    h = harness
    job_id, content = await unknown_original(h)
    row = await h.store.read_job(job_id)
    final = outbound(h.partner) / row.final_name

    port = await h.db.admin.fetchval("SELECT port FROM destinations WHERE id = $1", h.destination_id)
    await set_contract(h, port=1)  # nothing listens there: the partner cannot be looked at
    assert concluded(await follow_up(h), job_id) == "OutcomeUnknown"
    assert "could not be looked at" in (await overview(h, job_id))["finding"]
    await set_contract(h, port=port)

    final.write_bytes(bytes(b ^ 0xFF for b in content))  # the right size, other bytes
    assert concluded(await follow_up(h), job_id) == "OutcomeUnknown"
    seen = await overview(h, job_id)
    assert (seen["state"], seen["looks"]) == ("pending", 2)
    assert f"holds {len(content)} bytes" in seen["finding"] and "not the expected file's" in seen["finding"]

    final.unlink()  # the partner took it
    assert concluded(await follow_up(h), job_id) == "OutcomeUnknown"
    seen = await overview(h, job_id)
    assert seen["looks"] == 3 and "absent" in seen["finding"], seen
    assert (await h.store.read_job(job_id)).status is Status.OUTCOME_UNKNOWN

    await set_contract(h, acknowledgment_dir="/acks")
    (h.partner.root / "acks").mkdir()
    (h.partner.root / "acks" / f"{row.final_name}.ack").write_text("sha256=" + "0" * 64 + "\n")
    assert concluded(await follow_up(h), job_id) == "OutcomeUnknown"  # an acknowledgment of other bytes
    assert "not the expected file" in (await overview(h, job_id))["finding"]

    (h.partner.root / "acks" / f"{row.final_name}.ack").write_text(
        f"sha256={hashlib.sha256(content).hexdigest()}\n")
    assert concluded(await follow_up(h), job_id) == "Completed"
    row = await h.store.read_job(job_id)
    assert (row.status, row.confirmed_by) == (Status.COMPLETED, "acknowledgment")
    assert outbound_names(h.partner) == []  # nothing was sent again


@pytest.mark.spec("LV2")
async def test_past_its_window_an_export_is_left_for_a_person_and_not_looked_at(harness: Harness):
    h = harness
    job_id, _ = await unknown_original(h)
    await asyncio.sleep(1.5)
    report = await follow_up(h, window_seconds=1.0)
    assert job_id not in [o.job_id for o in report.outputs]
    seen = await overview(h, job_id, window_seconds=1.0)
    assert (seen["state"], seen["looks"]) == ("for a person", 0)
    assert (await h.store.read_job(job_id)).status is Status.OUTCOME_UNKNOWN


@pytest.mark.spec("LV2")
async def test_the_follow_ups_kind_proves_only_a_content_proof_and_only_for_the_application(harness: Harness):
    """The database holds the rule, whatever a role writes: the reconciler may not write the follow-up's kind, and
    the application may not settle with it by size, nor to Failed."""
    h = harness
    job_id, _ = await unknown_original(h)
    row = await h.store.read_job(job_id)
    settle = """
        WITH s AS (UPDATE export_jobs SET status = $2, confirmed_by = $3,
                                          failure_reason = CASE WHEN $2 = 'Failed' THEN 'NotDelivered' END
                   WHERE id = $1 AND status = 'OutcomeUnknown' RETURNING id, attempt_id)
        INSERT INTO export_attempt_events (job_id, attempt_id, kind, observed_by, detail, recorded_at)
        SELECT id, attempt_id, 'ConfirmedByFollowUp', 'follow-up/forged', 'forged', clock_timestamp() FROM s"""
    for role, status, confirmed_by in [("app", "Completed", "size"), ("app", "Failed", None),
                                       ("reconciler", "Completed", "sha256")]:
        conn = await h.db.connect(role)
        try:
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute(settle, job_id, status, confirmed_by)
        finally:
            await conn.close()
    assert (await h.store.read_job(job_id)).status is Status.OUTCOME_UNKNOWN
    assert row.attempt_id is not None


@pytest.mark.spec("LV2")
async def test_the_follow_up_has_its_schedule_which_a_rollback_can_remove(harness: Harness, tmp_path: Path):
    h = harness
    schedule = schedules(h.settings)[FOLLOW_UP_SCHEDULE]
    assert schedule.action.workflow == "EvidenceFollowUpWorkflow"  # type: ignore[attr-defined]
    assert schedule.action.args[0].window_seconds == h.settings.follow_up_window_seconds  # type: ignore
    refused = await exports_command(h.settings, "schedules", "remove", "exports-nonesuch", cwd=tmp_path)
    assert (refused.code, len(refused.stderr.strip().splitlines())) == (2, 1), refused
    assert "exports-follow-up" in refused.stderr
    settings = h.settings.model_copy(update={"follow_up_interval_seconds": 3600.0})
    await install_schedules(h.client, settings)
    try:
        removed = await exports_command(settings, "schedules", "remove", FOLLOW_UP_SCHEDULE, cwd=tmp_path)
        assert removed.code == 0 and f"{FOLLOW_UP_SCHEDULE}: removed" in removed.stdout, removed
        again = await exports_command(settings, "schedules", "remove", FOLLOW_UP_SCHEDULE, cwd=tmp_path)
        assert again.code == 0 and "not installed" in again.stdout, again
        ids = [s.id async for s in await h.client.list_schedules()]
        assert FOLLOW_UP_SCHEDULE not in ids
    finally:
        await remove_schedules(h.client, list(schedules(settings)))


async def _follow_up(h: Harness, limit: int = 50, window_seconds: float = 3600.0) -> FollowUpReport:
    return await asyncio.wait_for(h.client.execute_workflow(
        "EvidenceFollowUpWorkflow", FollowUpInput(limit=limit, window_seconds=window_seconds),
        id=f"follow-up-{uuid.uuid4().hex[:8]}", task_queue=h.settings.task_queue, result_type=FollowUpReport), 60)


@pytest.mark.spec("LV2")
async def test_follow_up_never_settles_an_original_from_its_replacements_file(harness: Harness):
    """An original ends OutcomeUnknown and its file is not (or no longer) at the partner; a person replaces it and
    the replacement delivers its own file under the shared final name, Completed. The original was never proven
    delivered: the only file there is the replacement's. The follow-up must not settle the original Completed from
    it (cutoff 2 refuses a replacement whose original is Completed, so that one final name never has two Completed
    exports for one rename). Seen failing: it settled the original Completed, by sha256, from the replacement's
    file."""
    h = harness
    original, content = await unknown_original(h)
    row = await h.store.read_job(original)
    final = outbound(h.partner) / row.final_name
    final.unlink()  # not there: the rename was never carried out, or the partner took it

    replacement = await h.exports.replace(tenant_id=h.tenant_id, original_job_id=original, created_by="ops@example",
                                          reason="the original's outcome is unknown")
    done = await h.settled(replacement)
    assert done.status is Status.COMPLETED
    # The replacement's own file, byte for byte the original's expected one (same tenant, same contacts).
    assert hashlib.sha256(final.read_bytes()).digest() == row.expected_file_sha256

    report = await _follow_up(h)
    looked = [o for o in report.outputs if o.job_id == original]
    after = await h.store.read_job(original)
    assert after.status is Status.OUTCOME_UNKNOWN, (
        f"original settled {after.status.value} (confirmed_by={after.confirmed_by}) from its replacement's file; "
        f"follow-up said {looked}; the final name has one rename and two Completed exports")


@pytest.mark.spec("LV2")
async def test_an_acknowledgment_with_a_nul_byte_is_a_finding_and_starves_no_other_export(harness: Harness):
    """A partner that lies in its acknowledgment (a NUL byte in it) must make a finding like any other, and must
    not keep the follow-up from the exports behind it: each run looks at the least recently looked at first. Seen
    failing: PostgreSQL refused the finding, the look was never counted, and the same export came first in every
    run."""
    h = harness
    first, _ = await unknown_original(h)  # became OutcomeUnknown first: looked at first
    second, _ = await unknown_original(h)
    first_row = await h.store.read_job(first)
    (outbound(h.partner) / first_row.final_name).unlink()  # the partner took the first's file
    await set_contract(h, acknowledgment_dir="/acks")
    (h.partner.root / "acks").mkdir()
    (h.partner.root / "acks" / f"{first_row.final_name}.ack").write_text("sha256=\x00" + "0" * 63 + "\n")

    reports = [await _follow_up(h, limit=1) for _ in range(3)]
    outputs = [o for r in reports for o in r.outputs]
    assert (await h.store.read_job(second)).status is Status.COMPLETED, (
        f"the second export (its file reads back right) was never looked at in three runs; the runs looked at "
        f"{[(str(o.job_id)[:8], o.concluded, o.finding[:120]) for o in outputs]}")
