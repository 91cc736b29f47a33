"""P1: exports per second, 200 small exports started at once through Temporal and a real worker process, against
no-op workflows with as many activities per run as an export took, on the same dev server in the same run.

An export's activity count is read from one export's workflow history, so the baseline follows the project as
its steps change; it is reported beside the ratio (the goal is at most 4).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import asyncpg
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from bench.stack import full_stack
from bench.table import Row, middle
from starter.client import ExportsClient
from store.db import make_engine
from store.jobs import JobStore


async def _activities_of(client: Client, workflow_id: str) -> int:
    history = await client.get_workflow_handle(workflow_id).fetch_history()
    return sum(e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED for e in history.events)


async def _project(exports: ExportsClient, admin: asyncpg.Connection, tenant: uuid.UUID, destination: uuid.UUID,
                   count: int) -> tuple[float, uuid.UUID]:
    started = time.perf_counter()
    jobs = await asyncio.gather(*(exports.create(tenant_id=tenant, destination_id=destination, created_by="bench")
                                  for _ in range(count)))
    deadline = time.monotonic() + 600
    while True:
        done = await admin.fetchval("SELECT count(*) FROM export_jobs WHERE id = ANY($1::uuid[]) "
                                    "AND status = 'Completed'", jobs)
        if done == count:
            return count / (time.perf_counter() - started), jobs[0]
        unsettled = await admin.fetchval("SELECT count(*) FROM export_jobs WHERE id = ANY($1::uuid[]) AND status "
                                         "NOT IN ('Queued', 'Running', 'Delivering', 'Completed')", jobs)
        if unsettled or time.monotonic() > deadline:
            raise RuntimeError(f"{done} of {count} exports Completed; {unsettled} ended otherwise")
        await asyncio.sleep(0.1)


async def _baseline(client: Client, task_queue: str, count: int, activities: int) -> float:
    started = time.perf_counter()
    handles = await asyncio.gather(*(client.start_workflow("NoopWorkflow", activities, id=f"noop-{uuid.uuid4()}",
                                                           task_queue=task_queue) for _ in range(count)))
    await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 600)
    return count / (time.perf_counter() - started)


async def measure(*, exports: int, rounds: int) -> Row:
    async with full_stack("throughput", contacts=100) as stack:
        settings = stack.settings(task_queue="bench-exports")
        await stack.spawn("worker", settings=settings)
        await stack.spawn("bench.noop_worker", stack.temporal.address, "bench-noop")
        client = await Client.connect(stack.temporal.address, data_converter=pydantic_data_converter)
        engine = make_engine(stack.postgres.url("app"))
        client_of_exports = ExportsClient(JobStore(engine, lease_seconds=settings.lease_seconds), client,
                                          task_queue=settings.task_queue)
        ours, theirs, per_export = [], [], 0
        try:
            for _ in range(rounds):
                rate, sample = await _project(client_of_exports, stack.admin, stack.tenant, stack.destination,
                                              exports)
                ours.append(rate)
                per_export = await _activities_of(client, f"export-{sample}")
                theirs.append(await _baseline(client, "bench-noop", exports, per_export))
        finally:
            await engine.dispose()
    row = Row("P1", f"exports/s, {exports} small exports at once through Temporal", "/s", middle(ours),
              middle(theirs), f"no-op workflows of {per_export} activities", ">= 0.9")
    row.notes.append(f"{per_export} activities per export (goal: at most 4)")
    return row
