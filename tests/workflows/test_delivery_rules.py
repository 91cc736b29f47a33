"""The partner over SFTP through the real worker: interrupted uploads and the replacement rules (issue 5).

Every interruption is real: the SFTP server closes the connection at the named point, or a second real client
writes the final name between the listing and the rename.
"""

from __future__ import annotations

import hashlib
import uuid
from contextlib import AsyncExitStack

import asyncssh
import pytest

from activities.partner_connection import connect
from store.models import FailureCode, Status
from store.reconciliation import Reconciliation
from tests.helpers.events import events, kinds
from tests.helpers.harness import (
    Harness,
    WorkerProcess,
    held_at,
    open_harness,
    run_recovery,
    set_contract,
    unknown_original,
)
from tests.helpers.partner import outbound, temp_names
from tests.helpers.support import delivery_evidence, eventually


async def replacement_of(h: Harness, original: uuid.UUID, agreement: str | None = None) -> uuid.UUID:
    return await h.exports.replace(tenant_id=h.tenant_id, original_job_id=original, created_by="ops@example",
                                   reason="the original's outcome is unknown", overwrite_agreement_ref=agreement)


@pytest.mark.spec("IU1")
async def test_interrupted_before_rename__no_final_file_and_not_delivered(db, store, client, tmp_path):
    """Cut on every try, with no hand-back left (`max_hand_backs=1`; with one, the attempt hands itself back for the
    next attempt to try: tests/workflows/test_delivery_retries.py): the outcome follows the evidence."""
    renames, cuts = [], []
    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path, max_hand_backs=1)

        async def cut_mid_transfer(path: str, offset: int) -> None:
            if offset == 0:  # each try's transfer has begun: its first write never completes
                cuts.append(path)
                h.partner.close_connections()

        async def count_rename(old: str, new: str) -> None:
            renames.append(new)

        h.partner.hooks.on_write, h.partner.hooks.before_rename = cut_mid_transfer, count_rename
        job_id = await h.create()
        row = await h.settled(job_id)
        assert cuts and renames == []  # the transfer was cut, and the rename never ran
        assert not (outbound(h.partner) / row.final_name).exists()
        assert (row.status, row.failure_reason, row.attempt_count) == (Status.FAILED, FailureCode.NOT_DELIVERED, 1)
        assert temp_names(h.partner) == []


@pytest.mark.spec("IU2")
async def test_occupied_final_name__original_fails_final_name_occupied_with_nothing_uploaded(harness: Harness):
    h = harness
    job_id = uuid.uuid4()
    key = f"k{uuid.uuid4().hex[:10]}"
    squatter = outbound(h.partner) / f"contacts-{h.tenant_id}-{key}.csv"
    squatter.write_bytes(b"someone else's file\n")
    await h.exports.create(tenant_id=h.tenant_id, destination_id=h.destination_id, created_by="tests",
                           delivery_key=key, job_id=job_id)
    row = await h.settled(job_id)
    assert (row.status, row.failure_reason) == (Status.FAILED, FailureCode.FINAL_NAME_OCCUPIED)
    # Ended in preparation, from Running, where a stop could still have won: never authorized.
    assert "DeliveryAuthorized" not in kinds(await events(h.db, job_id))
    assert squatter.read_bytes() == b"someone else's file\n" and temp_names(h.partner) == []


@pytest.mark.spec("IU3")
async def test_interrupted_just_after_rename__outcome_unknown_until_reconciled(harness: Harness, reconciler):
    h = harness
    original, content = await unknown_original(h)
    row = await h.store.read_job(original)
    assert hashlib.sha256(content).digest() == row.expected_file_sha256  # the file may well be there...
    assert await Reconciliation(reconciler).reconcile(tenant_id=h.tenant_id, job_id=original, attempt_id=row.attempt_id,
                           resolution=Status.COMPLETED, reconciled_by="ops@example",
                           evidence_summary="partner listing and checksum match")  # ...but only evidence says so
    assert (await h.store.read_job(original)).status is Status.COMPLETED


@pytest.mark.spec("RD1")
@pytest.mark.parametrize("evidence", ["read_back", "check_file", "acknowledgment"])
async def test_replacement__original_identified_uploads_nothing_original_delivered(harness: Harness, evidence):
    h = harness
    original, content = await unknown_original(h)
    if evidence in ("read_back", "check_file"):
        await set_contract(h, hash_evidence=evidence)  # a checksum read back, or computed by the partner
    else:
        await set_contract(h, acknowledgment_dir="/acks")
        (h.partner.root / "acks").mkdir()
        name = (await h.store.read_job(original)).final_name
        (h.partner.root / "acks" / f"{name}.ack").write_text(f"sha256={hashlib.sha256(content).hexdigest()}\n")
    replacement = await replacement_of(h, original)
    row = await h.settled(replacement)
    assert (row.status, row.failure_reason) == (Status.FAILED, FailureCode.ORIGINAL_DELIVERED)
    assert (outbound(h.partner) / row.final_name).read_bytes() == content and temp_names(h.partner) == []
    assert (await h.store.read_job(original)).status is Status.OUTCOME_UNKNOWN  # a named person corrects it


