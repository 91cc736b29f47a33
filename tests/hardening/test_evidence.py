"""Recovery judges a Delivering attempt as its worker would (matrix EV1, EV2), against real PostgreSQL, the Temporal
dev server (recovery runs as its workflow on a real worker) and the local SFTP partner.

Each attempt is arranged through the real statements and left Delivering with an expired lease, as a worker that
died after its rename leaves it: past its rename fence, so recovery judges it rather than take it back. Its
evidence is what the real delivery code appends: `partner_delivery.deliver` runs against the partner and appends to
the store; only the terminal write is never made.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path

import asyncpg
import pytest

from activities.destination import DestinationConfig, Replacement
from activities.outcomes import DeliveryResult
from activities.partner_delivery import deliver
from store.models import AuthorizationResult, BuiltFile, ClaimResult, JobRow, Status
from tests.helpers.harness import Harness, run_recovery, set_contract
from tests.helpers.partner import outbound_names, write_as_other_party

SIZE = 4096


async def delivering(h: Harness, content: bytes, *, job_id: uuid.UUID | None = None) -> tuple[JobRow, uuid.UUID]:
    """An export past cutoff 2 and its rename fence whose expected file is `content`; no worker holds it."""
    if job_id is None:
        job_id = uuid.uuid4()
        await h.store.create_job(job_id=job_id, tenant_id=h.tenant_id, destination_id=h.destination_id,
                                 delivery_key=f"k{job_id.hex[:12]}", created_by="tests")
    row = await h.store.read_job(job_id)
    attempt_id = uuid.uuid4()
    assert await h.store.claim(job_id, row.version, attempt_id, "worker-gone") is ClaimResult.CLAIMED
    file = BuiltFile(path="/unused", final_name=row.final_name, size=len(content),
                     sha256_hex=hashlib.sha256(content).hexdigest(), holder="worker-gone")
    assert await h.store.authorize_delivery(row, attempt_id, file) is AuthorizationResult.AUTHORIZED
    assert await h.store.pass_rename_fence(job_id, attempt_id, "worker-gone", f"worker-gone/{attempt_id}",
                                           {"step": "rename", "final": row.final_name})
    return await h.store.read_job(job_id), attempt_id


async def worker_delivers(h: Harness, row: JobRow, attempt_id: uuid.UUID, local: Path, *,
                          replacement: Replacement | None = None) -> DeliveryResult:
    """The real delivery code, appending its evidence as the deliver activity does; the worker then dies."""
    dest_row = await h.store.read_destination(row.tenant_id, row.destination_id)

    async def record(detail: dict) -> None:
        await h.store.append_evidence(row.id, attempt_id, f"worker-gone/{attempt_id}", detail,
                                      holder="worker-gone")

    return await deliver(DestinationConfig.from_row(dest_row), str(local), row.final_name,
                         f".{row.final_name}.{attempt_id}.part", record_evidence=record,
                         expected_sha256=row.expected_file_sha256.hex(), replacement=replacement)


async def recover(h: Harness, job_id: uuid.UUID) -> tuple[JobRow, str]:
    await h.db.admin.execute("UPDATE export_jobs SET lease_expires_at = clock_timestamp() - interval '1 second' "
                             "WHERE id = $1", job_id)
    report = await run_recovery(h.client, h.settings)
    assert [t.recorded for t in report.taken_over if t.job_id == job_id] == ["ResolvedByRecovery"]
    detail = await h.db.admin.fetchval("SELECT detail FROM export_attempt_events WHERE job_id = $1 "
                                       "AND kind = 'ResolvedByRecovery'", job_id)
    return await h.store.read_job(job_id), detail


def receipt_of(evidence: list[str]) -> dict:
    return [json.loads(d) for d in evidence if json.loads(d)["step"] == "receipt"][-1]


# --- EV1: a receipt is judged by the worker's own rule ------------------------------------------------------------


@pytest.mark.spec("EV1")
async def test_recovery__a_receipt_whose_sha256_differs_is_outcome_unknown_as_the_worker_says(quiet_harness, tmp_path):
    h = quiet_harness
    await set_contract(h, hash_evidence="read_back")
    expected, built = b"a" * SIZE, b"b" * SIZE  # same size, other bytes: the file at the partner is not the one
    row, attempt_id = await delivering(h, expected)
    (tmp_path / "built.csv").write_bytes(built)
    worker = await worker_delivers(h, row, attempt_id, tmp_path / "built.csv")
    assert worker.outcome == "OutcomeUnknown"
    from tests.helpers.support import delivery_evidence
    receipt = receipt_of(await delivery_evidence(h.db.admin, row.id))
    assert receipt["final"]["size"] == SIZE and receipt["sha256"] == hashlib.sha256(built).hexdigest()

    resolved, detail = await recover(h, row.id)
    assert resolved.status is Status.OUTCOME_UNKNOWN, detail
    assert detail.startswith("OutcomeUnknown: receipt appended by the attempt") and "sha256" in detail


@pytest.mark.spec("EV1")
async def test_recovery__an_overwrite_no_hash_confirmed_is_outcome_unknown_as_the_worker_says(quiet_harness,
                                                                                              tmp_path):
    h = quiet_harness  # contract: no evidence by content, names and sizes do not identify
    original, _ = await delivering(h, b"o" * SIZE)
    await h.store.finish_delivery(original.id, original.attempt_id, Status.OUTCOME_UNKNOWN, None, "arranged")
    await write_as_other_party(h.partner.destination(), f"/outbound/{original.final_name}", b"o" * SIZE)
    replacement_id = uuid.uuid4()
    await h.store.create_replacement(tenant_id=h.tenant_id, original_job_id=original.id,
                             job_id=replacement_id, created_by="ops", replacement_reason="lost",
                             overwrite_agreement_ref="partner ticket 7")
    content = b"r" * SIZE  # a rebuild of the same size
    row, attempt_id = await delivering(h, content, job_id=replacement_id)
    (tmp_path / "built.csv").write_bytes(content)
    worker = await worker_delivers(h, row, attempt_id, tmp_path / "built.csv", replacement=Replacement(
        original_bytes=SIZE, original_sha256=original.expected_file_sha256.hex(), overwrite_agreed=True))
    assert worker.outcome == "OutcomeUnknown" and "overwritten" in worker.summary
    assert (h.partner.root / "outbound" / row.final_name).read_bytes() == content  # it did overwrite

    resolved, detail = await recover(h, row.id)
    assert resolved.status is Status.OUTCOME_UNKNOWN, detail
    assert "overwritten" in detail


@pytest.mark.spec("EV1")
async def test_recovery__a_receipt_confirmed_by_sha256_is_completed_as_the_worker_says(quiet_harness, tmp_path):
    h = quiet_harness
    await set_contract(h, hash_evidence="check_file")
    content = b"c" * SIZE
    row, attempt_id = await delivering(h, content)
    (tmp_path / "built.csv").write_bytes(content)
    worker = await worker_delivers(h, row, attempt_id, tmp_path / "built.csv")
    assert worker.outcome == "Completed"
    resolved, detail = await recover(h, row.id)
    assert resolved.status is Status.COMPLETED and "confirmed by sha256" in detail, detail


# --- EV2: without a receipt, recovery asks for evidence by content where the contract offers it -------------------


async def died_after_rename(h: Harness, row: JobRow, attempt_id: uuid.UUID, content: bytes) -> None:
    """The attempt recorded its (absent) baseline and its rename, the file reached the final name, and the worker
    died before it could take its receipt."""
    for record in ({"step": "baseline", "final": {"path": f"/outbound/{row.final_name}", "exists": False}},
                   {"step": "rename", "final": f"/outbound/{row.final_name}", "bytes": len(content)}):
        await h.store.append_evidence(row.id, attempt_id, f"worker-gone/{attempt_id}", record,
                                      holder="worker-gone")
    await write_as_other_party(h.partner.destination(), f"/outbound/{row.final_name}", content)


@pytest.mark.spec("EV2")
@pytest.mark.parametrize("offer", ["read_back", "check_file", "acknowledgment"])
async def test_recovery__completed_by_content_where_the_contract_offers_it(quiet_harness, offer):
    h = quiet_harness
    content = b"e" * SIZE
    row, attempt_id = await delivering(h, content)
    if offer == "acknowledgment":
        await set_contract(h, acknowledgment_dir="/acks")
        (h.partner.root / "acks").mkdir(exist_ok=True)
        (h.partner.root / "acks" / f"{row.final_name}.ack").write_text(
            f"sha256={hashlib.sha256(content).hexdigest()}\n")
    else:
        await set_contract(h, hash_evidence=offer)
    await died_after_rename(h, row, attempt_id, content)
    resolved, detail = await recover(h, row.id)
    assert resolved.status is Status.COMPLETED, detail
    how = "the partner's acknowledgment" if offer == "acknowledgment" else "sha256"
    assert f"confirmed by {how}" in detail, detail


@pytest.mark.spec("EV2")
@pytest.mark.parametrize("offer", ["read_back", "check_file"])
async def test_recovery__same_size_other_bytes_is_outcome_unknown_where_content_is_offered(quiet_harness, offer):
    h = quiet_harness
    await set_contract(h, hash_evidence=offer)
    row, attempt_id = await delivering(h, b"x" * SIZE)
    await died_after_rename(h, row, attempt_id, b"y" * SIZE)
    resolved, detail = await recover(h, row.id)
    assert resolved.status is Status.OUTCOME_UNKNOWN, detail
    assert "sha256 is not the expected file's" in detail


@pytest.mark.spec("EV2")
@pytest.mark.parametrize("name_and_size_identify,expected", [(False, Status.OUTCOME_UNKNOWN),
                                                             (True, Status.COMPLETED)])
async def test_recovery__a_replacement_is_completed_by_name_and_size_only_where_the_contract_says_so(
        quiet_harness, name_and_size_identify, expected):
    h = quiet_harness
    await set_contract(h, name_and_size_identify=name_and_size_identify)
    original, _ = await delivering(h, b"o" * SIZE)
    await h.store.finish_delivery(original.id, original.attempt_id, Status.OUTCOME_UNKNOWN, None, "arranged")
    replacement_id = uuid.uuid4()
    await h.store.create_replacement(tenant_id=h.tenant_id, original_job_id=original.id,
                             job_id=replacement_id, created_by="ops", replacement_reason="lost")
    content = b"r" * SIZE
    row, attempt_id = await delivering(h, content, job_id=replacement_id)
    await died_after_rename(h, row, attempt_id, content)
    resolved, detail = await recover(h, row.id)
    assert resolved.status is expected, detail


# --- FG1: only the attempt's holder's evidence is judged by, as the database stamped it ---------------------------

FORGED_RECEIPT = ("INSERT INTO export_attempt_events (job_id, attempt_id, kind, worker_id, observed_by, detail, "
                  "recorded_at) VALUES ($1, $2, 'DeliveryEvidence', $3, $4, $5, clock_timestamp())")


def receipt_claiming(row: JobRow, content: bytes, *, exists: bool = True) -> str:
    """A receipt in the delivery's own shape, saying the partner holds `content` under the final name."""
    return json.dumps({"step": "receipt", "final": {"path": f"/outbound/{row.final_name}", "exists": exists,
                                                      "size": len(content) if exists else None},
                       "expected_bytes": len(content), "sha256": hashlib.sha256(content).hexdigest(),
                       "sha256_error": None, "acknowledged_sha256": None,
                       "expected_sha256": hashlib.sha256(content).hexdigest(), "overwrite": False})


