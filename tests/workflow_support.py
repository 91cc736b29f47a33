"""A worker, a partner and a seeded tenant for one test, on a task queue of its own."""

from __future__ import annotations

import asyncio
import uuid
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

from temporalio.client import Client

from activities.contracts import ExportResult
from starter.client import ExportsClient
from starter.localstack.partner import LocalPartner
from store.jobs import JobStore
from store.models import JobRow
from store.settings import Settings
from tests.support import eventually, seed_tenant
from worker import running_worker

SETTLE_TIMEOUT = 60.0


@dataclass
class Harness:
    db: object
    store: JobStore
    client: Client
    partner: LocalPartner
    settings: Settings
    tenant_id: uuid.UUID
    destination_id: uuid.UUID
    exports: ExportsClient

    async def store_create(self) -> uuid.UUID:
        """Creation as the starter does it: the row and its outbox row; the dispatcher does the rest."""
        return await self.exports.create(tenant_id=self.tenant_id, destination_id=self.destination_id,
                                         created_by="tests")

    async def create(self) -> uuid.UUID:
        return await self.store_create()

    async def settled(self, job_id: uuid.UUID) -> JobRow:
        """The row once settled, after the workflow has returned it."""
        row = await eventually(lambda: self.store.read_job(job_id), lambda r: r is not None and r.status.is_settled,
                               timeout=SETTLE_TIMEOUT, interval=0.1, what=f"export {job_id} settled")
        handle = self.client.get_workflow_handle(f"export-{job_id}", result_type=ExportResult)
        result = await asyncio.wait_for(handle.result(), timeout=SETTLE_TIMEOUT)
        assert result.status is row.status, (result, row.status)
        return await self.store.read_job(job_id)


async def open_harness(stack: AsyncExitStack, db, store: JobStore, client: Client, tmp_path: Path, *,
                       dispatcher: bool = True, contacts: int = 200, **overrides: object) -> Harness:
    partner = LocalPartner(tmp_path / "partner")
    await partner.start()
    stack.push_async_callback(partner.stop)
    dest = partner.destination()
    tenant_id, destination_id = await seed_tenant(db.admin, contacts=contacts, destination=dict(
        host=dest.host, port=dest.port, username=dest.username, final_dir=dest.final_dir, temp_dir=dest.temp_dir,
        host_key=dest.host_key, credential_ref=dest.credential_ref))
    settings = db.settings(task_queue=f"exports-{uuid.uuid4().hex[:10]}", work_dir=tmp_path / "work", **overrides)
    await stack.enter_async_context(running_worker(settings, client, with_dispatcher=dispatcher))
    exports = ExportsClient(store, client, task_queue=settings.task_queue)
    return Harness(db=db, store=store, client=client, partner=partner, settings=settings, tenant_id=tenant_id,
                   destination_id=destination_id, exports=exports)