@pytest.mark.spec("RD1")
async def test_replacement__hash_extension_withdrawn_touches_nothing(harness: Harness):
    """The contract promises check-file but the partner no longer answers it: the original's file cannot be
    identified by checksum, so the replacement ends before any upload, and the file stays as it is."""
    h = harness
    original, content = await unknown_original(h)
    await set_contract(h, hash_evidence="check_file")
    h.partner.offers_check_file = False
    row = await h.settled(await replacement_of(h, original, agreement="partner ticket 4711"))
    assert (row.status, row.failure_reason) == (Status.FAILED, FailureCode.NOT_DELIVERED)
    assert (outbound(h.partner) / row.final_name).read_bytes() == content and temp_names(h.partner) == []
    details = await delivery_evidence(h.db.admin, row.id)
    assert any("SFTPOpUnsupported" in d for d in details), details


@pytest.mark.spec("RD2")
async def test_replacement__same_size_file_without_evidence_is_occupied_original_unresolved(harness: Harness):
    h = harness
    original, content = await unknown_original(h)  # the partner holds exactly the original's size
    replacement = await replacement_of(h, original)
    row = await h.settled(replacement)
    assert (row.status, row.failure_reason) == (Status.FAILED, FailureCode.FINAL_NAME_OCCUPIED)
    assert (outbound(h.partner) / row.final_name).read_bytes() == content and temp_names(h.partner) == []
    assert (await h.store.read_job(original)).status is Status.OUTCOME_UNKNOWN


async def test_replacement__name_and_size_identify_where_the_contract_accepts_them(harness: Harness):
    h = harness
    original, _ = await unknown_original(h)
    await set_contract(h, name_and_size_identify=True)
    row = await h.settled(await replacement_of(h, original))
    assert (row.status, row.failure_reason) == (Status.FAILED, FailureCode.ORIGINAL_DELIVERED)


def same_size_other_bytes(content: bytes) -> bytes:
    return content[:-2] + (b"X" if content[-2:-1] != b"X" else b"Y") + content[-1:]


@pytest.mark.spec("RD3")
@pytest.mark.parametrize("other", ["different size", "same size, other bytes"])
async def test_replacement__unidentified_file_uploads_nothing_without_agreement(harness: Harness, other):
    h = harness
    original, content = await unknown_original(h)
    await set_contract(h, hash_evidence="read_back")
    name = (await h.store.read_job(original)).final_name
    foreign = b"not the original\n" if other == "different size" else same_size_other_bytes(content)
    (outbound(h.partner) / name).write_bytes(foreign)
    row = await h.settled(await replacement_of(h, original))
    assert (row.status, row.failure_reason) == (Status.FAILED, FailureCode.FINAL_NAME_OCCUPIED)
    assert (outbound(h.partner) / name).read_bytes() == foreign and temp_names(h.partner) == []


@pytest.mark.spec("RD3", "RD4")
@pytest.mark.parametrize("hash_evidence,expected", [("read_back", Status.COMPLETED),
                                                     ("check_file", Status.COMPLETED),
                                                     ("none", Status.OUTCOME_UNKNOWN)])
async def test_replacement__with_agreement_overwrites_completed_only_on_a_matching_hash(
        harness: Harness, hash_evidence, expected):
    h = harness
    original, content = await unknown_original(h)
    await set_contract(h, hash_evidence=hash_evidence)
    name = (await h.store.read_job(original)).final_name
    # The partner holds a file of the same size that nothing identifies: an overwrite needs the agreement.
    foreign = same_size_other_bytes(content)
    (outbound(h.partner) / name).write_bytes(foreign)
    row = await h.settled(await replacement_of(h, original, agreement="partner ticket 4711"))
    assert row.status is expected
    delivered = (outbound(h.partner) / name).read_bytes()
    assert delivered != foreign and hashlib.sha256(delivered).digest() == row.expected_file_sha256
    assert temp_names(h.partner) == []


@pytest.mark.spec("RD5")
async def test_file_appearing_between_listing_and_rename__never_overwritten_outcome_unknown(harness: Harness):
    h = harness
    intruder = b"written by a second client during the upload\n"

    async def second_client_writes(old: str, new: str) -> None:
        dest = h.partner.destination()
        async with connect(dest) as sftp:
            async with sftp.open(new, "wb") as f:
                await f.write(intruder)

    h.partner.hooks.before_rename = second_client_writes
    job_id = await h.create()
    row = await h.settled(job_id)
    assert row.status is Status.OUTCOME_UNKNOWN
    assert (outbound(h.partner) / row.final_name).read_bytes() == intruder


