"""The store's combined read, against real PostgreSQL: what one round trip answers is what the two reads it
replaces answer."""

from __future__ import annotations

import uuid

from tests.helpers.support import create_job, seed_tenant


async def test_a_row_and_its_destination_read_together_are_what_each_read_answers(db, store, tenant):
    tenant_id, destination_id = tenant
    job_id = await create_job(store, tenant_id, destination_id)
    # Another tenant's export to its own destination of the same name: nothing of it may show.
    other_tenant, other_destination = await seed_tenant(db.admin)
    await create_job(store, other_tenant, other_destination)
    await db.admin.execute("UPDATE destinations SET enabled = false, max_sessions = 3 WHERE id = $1", destination_id)

    job, destination = await store.read_job_and_destination(job_id)

    assert job == await store.read_job(job_id)
    assert destination == await store.read_destination(tenant_id, destination_id)
    assert destination is not None and (destination["enabled"], destination["max_sessions"]) == (False, 3)
    assert await store.read_job_and_destination(uuid.uuid4()) == (None, None)
