"""The cancellation request record, against real PostgreSQL with separate connections."""

from __future__ import annotations

import asyncio
import re
import uuid

import pytest

from store.models import CancellationOutcome, ClaimResult, JobRow, Status
from store.schema import export_jobs
from store.statements import SQL_DIR, statement
from tests.helpers.store_states import cancel
from tests.helpers.support import create_job, eventually, seed_tenant


async def requests(db) -> int:
    return await db.admin.fetchval("SELECT count(*) FROM cancellation_requests")


@pytest.fixture
async def queued(db, store):
    tenant_id, destination_id = await seed_tenant(db.admin)
    return tenant_id, await create_job(store, tenant_id, destination_id)


@pytest.mark.spec("RQ1")
async def test_request__same_id_twice_at_once_gives_one_record_and_one_answer(db, store, queued):
    tenant_id, job_id = queued
    request_id = uuid.uuid4()
    first, second = await asyncio.gather(cancel(store, tenant_id, job_id, request_id),
                                         cancel(store, tenant_id, job_id, request_id))
    assert first.outcome is second.outcome is CancellationOutcome.CANCELED_WHILE_QUEUED
    assert first.found_status is second.found_status is Status.QUEUED
    assert await requests(db) == 1
    assert (await store.read_job(job_id)).cancellation_request_id == request_id


@pytest.mark.spec("RQ2")
async def test_request__id_reused_for_another_job_or_operator_in_one_tenant_only(db, store, queued):
    tenant_id, job_id = queued
    destination_id = await db.admin.fetchval("SELECT destination_id FROM export_jobs WHERE id = $1", job_id)
    other_job = await create_job(store, tenant_id, destination_id)
    request_id = uuid.uuid4()
    assert (await cancel(store, tenant_id, job_id, request_id)).outcome is CancellationOutcome.CANCELED_WHILE_QUEUED
    for job, operator in ((other_job, "operator@example"), (job_id, "someone-else@example")):
        reused = await cancel(store, tenant_id, job, request_id, requested_by=operator)
        assert reused.outcome is CancellationOutcome.REQUEST_ID_REUSED
    assert (await store.read_job(other_job)).status is Status.QUEUED
    assert await requests(db) == 1
    # In another tenant the same ID is simply another request.
    other_tenant, other_destination = await seed_tenant(db.admin)
    foreign_job = await create_job(store, other_tenant, other_destination)
    elsewhere = await cancel(store, other_tenant, foreign_job, request_id)
    assert elsewhere.outcome is CancellationOutcome.CANCELED_WHILE_QUEUED
    assert await requests(db) == 2


@pytest.mark.spec("RQ3")
async def test_request__missing_or_foreign_job_is_not_found_and_records_nothing(db, store, queued):
    tenant_id, job_id = queued
    other_tenant, _ = await seed_tenant(db.admin)
    for tenant, job in ((tenant_id, uuid.uuid4()), (other_tenant, job_id)):
        assert (await cancel(store, tenant, job)).outcome is CancellationOutcome.NOT_FOUND
    assert await requests(db) == 0
    assert (await store.read_job(job_id)).status is Status.QUEUED


async def held_row_lock(db, job_id):
    """Another transaction holding the job's row lock: the locking read of the cancellation itself."""
    conn = await db.connect("app")
    tx = conn.transaction()
    await tx.start()
    sql = statement("cancel_lock_job").text
    locking_read = re.sub(r":(\w+)", lambda m: {"job_id": "$1", "tenant_id": "$2"}[m.group(1)], sql)
    tenant_id = await db.admin.fetchval("SELECT tenant_id FROM export_jobs WHERE id = $1", job_id)
    assert await conn.fetchrow(locking_read, job_id, tenant_id) is not None
    return conn, tx


@pytest.mark.spec("RQ4")
async def test_request__lock_timeout_is_busy_records_nothing_and_a_retry_succeeds(db, store, queued):
    tenant_id, job_id = queued
    conn, tx = await held_row_lock(db, job_id)
    request_id = uuid.uuid4()
    try:
        busy = await cancel(store, tenant_id, job_id, request_id)  # the store's lock_timeout is 500 ms
        assert busy.outcome is CancellationOutcome.BUSY
        assert await requests(db) == 0 and (await store.read_job(job_id)).status is Status.QUEUED
    finally:
        await tx.rollback()
        await conn.close()
    retried = await cancel(store, tenant_id, job_id, request_id)
    assert retried.outcome is CancellationOutcome.CANCELED_WHILE_QUEUED
    assert await requests(db) == 1


@pytest.mark.spec("RQ5")
async def test_request__locking_read_blocks_a_claim_until_commit(db, store, queued):
    tenant_id, job_id = queued
    conn, tx = await held_row_lock(db, job_id)
    holder = conn.get_server_pid()
    attempt_id = uuid.uuid4()
    claim = asyncio.create_task(store.claim(job_id, 1, attempt_id, "worker-a"))
    try:
        await eventually(lambda: db.admin.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%WITH claimed AS%' "
            "AND $1 = ANY(pg_blocking_pids(pid))", holder), lambda n: n == 1, timeout=10,
            what="the claim waits on the cancellation's row lock")
        assert not claim.done()
        await tx.commit()
    finally:
        await conn.close()
    assert await asyncio.wait_for(claim, timeout=10) is ClaimResult.CLAIMED


@pytest.mark.spec("MC1")
async def test_mapping__locking_read_selects_exactly_the_mapped_columns(db):
    select_list = statement("cancel_lock_job").text.split("SELECT", 1)[1].split("FROM", 1)[0]
    selected = [c.strip() for c in re.sub(r"--[^\n]*", "", select_list).split(",")]
    mapped = [c.name for c in export_jobs.columns]
    actual = [r["column_name"] for r in await db.admin.fetch(
        "SELECT column_name FROM information_schema.columns WHERE table_name = 'export_jobs' "
        "ORDER BY ordinal_position")]
    assert selected == mapped == actual == list(JobRow.model_fields)


def test_sql_files__every_statement_is_loadable():
    for path in SQL_DIR.glob("*.sql"):
        assert statement(path.stem).text.strip(), path


@pytest.mark.spec("RQ2")
async def test_request__same_id_for_two_jobs_at_once_one_records_other_is_reused(db, store, queued):
    """Different jobs take different row locks, so the second insert meets the primary key: it is answered from
    the request recorded first."""
    tenant_id, job_id = queued
    destination_id = await db.admin.fetchval("SELECT destination_id FROM export_jobs WHERE id = $1", job_id)
    for _ in range(10):
        first_job = await create_job(store, tenant_id, destination_id)
        second_job = await create_job(store, tenant_id, destination_id)
        request_id = uuid.uuid4()
        results = await asyncio.gather(cancel(store, tenant_id, first_job, request_id),
                                       cancel(store, tenant_id, second_job, request_id))
        outcomes = sorted(r.outcome.value for r in results)
        assert outcomes == ["CanceledWhileQueued", "RequestIdReused"], outcomes
        statuses = {(await store.read_job(j)).status for j in (first_job, second_job)}
        assert statuses == {Status.CANCELED, Status.QUEUED}
        assert await db.admin.fetchval("SELECT count(*) FROM cancellation_requests WHERE id = $1", request_id) == 1
