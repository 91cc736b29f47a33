"""P4: a recovery pass and a sweep, each over 1,000 due rows, in a table of 1M rows against the same in a table of
10k rows (the external baseline is the small table: the question is whether the work grows with the table).

Recovery: nominate and take over every expired Running attempt, as the RecoveryWorkflow's activities do, until
none is left. Sweep: every Queued job whose wake-up is older than the threshold gets a new one, in batches, as
the sweeper does. The ratios are small-table seconds over large-table seconds (more is better; 0.67 means the
large table takes 1.5 times as long).
"""

from __future__ import annotations

import time
import uuid

import asyncpg

from bench.stack import postgres_only
from bench.table import Row, middle
from starter.localstack.seed import seed_destination
from store.db import asyncpg_dsn, make_engine
from store.recovery import Recovery
from store.settings import Settings

DUE = 1000
THRESHOLD = 600.0  # the sweeper's: a wake-up older than this is due
SWEEP_ROUNDS = 5  # a sweep takes milliseconds: the median of several


async def _seed(admin: asyncpg.Connection, rows: int) -> None:
    """`rows` settled or recently woken jobs, then DUE expired Running attempts and DUE stale Queued jobs."""
    tenant = uuid.uuid4()
    destination = await seed_destination(admin, tenant, name="bench", host="127.0.0.1", port=22, username="u",
                                         final_dir="/f", temp_dir="/t", host_key="k", credential_ref="file:x")
    # status, attempt, lease and wake-up by kind: 'background' (nine in ten Canceled, one in ten Queued and
    # recently woken), 'expired' (Running, lease an hour gone), 'stale' (Queued, woken an hour ago).
    await admin.execute("""
        WITH numbered AS (
            SELECT n, gen_random_uuid() AS id, 'k' || n AS key,
                   CASE WHEN n <= $3 THEN CASE WHEN n % 10 = 0 THEN 'Queued' ELSE 'Canceled' END
                        WHEN n <= $3 + $4 THEN 'Running' ELSE 'Queued' END AS status,
                   n > $3 AND n <= $3 + $4 AS expired, n > $3 + $4 AS stale
            FROM generate_series(1, $3 + 2 * $4) AS n),
        delivery AS (
            INSERT INTO deliveries (tenant_id, delivery_key, original_job_id) SELECT $1, key, id FROM numbered),
        job AS (
            INSERT INTO export_jobs (id, tenant_id, status, version, destination_id, delivery_key, final_name,
                                     created_by, woken_at, attempt_id, attempt_count, claimed_by, lease_expires_at)
            SELECT id, $1, status, 1, $2, key, 'contacts-' || $1::text || '-' || key || '.csv', 'bench',
                   CASE WHEN stale THEN clock_timestamp() - interval '1 hour' ELSE clock_timestamp() END,
                   CASE WHEN expired THEN gen_random_uuid() END, CASE WHEN expired THEN 1 ELSE 0 END,
                   CASE WHEN expired THEN 'bench/0' END,
                   CASE WHEN expired THEN clock_timestamp() - interval '1 hour' END
            FROM numbered
            RETURNING id, attempt_id)
        INSERT INTO export_attempt_events (job_id, attempt_id, kind, version, worker_id, recorded_at)
        SELECT id, attempt_id, 'Claimed', 1, 'bench/0', clock_timestamp() FROM job WHERE attempt_id IS NOT NULL
        """, tenant, destination, rows, DUE)
    await admin.execute("VACUUM ANALYZE")


async def _recovery_pass(recovery: Recovery, batch: int) -> int:
    taken = 0
    while candidates := await recovery.nominate(batch):
        for candidate in candidates:
            taken += await recovery.take_over_running(candidate, "bench") is not None
    return taken


async def _measure_one(rows: int, settings: Settings) -> tuple[float, float]:
    async with postgres_only("recovery") as (_, postgres):
        admin = await asyncpg.connect(asyncpg_dsn(postgres.url("owner")))
        await _seed(admin, rows)
        engine = make_engine(postgres.url("app"))
        recovery = Recovery(engine, max_attempts=settings.max_attempts)
        started = time.perf_counter()
        taken = await _recovery_pass(recovery, settings.recovery_batch)
        recovery_seconds = time.perf_counter() - started
        sweeps = []
        for _ in range(SWEEP_ROUNDS):
            started = time.perf_counter()
            swept = await recovery.sweep_all(threshold_seconds=THRESHOLD, batch=settings.sweeper_batch)
            sweeps.append(time.perf_counter() - started)
            if swept != DUE:
                raise RuntimeError(f"expected {DUE} sweeps, got {swept}")
            # The same jobs due again for the next round, as an hour later, their wake-ups sent and lost (owner
            # only: no statement does this; the sweep adds none beside one still unpublished).
            await admin.execute("UPDATE export_jobs SET woken_at = woken_at - interval '1 hour' "
                                "WHERE sweep_count > 0 AND status = 'Queued'")
            await admin.execute("UPDATE outbox SET published_at = clock_timestamp() WHERE published_at IS NULL")
            await admin.execute("VACUUM ANALYZE export_jobs")
        await engine.dispose()
        await admin.close()
        if taken != DUE:
            raise RuntimeError(f"expected {DUE} takeovers, got {taken}")
        return recovery_seconds, middle(sweeps)


async def measure(*, small: int, large: int) -> list[Row]:
    settings = Settings()
    small_recovery, small_sweep = await _measure_one(small, settings)
    large_recovery, large_sweep = await _measure_one(large, settings)
    recovery = Row("P4", f"recovery pass, {DUE} due among {large:,} rows", "s", large_recovery, small_recovery,
                   f"the same among {small:,}", ">= 0.67", higher_is_better=False)
    sweep = Row("P4", f"sweep, {DUE} due among {large:,} rows", "s", large_sweep, small_sweep,
                f"the same among {small:,}", ">= 0.67", higher_is_better=False)
    return [recovery, sweep]
