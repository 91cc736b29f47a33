"""Two tenants whose destinations point at one partner directory (matrix DV1): whatever delivery keys they
choose, neither can write, overwrite, block, identify or sweep the other's files. Real PostgreSQL, a real worker
on the Temporal dev server and the local SFTP partner; the migration test runs Alembic on a real database."""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy.ext.asyncio import create_async_engine

from activities.contracts import PartnerSweepOutput
from activities.partner_delivery import temp_file_name
from store.db import _alembic_config, migrate
from store.models import Status
from tests.helpers.harness import Harness
from tests.helpers.store_states import drive
from tests.helpers.support import create_job, seed_tenant

KEY = "2026-11-weekly"  # the README's example: a key two platform teams may well both choose


def outbound(h: Harness) -> Path:
    return h.partner.root / "outbound"


async def neighbour(h: Harness) -> tuple[uuid.UUID, uuid.UUID]:
    """A second tenant whose destination is the harness partner's very directory."""
    dest = h.partner.destination()
    return await seed_tenant(h.db.admin, contacts=50, destination=dict(
        host=dest.host, port=dest.port, username=dest.username, final_dir=dest.final_dir, temp_dir=dest.temp_dir,
        host_key=dest.host_key, credential_ref=dest.credential_ref))


async def create(h: Harness, tenant_id: uuid.UUID, destination_id: uuid.UUID, key: str) -> uuid.UUID:
    job_id = uuid.uuid4()
    await h.exports.create(tenant_id=tenant_id, destination_id=destination_id, created_by="tests",
                           delivery_key=key, job_id=job_id)
    return job_id


def holds_its_own_bytes(h: Harness, row) -> bool:
    return hashlib.sha256((outbound(h) / row.final_name).read_bytes()).digest() == row.expected_file_sha256


@pytest.mark.spec("DV1")
async def test_two_tenants_one_directory_same_key__each_delivered_under_its_own_name(harness: Harness):
    h = harness
    other_tenant, other_destination = await neighbour(h)
    first = await h.settled(await create(h, h.tenant_id, h.destination_id, KEY))
    second = await h.settled(await create(h, other_tenant, other_destination, KEY))
    assert (first.status, second.status) == (Status.COMPLETED, Status.COMPLETED), (first, second)
    assert first.final_name != second.final_name
    assert str(first.tenant_id) in first.final_name and str(second.tenant_id) in second.final_name
    assert holds_its_own_bytes(h, first) and holds_its_own_bytes(h, second)


@pytest.mark.spec("DV1")
async def test_a_replacement_with_an_overwrite_agreement_never_reaches_another_tenants_file(harness: Harness):
    h = harness
    other_tenant, other_destination = await neighbour(h)
    first = await h.settled(await create(h, h.tenant_id, h.destination_id, KEY))
    assert first.status is Status.COMPLETED
    first_bytes = (outbound(h) / first.final_name).read_bytes()

    async def drop(old: str, new: str) -> None:  # the neighbour's upload lands, its answer is lost
        h.partner.close_connections()

    h.partner.hooks.after_rename = drop
    try:
        original = await h.settled(await create(h, other_tenant, other_destination, KEY))
    finally:
        h.partner.hooks.after_rename = None
    assert original.status is Status.OUTCOME_UNKNOWN, original
    await h.db.admin.execute("UPDATE destinations SET name_and_size_identify = true WHERE id = $1",
                             other_destination)
    replacement = await h.exports.replace(tenant_id=other_tenant, original_job_id=original.id, created_by="ops",
                                          reason="outcome unknown", overwrite_agreement_ref="partner ticket 4711")
    row = await h.settled(replacement)
    # It identified (or replaced) its own original, never the first tenant's file.
    assert row.final_name == original.final_name != first.final_name
    assert (outbound(h) / first.final_name).read_bytes() == first_bytes
    assert (await h.store.read_job(first.id)).status is Status.COMPLETED