@pytest.mark.spec("FG1")
async def test_forged_receipts__no_other_role_or_attempt_adds_one_recovery_takes(quiet_harness):
    """Nothing was uploaded. The reconciler appends a receipt naming the holder (refused), then one without
    (kept, not judged by); the application appends one for an earlier attempt's holder and one naming a holder
    that is not the row's (both kept without a holder). Recovery looks for itself: OutcomeUnknown."""
    h = quiet_harness
    content = b"f" * SIZE
    row, attempt_id = await delivering(h, content)
    forged = receipt_claiming(row, content)
    reconciler = await h.db.connect("reconciler")
    app = await h.db.connect("app")
    try:
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await reconciler.execute(FORGED_RECEIPT, row.id, attempt_id, "worker-gone", "reconciler", forged)
        await reconciler.execute(FORGED_RECEIPT, row.id, attempt_id, None, "reconciler", forged)
        await app.execute(FORGED_RECEIPT, row.id, attempt_id, "another-worker", "app", forged)
        await app.execute(FORGED_RECEIPT, row.id, uuid.uuid4(), "worker-gone", "app", forged)
    finally:
        await reconciler.close()
        await app.close()
    stamped = await h.db.admin.fetch("SELECT observed_by, worker_id FROM export_attempt_events WHERE job_id = $1 "
                                     "AND kind = 'DeliveryEvidence' ORDER BY id", row.id)
    # The holder's own record of its rename (its fence), then the forgeries, none stamped with a holder.
    assert [(r["observed_by"], r["worker_id"]) for r in stamped] == [
        (f"worker-gone/{attempt_id}", "worker-gone"), ("reconciler", None), ("app", None), ("app", None)]
    assert outbound_names(h.partner) == []

    resolved, detail = await recover(h, row.id)
    assert resolved.status is Status.OUTCOME_UNKNOWN, detail
    assert "receipt" not in detail and "absent" in detail, detail


