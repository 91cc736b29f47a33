"""P2: from a committed stop request to the Stopped row, while 8 builds run on a real worker process, against the
same path in bare PostgreSQL in the same run: a listener woken by NOTIFY that reads the row and makes a
conditional write.

The project's latency is read from the database's own clock: the Stopped event's recorded_at minus the
cancellation request's recorded_at (both clock_timestamp(), within their statements), so no polling interval is
measured. The project's p99 has an absolute goal; the ratio (baseline over project) is only shown.
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
from store.models import CancellationOutcome
from store.settings import Settings, as_env

BUILDS = 8


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


async def _baseline(dsn: str, samples: int) -> float:
    """NOTIFY committed by one connection; another, listening, reads the row and writes it conditionally."""
    writer, listener = await asyncpg.connect(dsn), await asyncpg.connect(dsn)
    await writer.execute("CREATE TEMP TABLE IF NOT EXISTS bench_stop (id int PRIMARY KEY, stopped boolean)")
    await listener.execute("CREATE TEMP TABLE IF NOT EXISTS bench_stop (id int PRIMARY KEY, stopped boolean)")
    await listener.execute("INSERT INTO bench_stop SELECT g, false FROM generate_series(1, $1) g", samples)
    done: asyncio.Queue[float] = asyncio.Queue()

    def on_notify(connection, pid, channel, payload) -> None:
        async def handle() -> None:
            row = await listener.fetchrow("SELECT id, stopped FROM bench_stop WHERE id = $1", int(payload))
            await listener.execute("UPDATE bench_stop SET stopped = true WHERE id = $1 AND NOT stopped", row["id"])
            done.put_nowait(time.perf_counter())
        asyncio.get_running_loop().create_task(handle())

    await listener.add_listener("bench_stop", on_notify)
    latencies = []
    try:
        for n in range(1, samples + 1):
            started = time.perf_counter()
            await writer.execute(f"SELECT pg_notify('bench_stop', '{n}')")
            latencies.append(await asyncio.wait_for(done.get(), 10) - started)
    finally:
        await writer.close()
        await listener.close()
    return _p99(latencies) * 1000


async def _building(admin: asyncpg.Connection, job_ids: list[uuid.UUID]) -> list[uuid.UUID]:
    rows = await admin.fetch("SELECT j.id FROM export_jobs j WHERE j.id = ANY($1::uuid[]) AND j.status = 'Running' "
                             "AND EXISTS (SELECT 1 FROM export_attempt_events e WHERE e.job_id = j.id "
                             "AND e.attempt_id = j.attempt_id AND e.kind = 'BuildStarted')", job_ids)
    return [r["id"] for r in rows]


async def measure(*, samples: int) -> Row:
    folder = Path(tempfile.mkdtemp(prefix="exports-bench-stop-"))
    postgres = LocalPostgres(folder / "data")
    postgres.start()
    temporal = LocalTemporal(folder / "temporal", ui_port=free_port())
    partner = LocalPartner(folder / "partner")
    worker = None
    try:
        await migrate(postgres.url("owner"))
        await temporal.start()
        await partner.start()
        admin = await asyncpg.connect(asyncpg_dsn(postgres.url("owner")))
        tenant = uuid.uuid4()
        await seed_contacts(admin, tenant, 300_000)
        d = partner.destination()
        destination = await seed_destination(admin, tenant, name="bench", host=d.host, port=d.port,
                                             username=d.username, final_dir=d.final_dir, temp_dir=d.temp_dir,
                                             host_key=d.host_key, credential_ref=d.credential_ref)
        settings = Settings(**{k: v for k, v in postgres.urls("postgres").items()},
                            temporal_address=temporal.address, task_queue="bench-stop", work_dir=folder / "work",
                            # About 25 MB per build at 2 MB/s: 8 builds keep the worker and PostgreSQL busy for a
                            # dozen seconds each, so every stop lands in a running build.
                            build_throttle_bytes_per_second=2_000_000)
        env = {k: v for k, v in os.environ.items() if not k.startswith("EXPORTS_")}
        worker = await processes.spawn(sys.executable, "-m", "worker", log_path=folder / "worker.log",
                                       env={**env, **as_env(settings)},
                                       cwd=str(Path(__file__).resolve().parents[1]))
        baseline = await _baseline(asyncpg_dsn(postgres.url("app")), max(samples, 50))
        client = await Client.connect(temporal.address, data_converter=pydantic_data_converter)
        engine = make_engine(postgres.url("app"))
        exports = ExportsClient(JobStore(engine, lease_seconds=settings.lease_seconds), client,
                                task_queue=settings.task_queue)
        jobs = [await exports.create(tenant_id=tenant, destination_id=destination, created_by="bench")
                for _ in range(BUILDS)]
        stopped = []
        deadline = time.monotonic() + 60 + samples * 10
        while len(stopped) < samples:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(stopped)} of {samples} stops within the bound; see {folder}")
            building = [j for j in await _building(admin, jobs) if j not in stopped]
            if len(building) < BUILDS:
                await asyncio.sleep(0.2)
                continue
            victim = building[0]
            answer = await exports.cancel(tenant_id=tenant, job_id=victim, requested_by="bench", reason="P2")
            if answer.outcome is not CancellationOutcome.STOP_REQUESTED:
                raise RuntimeError(f"stop of {victim} answered {answer.outcome}")
            stopped.append(victim)
            jobs.append(await exports.create(tenant_id=tenant, destination_id=destination, created_by="bench"))
        for _ in range(300):  # each stop ends within a second or two; bounded at a minute
            left = await admin.fetchval("SELECT count(*) FROM export_jobs WHERE id = ANY($1::uuid[]) "
                                        "AND status <> 'Stopped'", stopped)
            if not left:
                break
            await asyncio.sleep(0.2)
        latencies = await admin.fetch("""
            SELECT extract(epoch FROM e.recorded_at - r.recorded_at) * 1000 AS ms
            FROM cancellation_requests r
            JOIN export_attempt_events e ON e.job_id = r.job_id AND e.kind IN ('Stopped', 'StoppedByRecovery')
            WHERE r.job_id = ANY($1::uuid[])""", stopped)
        await engine.dispose()
        await admin.close()
        if len(latencies) != samples:
            raise RuntimeError(f"{samples} stops requested, {len(latencies)} Stopped events")
        project = _p99([float(r["ms"]) for r in latencies])
    finally:
        await processes.stop(worker)
        await partner.stop()
        await temporal.stop()
        postgres.stop()
        shutil.rmtree(folder, ignore_errors=True)
    return Row("P2", f"stop request -> Stopped row, p99 of {samples}, {BUILDS} builds running", "ms", project,
               baseline, "NOTIFY, read, conditional write (p99)", "<= 100 ms", higher_is_better=False,
               goal_on="project")
