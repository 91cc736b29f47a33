"""Creation and the database's permissions, against real PostgreSQL."""

from __future__ import annotations

import uuid

import asyncpg
import pytest

from store import errors
from store.db import make_engine
from store.outbox import Outbox
from tests.helpers.support import create_job, seed_tenant


async def counts(admin: asyncpg.Connection, job_id: uuid.UUID) -> tuple[int, int, int]:
    return (
        await admin.fetchval("SELECT count(*) FROM export_jobs WHERE id = $1", job_id),
        await admin.fetchval("SELECT count(*) FROM deliveries WHERE original_job_id = $1", job_id),
        await admin.fetchval("SELECT count(*) FROM outbox WHERE job_id = $1", job_id),
    )


@pytest.mark.spec("CN1")
async def test_creation__job_delivery_and_outbox_commit_together(db, store):
    tenant_id, destination_id = await seed_tenant(db.admin)
    job_id = await create_job(store, tenant_id, destination_id)
    assert await counts(db.admin, job_id) == (1, 1, 1)
    row = await store.read_job(job_id)
    assert (row.status, row.version, row.attempt_count) == ("Queued", 1, 0)


@pytest.mark.spec("CN1")
async def test_creation__refused_creation_leaves_nothing(db, store):
    tenant_id, destination_id = await seed_tenant(db.admin)
    unknown_destination, job_id = uuid.uuid4(), uuid.uuid4()
    with pytest.raises(errors.UnknownDestination):
        await store.create_job(job_id=job_id, tenant_id=tenant_id, destination_id=unknown_destination,
                               delivery_key="k-unknown-dest", created_by="tests")
    assert await counts(db.admin, job_id) == (0, 0, 0)
    # Another tenant's destination is just as unknown.
    other_tenant, _ = await seed_tenant(db.admin)
    with pytest.raises(errors.UnknownDestination):
        await store.create_job(job_id=job_id, tenant_id=other_tenant, destination_id=destination_id,
                               delivery_key="k-foreign-dest", created_by="tests")
    assert await counts(db.admin, job_id) == (0, 0, 0)


@pytest.mark.spec("CN2")
async def test_creation__second_original_with_same_key_refused(db, store):
    tenant_id, destination_id = await seed_tenant(db.admin)
    first, second = uuid.uuid4(), uuid.uuid4()
    await store.create_job(job_id=first, tenant_id=tenant_id, destination_id=destination_id,
                           delivery_key="same-key", created_by="tests")
    with pytest.raises(errors.DeliveryKeyTaken):
        await store.create_job(job_id=second, tenant_id=tenant_id, destination_id=destination_id,
                               delivery_key="same-key", created_by="tests")
    assert await counts(db.admin, second) == (0, 0, 0)
    # The same key in another tenant is another delivery.
    other_tenant, other_destination = await seed_tenant(db.admin)
    await store.create_job(job_id=second, tenant_id=other_tenant, destination_id=other_destination,
                           delivery_key="same-key", created_by="tests")
    assert await counts(db.admin, second) == (1, 1, 1)


@pytest.mark.spec("CN2")
async def test_creation__direct_insert_of_second_original_refused(db, store):
    tenant_id, destination_id = await seed_tenant(db.admin)
    await store.create_job(job_id=uuid.uuid4(), tenant_id=tenant_id, destination_id=destination_id,
                           delivery_key="direct-key", created_by="tests")
    with pytest.raises(asyncpg.UniqueViolationError) as refused:
        await db.admin.execute(
            """INSERT INTO export_jobs (id, tenant_id, status, version, destination_id, delivery_key, final_name,
                                        created_by, woken_at)
               VALUES ($1, $2, 'Queued', 1, $3, 'direct-key', 'contacts-' || CAST($2 AS uuid) || '-direct-key.csv',
                       'intruder', clock_timestamp())""",
            uuid.uuid4(), tenant_id, destination_id,
        )
    assert refused.value.constraint_name == "uq_export_jobs_original_key"


@pytest.mark.spec("PE1")
@pytest.mark.parametrize("table", ["export_attempt_events", "cancellation_requests", "deliveries"])
async def test_permissions__app_role_cannot_update_or_delete_history(db, store, table):
    tenant_id, destination_id = await seed_tenant(db.admin)
    await create_job(store, tenant_id, destination_id)
    app = await db.connect("app")
    try:
        assert await app.fetchval("SELECT current_user") == "exports_app"
        for sql in (f"UPDATE {table} SET tenant_id = tenant_id" if table != "export_attempt_events"
                    else f"UPDATE {table} SET detail = 'x'", f"DELETE FROM {table}"):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await app.execute(sql)
        # Nor may it delete jobs or touch the outbox beyond inserting.
        for sql in ("DELETE FROM export_jobs", "UPDATE outbox SET published_at = now()", "DELETE FROM outbox"):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await app.execute(sql)
    finally:
        await app.close()


@pytest.mark.spec("PE2")
async def test_permissions__dispatcher_changes_only_published_at(db, store):
    tenant_id, destination_id = await seed_tenant(db.admin)
    job_id = await create_job(store, tenant_id, destination_id)
    dispatcher = await db.connect("dispatcher")
    try:
        assert await dispatcher.execute("UPDATE outbox SET published_at = clock_timestamp() WHERE job_id = $1",
                                        job_id) == "UPDATE 1"
        for sql in ("UPDATE outbox SET kind = 'Other'", "UPDATE outbox SET job_id = gen_random_uuid()",
                    "UPDATE outbox SET created_at = now()", "DELETE FROM outbox",
                    "INSERT INTO outbox VALUES (gen_random_uuid(), 'ExportReady', gen_random_uuid(), now(), null)",
                    "SELECT * FROM export_jobs", "SELECT status FROM export_jobs", "SELECT id FROM contacts",
                    "UPDATE export_jobs SET status = 'Canceled'"):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await dispatcher.execute(sql)
        # It reads an export's tenant, and nothing else of the row, to key the run it starts (migration 0012).
        assert await dispatcher.fetchval("SELECT tenant_id FROM export_jobs WHERE id = $1", job_id) == tenant_id
    finally:
        await dispatcher.close()
    assert await db.admin.fetchval("SELECT count(*) FROM outbox WHERE job_id = $1", job_id) == 1


@pytest.mark.spec("LD5")
async def test_the_dispatchers_batch_takes_tenants_in_turn_each_oldest_first(db, store):
    """A tenant's burst of wake-ups does not stand in front of another tenant's one: the dispatcher's batch (as
    its own role) takes each tenant's oldest first, in turns, and names each export's tenant (its run's fairness
    key)."""
    burst_tenant, burst_destination = await seed_tenant(db.admin)
    other_tenant, other_destination = await seed_tenant(db.admin)
    burst = [await create_job(store, burst_tenant, burst_destination) for _ in range(5)]
    single = await create_job(store, other_tenant, other_destination)
    engine = make_engine(db.url("dispatcher"))
    try:
        async with Outbox(engine).dispatch_pass() as outbox:
            assert outbox is not None
            batch = await outbox.pending(3)
    finally:
        await engine.dispose()
    assert [(row.job_id, row.tenant_id) for row in batch] == [
        (burst[0], burst_tenant), (single, other_tenant), (burst[1], burst_tenant)]
