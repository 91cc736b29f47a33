"""Claims per second through the store, as a ratio against a baseline measured in the same run.

The baseline is a primary-key read of the same rows through the same engine and pool: the ratio says what the
claim's conditional update, its event insert and its commit cost beyond a round trip.

    .venv/bin/python bench/claim_throughput.py [--jobs 2000] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from pathlib import Path

import asyncpg
from sqlalchemy import text

from starter.localstack.postgres import LocalPostgres
from starter.localstack.seed import seed_destination
from store.db import asyncpg_dsn, make_engine, migrate
from store.jobs import JobStore


async def timed(label: str, work, concurrency: int) -> float:
    queue = list(work)
    started = time.perf_counter()

    async def drain() -> None:
        while queue:
            await queue.pop()()

    await asyncio.gather(*(drain() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    print(f"{label:<28} {len(work) / elapsed:10.0f} /s")
    return elapsed


async def main(jobs: int, concurrency: int) -> None:
    postgres = LocalPostgres(Path(tempfile.mkdtemp(prefix="exports-bench-")) / "data")
    postgres.start()
    try:
        await migrate(postgres.url("owner"))
        admin = await asyncpg.connect(asyncpg_dsn(postgres.url("owner")))
        tenant = uuid.uuid4()
        destination = await seed_destination(admin, tenant, name="bench", host="127.0.0.1", port=22, username="u",
                                             final_dir="/f", temp_dir="/t", host_key="k", credential_ref="file:x")
        await admin.close()
        engine = make_engine(postgres.url("app"), pool_size=concurrency)
        store = JobStore(engine, lease_seconds=60)
        ids = [uuid.uuid4() for _ in range(jobs)]
        for job_id in ids:
            await store.create_job(job_id=job_id, tenant_id=tenant, destination_id=destination,
                                   delivery_key=job_id.hex, created_by="bench")

        async def read(job_id: uuid.UUID) -> None:
            async with engine.connect() as conn:
                await conn.execute(text("SELECT status FROM export_jobs WHERE id = :id"), {"id": job_id})

        baseline = await timed("baseline: primary-key read", [lambda j=j: read(j) for j in ids], concurrency)
        claims = await timed("claim (cutoff 1)", [lambda j=j: store.claim(j, 1, uuid.uuid4(), "bench") for j in ids],
                             concurrency)
        print(f"claim costs {claims / baseline:.2f}x the baseline read ({jobs} jobs, {concurrency} clients)")
        await engine.dispose()
    finally:
        postgres.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    asyncio.run(main(args.jobs, args.concurrency))
