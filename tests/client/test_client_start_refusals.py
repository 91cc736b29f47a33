"""The client package's start with another tenant's export ID (found by review)."""

from __future__ import annotations

import uuid

import pytest
from exports_client.client import ExportsWorkflowClient

from tests.helpers.harness import Harness, building
from tests.helpers.support import seed_tenant


@pytest.mark.spec("HI3")
async def test_start_with_another_tenants_open_export_id_is_refused_not_reported_started(
        slow_build_harness: Harness):
    """Tenant B starts an export with the job ID of tenant A's export whose run is open. USE_EXISTING keeps A's
    run and `start` returns the ID as if B's export had been started: no error, and B's `result()` then waits on
    (and returns) A's export. Another tenant's export must be refused in one clear error."""
    h = slow_build_harness
    job_id = await h.create()
    await building(h, job_id)
    other_tenant, other_destination = await seed_tenant(h.db.admin)
    workflows = ExportsWorkflowClient(h.client, task_queue=h.settings.task_queue)
    before = await h.db.admin.fetchval("SELECT count(*) FROM export_jobs")

    with pytest.raises(Exception) as refused:  # noqa: PT011 - any clear refusal
        await workflows.start(tenant_id=other_tenant, destination_id=other_destination, created_by="team-b",
                              job_id=job_id)
    assert "\n" not in str(refused.value)
    assert await h.db.admin.fetchval("SELECT count(*) FROM export_jobs") == before
    assert (await h.store.read_job(job_id)).tenant_id == h.tenant_id
    uuid.UUID(str(job_id))