@pytest.mark.spec("FG1")
async def test_forged_receipt_after_the_holders_real_one_changes_nothing(quiet_harness, tmp_path):
    """The holder's own receipt says Completed; a later receipt by the reconciler saying the file is absent is kept
    for people and does not override it."""
    h = quiet_harness
    content = b"g" * SIZE
    row, attempt_id = await delivering(h, content)
    (tmp_path / "built.csv").write_bytes(content)
    assert (await worker_delivers(h, row, attempt_id, tmp_path / "built.csv")).outcome == "Completed"
    reconciler = await h.db.connect("reconciler")
    try:
        await reconciler.execute(FORGED_RECEIPT, row.id, attempt_id, None, "reconciler",
                                 receipt_claiming(row, content, exists=False))
    finally:
        await reconciler.close()

    resolved, detail = await recover(h, row.id)
    assert resolved.status is Status.COMPLETED, detail
    assert "receipt appended by the attempt's holder worker-gone" in detail, detail


@pytest.mark.spec("FG1")
async def test_a_malformed_receipt_is_skipped_and_reported__the_run_settles_every_export(quiet_harness, caplog):
    """The holder's receipt names `final` as a string. Recovery reports it in one line, judges from its own look,
    and the other expired export of the same run is resolved too."""
    h = quiet_harness
    content = b"h" * SIZE
    broken, broken_attempt = await delivering(h, content)
    other, _ = await delivering(h, content)
    await h.store.append_evidence(broken.id, broken_attempt, f"worker-gone/{broken_attempt}",
                                  {"step": "receipt", "final": "not an object", "sha256": "0" * 64},
                                  holder="worker-gone")
    await h.db.admin.execute("UPDATE export_jobs SET lease_expires_at = clock_timestamp() - interval '1 second' "
                             "WHERE id = ANY($1::uuid[])", [broken.id, other.id])

    report = await run_recovery(h.client, h.settings)
    recorded = {t.job_id: t.recorded for t in report.taken_over}
    assert recorded[broken.id] == recorded[other.id] == "ResolvedByRecovery", report
    assert (await h.store.read_job(broken.id)).status is Status.OUTCOME_UNKNOWN
    assert (await h.store.read_job(other.id)).status is Status.OUTCOME_UNKNOWN
    reported = [r.getMessage() for r in caplog.records if "malformed" in r.getMessage()]
    assert len(reported) == 1 and str(broken.id) in reported[0], reported
