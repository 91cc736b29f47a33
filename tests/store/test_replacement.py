"""Replacement creation, and correction racing a replacement, against real PostgreSQL."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
import pytest

from store import errors
from store.db import make_engine
from store.models import AuthorizationResult, FailureCode, Status
from store.reconciliation import Reconciliation
from store.statements import statement
from tests.helpers.store_states import built_file, drive
from tests.helpers.support import create_job, eventually, seed_tenant


async def replace(store, tenant_id, original_id, **kwargs) -> uuid.UUID:
    job_id = kwargs.pop("job_id", uuid.uuid4())
    await store.create_replacement(
        tenant_id=tenant_id, original_job_id=original_id, job_id=job_id, created_by="operator@example",
        replacement_reason="original never arrived", **kwargs)
    return job_id


async def jobs_count(db) -> int:
    return await db.admin.fetchval("SELECT count(*) FROM export_jobs")


async def waiting_on(db, holder_pid: int, query_fragment: str) -> bool:
    """Whether a backend running `query_fragment` is blocked by `holder_pid` (pg_blocking_pids)."""
    return bool(await db.admin.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%' || $1 || '%' AND $2 = ANY(pg_blocking_pids(pid))",
        query_fragment, holder_pid))


@pytest.mark.spec("RP1")
@pytest.mark.parametrize("state", [(Status.COMPLETED, None), (Status.RUNNING, None), (Status.DELIVERING, None),
                                   (Status.FAILED, FailureCode.FINAL_NAME_OCCUPIED)])
async def test_replacement__nothing_inserted_for_an_original_that_may_not_be_replaced(db, store, tenant, state):
    tenant_id, destination_id = tenant
    original = await create_job(store, tenant_id, destination_id)
    await drive(store, original, *state)
    before = await jobs_count(db)
    with pytest.raises(errors.NotReplaceable):
        await replace(store, tenant_id, original)
    assert await jobs_count(db) == before


@pytest.mark.spec("RP1")
async def test_replacement__nothing_inserted_for_another_tenants_job(db, store, tenant):
    tenant_id, destination_id = tenant
    original = await create_job(store, tenant_id, destination_id)
    await drive(store, original, Status.OUTCOME_UNKNOWN)
    other_tenant, _ = await seed_tenant(db.admin)
    before = await jobs_count(db)
    with pytest.raises(errors.NotReplaceable):
        await replace(store, other_tenant, original)
    assert await jobs_count(db) == before


@pytest.mark.parametrize("state", [(Status.OUTCOME_UNKNOWN, None), (Status.FAILED, FailureCode.NOT_DELIVERED),
                                   (Status.FAILED, FailureCode.BUILD_FAILED)])
async def test_replacement__carries_the_originals_key_and_records_who_and_why(db, store, tenant, state):
    tenant_id, destination_id = tenant
    original = await create_job(store, tenant_id, destination_id)
    await drive(store, original, *state)
    job_id = await replace(store, tenant_id, original, overwrite_agreement_ref="partner-ticket-42")
    row, first = await store.read_job(job_id), await store.read_job(original)
    assert (row.status, row.delivery_key, row.replaces_job_id) == (Status.QUEUED, first.delivery_key, original)
    assert (row.created_by, row.replacement_reason, row.overwrite_agreement_ref) == (
        "operator@example", "original never arrived", "partner-ticket-42")
    assert await db.admin.fetchval("SELECT count(*) FROM outbox WHERE job_id = $1", job_id) == 1
    # Replacing the replacement resolves to the original: its slot is taken, so this one is refused.
    with pytest.raises(errors.ReplacementSlotTaken):
        await replace(store, tenant_id, job_id)


@pytest.mark.spec("RP2")
async def test_replacement__database_refuses_mismatched_key_tenant_or_a_replacement_as_original(db, store, tenant):
    tenant_id, destination_id = tenant
    original = await create_job(store, tenant_id, destination_id)
    await drive(store, original, Status.OUTCOME_UNKNOWN)
    key = (await store.read_job(original)).delivery_key
    other_tenant, other_destination = await seed_tenant(db.admin)
    insert = """INSERT INTO export_jobs (id, tenant_id, status, version, destination_id, delivery_key, final_name,
                    replaces_job_id, created_by, replacement_reason, woken_at)
                VALUES (gen_random_uuid(), $1, 'Queued', 1, $2, $3,
                        'contacts-' || CAST($1 AS uuid) || '-' || CAST($3 AS text) || '.csv', $4, 'intruder', 'direct',
                        clock_timestamp())"""

    async def refused(*args) -> None:
        with pytest.raises(asyncpg.ForeignKeyViolationError) as error:
            await db.admin.execute(insert, *args)
        assert error.value.constraint_name == "fk_export_jobs_replaces"

    # Keys that exist, so that only the replacement's own foreign key can refuse these rows.
    another = await create_job(store, tenant_id, destination_id)
    await store.create_job(job_id=uuid.uuid4(), tenant_id=other_tenant, destination_id=other_destination,
                           delivery_key=key, created_by="tests")
    another_key = (await store.read_job(another)).delivery_key
    await refused(tenant_id, destination_id, another_key, original)     # key differs from the original's
    await refused(other_tenant, other_destination, key, original)       # tenant differs
    replacement = await replace(store, tenant_id, original)
    await refused(tenant_id, destination_id, key, replacement)          # names a replacement


@pytest.mark.spec("RP3")
async def test_replacement__of_two_simultaneous_creations_one_fails_on_the_index(db, store, tenant):
    tenant_id, destination_id = tenant
    for _ in range(10):
        original = await create_job(store, tenant_id, destination_id)
        await drive(store, original, Status.OUTCOME_UNKNOWN)
        results = await asyncio.gather(replace(store, tenant_id, original), replace(store, tenant_id, original),
                                       return_exceptions=True)
        refused = [r for r in results if isinstance(r, Exception)]
        assert len(refused) == 1 and isinstance(refused[0], errors.ReplacementSlotTaken), results
        assert await db.admin.fetchval("SELECT count(*) FROM export_jobs WHERE replaces_job_id = $1",
                                       original) == 1


@pytest.mark.spec("RP4")
@pytest.mark.parametrize("ending,frees", [((Status.COMPLETED, None), False),
                                          ((Status.FAILED, FailureCode.ORIGINAL_DELIVERED), False),
                                          ((Status.FAILED, FailureCode.NOT_DELIVERED), True)])
async def test_replacement__slot_kept_after_delivery_freed_after_not_delivered(db, store, tenant, ending, frees):
    tenant_id, destination_id = tenant
    original = await create_job(store, tenant_id, destination_id)
    await drive(store, original, Status.OUTCOME_UNKNOWN)
    first = await replace(store, tenant_id, original)
    if ending[1] is FailureCode.ORIGINAL_DELIVERED:
        attempt = await drive(store, first, Status.RUNNING)
        assert await store.finish_failed(first, attempt, FailureCode.ORIGINAL_DELIVERED)
    else:
        await drive(store, first, *ending)
    if frees:
        second = await replace(store, tenant_id, original)
        assert (await store.read_job(second)).status is Status.QUEUED
    else:
        with pytest.raises(errors.ReplacementSlotTaken):
            await replace(store, tenant_id, original)


def make_reconciler_engine(db):
    return make_engine(db.url("reconciler"))


@pytest.mark.spec("RP5")
async def test_replacement__creation_racing_a_correction_waits_then_inserts_nothing(db, store, tenant):
    tenant_id, destination_id = tenant
    original = await create_job(store, tenant_id, destination_id)
    attempt = await drive(store, original, Status.FAILED, FailureCode.NOT_DELIVERED)
    reconciler = make_reconciler_engine(db)
    try:
        # The correction of the original to Completed, committed only when the test says so.
        async with reconciler.connect() as correction:
            tx = await correction.begin()
            corrected = (await correction.execute(statement("correct"), {
                "tenant_id": tenant_id, "job_id": original, "attempt_id": attempt, "recorded_status": "Failed",
                "corrected_status": "Completed", "failure_reason": None, "corrected_by": "reconciler@example",
                "evidence_ref": "listing", "why": "found it"})).rowcount
            assert corrected == 1
            holder = (await correction.exec_driver_sql("SELECT pg_backend_pid()")).scalar()
            creation = asyncio.create_task(replace(store, tenant_id, original))
            await eventually(lambda: waiting_on(db, holder, "WITH original AS"), bool, timeout=10,
                             what="the creation waits on the correction's row lock")
            assert not creation.done()
            await tx.commit()
        with pytest.raises(errors.NotReplaceable):
            await asyncio.wait_for(creation, timeout=10)
    finally:
        await reconciler.dispose()
    assert await db.admin.fetchval("SELECT count(*) FROM export_jobs WHERE replaces_job_id = $1", original) == 0


@pytest.mark.spec("CO2")
async def test_correction__waits_for_a_cutoff_2_that_commits_first_then_succeeds(db, store, app_engine, tenant):
    tenant_id, destination_id = tenant
    original = await create_job(store, tenant_id, destination_id)
    original_attempt = await drive(store, original, Status.FAILED, FailureCode.NOT_DELIVERED)
    replacement = await replace(store, tenant_id, original)
    replacement_attempt = await drive(store, replacement, Status.RUNNING)
    row = await store.read_job(replacement)
    file = built_file(row.final_name)
    # The replacement's cutoff 2, committed only when the test says so: its FOR SHARE holds the original's row.
    async with app_engine.connect() as cutoff:
        tx = await cutoff.begin()
        inserted = (await cutoff.execute(statement("authorize_delivery"), {
            "job_id": replacement, "tenant_id": tenant_id, "attempt_id": replacement_attempt,
            "replaces_job_id": original, "final_name": file.final_name, "length": file.size,
            "sha256": bytes.fromhex(file.sha256_hex), "holder": None, "lease_seconds": 5.0,
            "not_after": None})).rowcount
        assert inserted == 1
        holder = (await cutoff.exec_driver_sql("SELECT pg_backend_pid()")).scalar()
        reconciler = make_reconciler_engine(db)
        try:
            correction = asyncio.create_task(Reconciliation(reconciler).correct(
                tenant_id=tenant_id, job_id=original, attempt_id=original_attempt,
                recorded_status=Status.FAILED, corrected_status=Status.COMPLETED, failure_reason=None,
                corrected_by="reconciler@example", evidence_ref="partner listing 2026-11-30", why="file found"))
            await eventually(lambda: waiting_on(db, holder, "WITH corrected AS"), bool, timeout=10,
                             what="the correction waits on cutoff 2")
            assert not correction.done()
            await tx.commit()
            assert await asyncio.wait_for(correction, timeout=10) is True
        finally:
            await reconciler.dispose()
    assert (await store.read_job(original)).status is Status.COMPLETED
    assert (await store.read_job(replacement)).status is Status.DELIVERING


async def test_cutoff_2__refused_for_a_replacement_whose_original_was_corrected_to_completed(db, store, tenant):
    """The store half of CO1: a correction committed first makes the replacement's cutoff 2 OriginalCompleted."""
    tenant_id, destination_id = tenant
    original = await create_job(store, tenant_id, destination_id)
    original_attempt = await drive(store, original, Status.FAILED, FailureCode.NOT_DELIVERED)
    replacement = await replace(store, tenant_id, original)
    attempt = await drive(store, replacement, Status.RUNNING)
    reconciler = make_reconciler_engine(db)
    try:
        assert await Reconciliation(reconciler).correct(
            tenant_id=tenant_id, job_id=original, attempt_id=original_attempt, recorded_status=Status.FAILED,
            corrected_status=Status.COMPLETED, failure_reason=None, corrected_by="reconciler@example",
            evidence_ref="listing", why="found")
    finally:
        await reconciler.dispose()
    row = await store.read_job(replacement)
    assert await store.authorize_delivery(row, attempt, built_file(row.final_name)) is (
        AuthorizationResult.ORIGINAL_COMPLETED)
    assert (await store.read_job(replacement)).status is Status.RUNNING