@pytest.mark.spec("DV1")
async def test_the_partner_sweep_of_one_tenant_leaves_the_other_tenants_temporary_files(quiet_harness: Harness):
    h = quiet_harness
    other_tenant, other_destination = await neighbour(h)
    mine = await create_job(h.store, h.tenant_id, h.destination_id)
    theirs = await create_job(h.store, other_tenant, other_destination)
    names = {}
    old = time.time() - 10 * 86400 - 10 ** 6
    for job_id in (mine, theirs):
        attempt = await drive(h.store, job_id, Status.COMPLETED)
        names[job_id] = temp_file_name((await h.store.read_job(job_id)).final_name, attempt)
        path = h.partner.root / "incoming-tmp" / names[job_id]
        path.write_bytes(b"partial contact data")
        os.utime(path, (old, old))
    swept = await h.client.execute_workflow("PartnerSweepWorkflow", id=f"partner-sweep-{uuid.uuid4().hex[:8]}",
                                            task_queue=h.settings.task_queue, result_type=list[PartnerSweepOutput])
    # Each tenant's sweep removed its own file and left the other's, in whichever order they ran.
    reports = {s.destination_id: s for s in swept}
    assert reports[h.destination_id].removed == [names[mine]]
    assert reports[other_destination].removed == [names[theirs]]
    assert list((h.partner.root / "incoming-tmp").iterdir()) == []


@pytest.mark.spec("DV1")
async def test_the_migration_keeps_the_name_of_every_delivery_that_may_have_reached_the_partner(db, store):
    """Rows from before tenant names: a delivery that was ever claimed keeps the name its file may have at the
    partner (its replacements must find it); one never claimed moves to the name with the tenant in it."""
    engine = create_async_engine(db.url("owner"))
    try:
        async with engine.begin() as conn:
            await conn.run_sync(lambda sync: command.downgrade(_alembic_config(sync), "0006"))
    finally:
        await engine.dispose()
    tenant_id, destination_id = await seed_tenant(db.admin)
    keys = {}
    for _ in range(2):  # as revision 0006 created a job: the job, its deliveries row and its wake-up
        job_id, keys[job_id] = uuid.uuid4(), f"k{uuid.uuid4().hex[:12]}"
        await db.admin.execute(
            "WITH d AS (INSERT INTO deliveries (tenant_id, delivery_key, original_job_id) VALUES ($2, $3, $1)), "
            "j AS (INSERT INTO export_jobs (id, tenant_id, status, version, destination_id, delivery_key, "
            "created_by, woken_at) VALUES ($1, $2, 'Queued', 1, $4, $3, 'tests', clock_timestamp()) RETURNING id) "
            "INSERT INTO outbox (message_id, kind, job_id, created_at) "
            "SELECT gen_random_uuid(), 'ExportReady', id, clock_timestamp() FROM j",
            job_id, tenant_id, keys[job_id], destination_id)
    queued, claimed = keys
    await db.admin.execute("UPDATE export_jobs SET status = 'OutcomeUnknown', attempt_count = 1, "
                           "attempt_id = gen_random_uuid() WHERE id = $1", claimed)
    await migrate(db.url("owner"))
    names = {r["id"]: r["final_name"] for r in await db.admin.fetch("SELECT id, final_name FROM export_jobs")}
    assert names[claimed] == f"contacts-{keys[claimed]}.csv"
    assert names[queued] == f"contacts-{tenant_id}-{keys[queued]}.csv"
    replacement = uuid.uuid4()
    await store.create_replacement(tenant_id=tenant_id, original_job_id=claimed, job_id=replacement,
                             created_by="ops", replacement_reason="outcome unknown")
    assert (await store.read_job(replacement)).final_name == f"contacts-{keys[claimed]}.csv"


@pytest.mark.spec("DV1")
async def test_no_new_export_can_take_a_name_without_its_tenant(db):
    """The old name stays only on rows that were claimed before the migration (or replace one)."""
    import asyncpg

    tenant_id, destination_id = await seed_tenant(db.admin)
    with pytest.raises(asyncpg.CheckViolationError, match="ck_export_jobs_final_name"):
        await db.admin.execute(
            "INSERT INTO export_jobs (id, tenant_id, status, version, destination_id, delivery_key, final_name, "
            "created_by, woken_at) VALUES (gen_random_uuid(), $1, 'Queued', 1, $2, $3, $4, 'tests', now())",
            tenant_id, destination_id, KEY, f"contacts-{KEY}.csv")
