"""P2: from a committed stop request to the Stopped row, while 8 builds run on a real worker process, against the
same path in bare PostgreSQL in the same run: a listener woken by NOTIFY that reads the row and makes a
conditional write.

The project's latency is read from the database's own clock: the Stopped event's recorded_at minus the
cancellation request's recorded_at (both clock_timestamp(), within their statements), so no polling interval is
measured. The project's p99 has an absolute goal; the ratio (baseline over project) is only shown.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import asyncpg
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from bench.stack import full_stack
from bench.table import Row
from starter.client import ExportsClient
from store.db import asyncpg_dsn, make_engine
from store.jobs import JobStore
from store.models import CancellationOutcome

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
    async with full_stack("stop", contacts=300_000) as stack:
        # About 25 MB per build at 2 MB/s: 8 builds keep the worker and PostgreSQL busy for a dozen seconds each,
        # so every stop lands in a running build.
        settings = stack.settings(task_queue="bench-stop", build_throttle_bytes_per_second=2_000_000)
        await stack.spawn("worker", settings=settings)
        baseline = await _baseline(asyncpg_dsn(stack.postgres.url("app")), max(samples, 50))
        client = await Client.connect(stack.temporal.address, data_converter=pydantic_data_converter)
        engine = make_engine(stack.postgres.url("app"))
        exports = ExportsClient(JobStore(engine, lease_seconds=settings.lease_seconds), client,
                                task_queue=settings.task_queue)
        admin, tenant, destination = stack.admin, stack.tenant, stack.destination
        try:
            jobs = [await exports.create(tenant_id=tenant, destination_id=destination, created_by="bench")
                    for _ in range(BUILDS)]
            stopped: list[uuid.UUID] = []
            deadline = time.monotonic() + 60 + samples * 10
            while len(stopped) < samples:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"only {len(stopped)} of {samples} stops within the bound")
                building = [j for j in await _building(admin, jobs) if j not in stopped]
                if len(building) < BUILDS:
                    await asyncio.sleep(0.2)
                    continue
                answer = await exports.cancel(tenant_id=tenant, job_id=building[0], requested_by="bench",
                                              reason="P2")
                if answer.outcome is not CancellationOutcome.STOP_REQUESTED:
                    raise RuntimeError(f"stop of {building[0]} answered {answer.outcome}")
                stopped.append(building[0])
                jobs.append(await exports.create(tenant_id=tenant, destination_id=destination, created_by="bench"))
            for _ in range(300):  # each stop ends within a second or two; bounded at a minute
                if not await admin.fetchval("SELECT count(*) FROM export_jobs WHERE id = ANY($1::uuid[]) "
                                            "AND status <> 'Stopped'", stopped):
                    break
                await asyncio.sleep(0.2)
            latencies = await admin.fetch("""
                SELECT extract(epoch FROM e.recorded_at - r.recorded_at) * 1000 AS ms
                FROM cancellation_requests r
                JOIN export_attempt_events e ON e.job_id = r.job_id AND e.kind IN ('Stopped', 'StoppedByRecovery')
                WHERE r.job_id = ANY($1::uuid[])""", stopped)
        finally:
            await engine.dispose()
    if len(latencies) != samples:
        raise RuntimeError(f"{samples} stops requested, {len(latencies)} Stopped events")
    return Row("P2", f"stop request -> Stopped row, p99 of {samples}, {BUILDS} builds running", "ms",
               _p99([float(r["ms"]) for r in latencies]), baseline, "NOTIFY, read, conditional write (p99)",
               "<= 100 ms", higher_is_better=False, goal_on="project")
