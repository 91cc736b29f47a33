"""P3: claims per second through `store/` (JobStore.claim, 16 concurrent), against pgbench running the same
`store/sql/claim.sql` with 16 clients on the same server in the same run.

pgbench has no per-client loop counter, so its clients claim random jobs from a pool ten times larger than the
claims they make; the few that hit a job already claimed update nothing, which flatters the baseline slightly.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from pathlib import Path

import asyncpg

from bench.stack import postgres_only
from bench.table import Row, middle
from starter.localstack.postgres import ROLES, LocalPostgres
from starter.localstack.seed import seed_destination
from store.db import asyncpg_dsn, make_engine
from store.jobs import JobStore
from store.statements import SQL_DIR

CLIENTS = 16


def job_id(n: int) -> uuid.UUID:
    return uuid.UUID(f"00000000-0000-4000-8000-{n:012x}")


async def _seed_jobs(admin: asyncpg.Connection, tenant: uuid.UUID, destination: uuid.UUID, first: int,
                     count: int) -> None:
    """Queued jobs numbered first.., written by the owner in one statement (creation's rules are not measured)."""
    await admin.execute("""
        WITH numbered AS (
            SELECT n, CAST('00000000-0000-4000-8000-' || lpad(to_hex(n), 12, '0') AS uuid) AS id, 'k' || n AS key
            FROM generate_series($3::bigint, $3::bigint + $4 - 1) AS n),
        delivery AS (
            INSERT INTO deliveries (tenant_id, delivery_key, original_job_id) SELECT $1::uuid, key, id FROM numbered)
        INSERT INTO export_jobs (id, tenant_id, status, version, destination_id, delivery_key, final_name,
                                 created_by, woken_at)
        SELECT id, $1::uuid, 'Queued', 1, $2, key, 'contacts-' || $1::uuid::text || '-' || key || '.csv', 'bench',
               clock_timestamp()
        FROM numbered""", tenant, destination, first, count)


def _pgbench_script(pool_first: int, pool_size: int) -> str:
    """claim.sql as it is, with its parameters given as pgbench expressions."""
    sql = (SQL_DIR / "claim.sql").read_text()
    sql = "\n".join(line for line in sql.splitlines() if not line.startswith("--"))
    values = {
        "job_id": "CAST('00000000-0000-4000-8000-' || lpad(to_hex(:n), 12, '0') AS uuid)",
        "checked_version": "1", "attempt_id": "gen_random_uuid()", "worker_id": "'pgbench'", "lease_seconds": "60",
    }
    sql = re.sub(r"(?<!:):(\w+)", lambda m: values[m.group(1)], sql)
    # pgbench reads one statement per line unless it ends with a semicolon: join the statement's lines.
    return f"\\set n random({pool_first}, {pool_first + pool_size - 1})\n" + " ".join(sql.split()) + "\n"


async def _pgbench(postgres: LocalPostgres, database: str, script: Path, transactions: int) -> float:
    process = await asyncio.create_subprocess_exec(
        str(postgres.program("pgbench")), "-n", "-c", str(CLIENTS), "-j", "2", "-t", str(transactions // CLIENTS),
        "-f", str(script),
        "-h", postgres.socket_dir, "-U", ROLES["app"], database,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), timeout=600)
    if process.returncode != 0:
        raise RuntimeError(f"pgbench failed: {err.decode(errors='replace').strip()}")
    found = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", out.decode())
    if found is None:
        raise RuntimeError(f"no tps in pgbench's output: {out.decode()[-500:]}")
    return float(found.group(1))


async def _store_claims(store: JobStore, numbers: range) -> float:
    pending = list(numbers)

    async def drain() -> None:
        while pending:
            n = pending.pop()
            await store.claim(job_id(n), 1, uuid.uuid4(), "bench")

    started = time.perf_counter()
    await asyncio.gather(*(drain() for _ in range(CLIENTS)))
    return len(numbers) / (time.perf_counter() - started)


async def measure(*, claims: int, rounds: int) -> Row:
    async with postgres_only("claims") as (folder, postgres):
        admin = await asyncpg.connect(asyncpg_dsn(postgres.url("owner")))
        tenant = uuid.uuid4()
        destination = await seed_destination(admin, tenant, name="bench", host="127.0.0.1", port=22, username="u",
                                             final_dir="/f", temp_dir="/t", host_key="k", credential_ref="file:x")
        engine = make_engine(postgres.url("app"), pool_size=CLIENTS)
        store = JobStore(engine, lease_seconds=60)
        ours, theirs = [], []
        next_job = 1
        for _ in range(rounds):
            await _seed_jobs(admin, tenant, destination, next_job, claims)
            await admin.execute("VACUUM ANALYZE export_jobs")
            ours.append(await _store_claims(store, range(next_job, next_job + claims)))
            next_job += claims
            pool = claims * 10
            await _seed_jobs(admin, tenant, destination, next_job, pool)
            await admin.execute("VACUUM ANALYZE export_jobs")
            script = folder / "claim.pgbench"
            script.write_text(_pgbench_script(next_job, pool))
            theirs.append(await _pgbench(postgres, "postgres", script, claims))
            next_job += pool
        await engine.dispose()
        await admin.close()
    return Row("P3", f"claims/s through store/, {CLIENTS} concurrent", "claims/s", middle(ours),
               middle(theirs), f"pgbench claim.sql, {CLIENTS} clients", ">= 0.66")
