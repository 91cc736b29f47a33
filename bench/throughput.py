"""P1: exports per second, 200 small exports started at once through Temporal and a real worker process, against
no-op workflows with as many activities per run as an export took, on the same dev server in the same run.

An export's activity count is read from one export's workflow history, so the baseline follows the project as
its steps change; it is reported beside the ratio (the goal is at most 4).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import asyncpg
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from bench.table import Row
from starter.client import ExportsClient
from starter.localstack import processes
from starter.localstack.partner import LocalPartner
from starter.localstack.ports import free_port
from starter.localstack.postgres import LocalPostgres
from starter.localstack.seed import seed_contacts, seed_destination
from starter.localstack.temporal import LocalTemporal
from store.db import asyncpg_dsn, make_engine, migrate
from store.jobs import JobStore
from store.settings import Settings, as_env

ROOT = Path(__file__).resolve().parents[1]


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
    folder = Path(tempfile.mkdtemp(prefix="exports-bench-throughput-"))
    postgres = LocalPostgres(folder / "data")
    postgres.start()
    temporal = LocalTemporal(folder / "temporal", ui_port=free_port())
    partner = LocalPartner(folder / "partner")
    workers: list = []
    try:
        await migrate(postgres.url("owner"))
        await temporal.start()
        await partner.start()
        admin = await asyncpg.connect(asyncpg_dsn(postgres.url("owner")))
        tenant = uuid.uuid4()
        await seed_contacts(admin, tenant, 100)
        d = partner.destination()
        destination = await seed_destination(admin, tenant, name="bench", host=d.host, port=d.port,
                                             username=d.username, final_dir=d.final_dir, temp_dir=d.temp_dir,
                                             host_key=d.host_key, credential_ref=d.credential_ref)
        settings = Settings(**postgres.urls("postgres"), temporal_address=temporal.address,
                            task_queue="bench-exports", work_dir=folder / "work")
        env = {k: v for k, v in os.environ.items() if not k.startswith("EXPORTS_")}
        workers.append(await processes.spawn(sys.executable, "-m", "worker", log_path=folder / "worker.log",
                                             env={**env, **as_env(settings)}, cwd=str(ROOT)))
        workers.append(await processes.spawn(sys.executable, "-m", "bench.noop_worker", temporal.address,
                                             "bench-noop", log_path=folder / "noop.log", env=env, cwd=str(ROOT)))
        client = await Client.connect(temporal.address, data_converter=pydantic_data_converter)
        engine = make_engine(postgres.url("app"))
        client_of_exports = ExportsClient(JobStore(engine, lease_seconds=settings.lease_seconds), client,
                                          task_queue=settings.task_queue)
        ours, theirs, per_export = [], [], 0
        for _ in range(rounds):
            rate, sample = await _project(client_of_exports, admin, tenant, destination, exports)
            ours.append(rate)
            per_export = await _activities_of(client, f"export-{sample}")
            theirs.append(await _baseline(client, "bench-noop", exports, per_export))
        await engine.dispose()
        await admin.close()
    finally:
        for process in workers:
            await processes.stop(process)
        await partner.stop()
        await temporal.stop()
        postgres.stop()
        shutil.rmtree(folder, ignore_errors=True)
    row = Row("P1", f"exports/s, {exports} small exports at once through Temporal", "/s", sorted(ours)[rounds // 2],
              sorted(theirs)[rounds // 2], f"no-op workflows of {per_export} activities", ">= 0.9")
    row.notes.append(f"{per_export} activities per export (goal: at most 4)")
    return row