@pytest.fixture
async def process_harness(db, store, client, tmp_path):
    """No in-process worker: worker processes do the work, so that one can be killed."""
    async with AsyncExitStack() as stack:
        yield await open_harness(stack, db, store, client, tmp_path, in_process_worker=False,
                                 lease_seconds=2.0, renew_every_seconds=0.5)


@pytest.mark.spec("RD6")
async def test_replacement_crashed_before_its_baseline__never_completed_from_the_originals_file(process_harness):
    """Crashed after cutoff 2, before looking at its final name, where the original's file lies. Its rename fence
    is open, so it never renamed: recovery takes it back rather than judge it (never Completed from a file that is
    the original's), and its next attempt looks, identifies the original's file and sends nothing."""
    h = process_harness
    healthy = await WorkerProcess(h.settings).start()
    try:
        original, content = await unknown_original(h)
    finally:
        await healthy.stop()
    await set_contract(h, name_and_size_identify=True)  # even where name and size would identify the original
    crashing = await WorkerProcess(h.settings, hold_at="before_upload").start()
    try:
        replacement = await replacement_of(h, original)
        await held_at(h.settings, "before_upload", replacement)
        crashed = await h.store.read_job(replacement)
        crashing.kill()
        await eventually(lambda: h.db.admin.fetchval(
            "SELECT lease_expires_at < clock_timestamp() FROM export_jobs WHERE id = $1", replacement), bool,
            timeout=20, what="the lease expired")
    finally:
        crashing.kill()
    assert crashed.status is Status.DELIVERING
    assert not [d for d in await delivery_evidence(h.db.admin, replacement) if '"step": "baseline"' in d]
    survivor = await WorkerProcess(h.settings).start()
    try:
        report = await run_recovery(h.client, h.settings)
        assert [t.recorded for t in report.taken_over if t.job_id == replacement] == ["RequeuedByRecovery"]
        row = await h.settled(replacement)
    finally:
        await survivor.stop()
    assert (row.status, row.failure_reason) == (Status.FAILED, FailureCode.ORIGINAL_DELIVERED)
    assert row.attempt_id != crashed.attempt_id
    found = kinds(await events(h.db, replacement))
    assert "ResolvedByRecovery" not in found and "Completed" not in found
    assert (outbound(h.partner) / row.final_name).read_bytes() == content and temp_names(h.partner) == []
    assert (await h.store.read_job(original)).status is Status.OUTCOME_UNKNOWN  # a person corrects it, on that


async def test_pinned_host_key_mismatch__refuses_to_connect_and_writes_nothing(harness: Harness):
    h = harness
    wrong = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()
    await h.db.admin.execute("UPDATE destinations SET host_key = $1 WHERE id = $2", wrong, h.destination_id)
    job_id = await h.create()
    row = await h.settled(job_id)
    assert (row.status, row.failure_reason) == (Status.FAILED, FailureCode.NOT_DELIVERED)
    assert list(outbound(h.partner).iterdir()) == [] and temp_names(h.partner) == []
    # Found while preparing, before the build and cutoff 2: the reason is the failure's own.
    failed = await h.db.admin.fetchval("SELECT detail FROM export_attempt_events WHERE job_id = $1 "
                                       "AND kind = 'Failed'", job_id)
    assert "HostKeyMismatch" in failed, failed


async def test_scavenger__a_started_worker_removes_built_files_no_attempt_can_use(db, store, client, tmp_path):
    """Contact data left on disk by a dead worker goes when a worker starts; a live attempt's file stays."""
    from store.models import Status as S
    from tests.helpers.store_states import drive
    from tests.helpers.support import create_job, seed_tenant
    from worker import running_worker

    tenant_id, destination_id = await seed_tenant(db.admin)
    live, settled = await create_job(store, tenant_id, destination_id), await create_job(store, tenant_id,
                                                                                        destination_id)
    live_attempt = await drive(store, live, S.RUNNING)
    settled_attempt = await drive(store, settled, S.COMPLETED)
    work = tmp_path / "work"
    work.mkdir()
    keep = work / f"{live}-{live_attempt}.csv"
    stale = [work / f"{settled}-{settled_attempt}.csv", work / f"{live}-{uuid.uuid4()}.csv",
             work / f"{uuid.uuid4()}-{uuid.uuid4()}.csv"]
    for path in (keep, *stale):
        path.write_text("email,first_name\n")
    settings = db.settings(task_queue=f"exports-{uuid.uuid4().hex[:8]}", work_dir=work)
    async with running_worker(settings, client, with_dispatcher=False):
        pass
    assert keep.exists() and not any(p.exists() for p in stale)
