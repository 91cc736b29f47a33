"""Terms edits against real PostgreSQL: explicit version increment, database clock, a new wake-up."""

from __future__ import annotations

import re
import uuid

import pytest

from starter.localstack.seed import seed_destination
from store import errors
from store.models import ClaimResult, Status
from store.statements import SQL_DIR
from tests.helpers.support import create_job, seed_tenant

TERMS_COLUMNS = ("destination_id",)


@pytest.fixture
async def job(db, store):
    tenant_id, destination_id = await seed_tenant(db.admin)
    job_id = await create_job(store, tenant_id, destination_id)
    new_destination = await seed_destination(
        db.admin, tenant_id, name="second partner", host="127.0.0.1", port=2222, username="u", final_dir="/o",
        temp_dir="/t", host_key="ssh-ed25519 AAAA-placeholder", credential_ref="file:/none")
    return tenant_id, job_id, new_destination


@pytest.mark.spec("MC2")
async def test_edit__version_incremented_woken_at_from_database_clock_new_outbox_row(db, store, job):
    tenant_id, job_id, new_destination = job
    before = await db.admin.fetchval("SELECT clock_timestamp()")
    assert await store.edit_terms(tenant_id=tenant_id, job_id=job_id, expected_version=1,
                                  destination_id=new_destination)
    after = await db.admin.fetchval("SELECT clock_timestamp()")
    row = await store.read_job(job_id)
    assert (row.version, row.destination_id, row.status) == (2, new_destination, Status.QUEUED)
    assert before <= row.woken_at <= after
    assert await db.admin.fetchval("SELECT count(*) FROM outbox WHERE job_id = $1", job_id) == 2
    # The statement takes no clock value from the client: woken_at is not among its parameters.
    text = (SQL_DIR / "edit_terms.sql").read_text()
    assert "woken_at = clock_timestamp()" in text and ":woken_at" not in text


@pytest.mark.spec("MC2")
def test_sql_files__every_write_to_a_terms_column_increments_version():
    terms_writers = []
    for path in SQL_DIR.glob("*.sql"):
        text = re.sub(r"--[^\n]*", "", path.read_text())
        for update in re.findall(r"UPDATE\s+export_jobs\b.*?\bSET\b(.*?)\bWHERE\b", text, flags=re.S | re.I):
            if any(re.search(rf"\b{column}\s*=", update) for column in TERMS_COLUMNS):
                terms_writers.append(path.name)
                assert re.search(r"\bversion\s*=\s*version\s*\+\s*1\b", update), path.name
    assert "edit_terms.sql" in terms_writers  # the scan sees the statements it is meant to check


async def test_edit__a_worker_holding_the_old_version_fails_its_claim(db, store, job):
    tenant_id, job_id, new_destination = job
    assert await store.edit_terms(tenant_id=tenant_id, job_id=job_id, expected_version=1,
                                  destination_id=new_destination)
    assert await store.claim(job_id, 1, uuid.uuid4(), "worker-old-terms") is ClaimResult.LOST
    assert await db.admin.fetchval("SELECT count(*) FROM export_attempt_events WHERE job_id = $1", job_id) == 0
    assert await store.claim(job_id, 2, uuid.uuid4(), "worker-new-terms") is ClaimResult.CLAIMED


async def test_edit__stale_version_started_or_foreign_job_changes_nothing(db, store, job):
    tenant_id, job_id, new_destination = job
    other_tenant, _ = await seed_tenant(db.admin)
    assert not await store.edit_terms(tenant_id=tenant_id, job_id=job_id, expected_version=7,
                                      destination_id=new_destination)
    assert not await store.edit_terms(tenant_id=other_tenant, job_id=job_id, expected_version=1,
                                      destination_id=new_destination)
    with pytest.raises(errors.UnknownDestination):
        await store.edit_terms(tenant_id=tenant_id, job_id=job_id, expected_version=1,
                               destination_id=uuid.uuid4())
    row = await store.read_job(job_id)
    assert (row.version, row.destination_id == new_destination) == (1, False)
    assert await db.admin.fetchval("SELECT count(*) FROM outbox WHERE job_id = $1", job_id) == 1
