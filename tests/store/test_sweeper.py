"""The sweeper (reference design, Messages, the Outbox, and the Sweeper; Test Matrix, The sweeper), against the
real database with the real 30-minute threshold and real row locks held on other connections."""

from __future__ import annotations

import asyncio
import json
import random
import uuid

import asyncpg
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from store.jobs import JobStore
from store.models import ClaimResult, Status
from store.recovery import Recovery
from store.statements import statement
from tests.helpers.store_states import outbox
from tests.helpers.support import create_job, seed_tenant

WAIT = 5.0  # every wait in this module is bounded by this many seconds


@pytest.fixture
def threshold(db) -> float:
    # The configured default, 30 minutes: the cases are stated against it.
    value = db.settings().sweeper_threshold_seconds
    assert value == 1800.0
    return value


async def queued(db, store: JobStore, tenant, *, minutes_since_wake: float) -> uuid.UUID:
    """A queued job whose only wake-up was written that long ago, published, and lost on its way."""
    job_id = await create_job(store, *tenant)
    await age(db, job_id, minutes_since_wake)
    return job_id


async def age(db, job_id: uuid.UUID, minutes: float) -> None:
    """The job's last wake-up that long ago; every wake-up it has was published (and lost: no run took it), since
    the sweep adds none beside one that waits unpublished."""
    await db.admin.execute(
        "UPDATE export_jobs SET woken_at = clock_timestamp() - make_interval(mins => $2) WHERE id = $1",
        job_id, minutes)
    await db.admin.execute(
        "UPDATE outbox SET published_at = clock_timestamp() WHERE job_id = $1 AND published_at IS NULL", job_id)


async def job(db, job_id: uuid.UUID) -> asyncpg.Record:
    return await db.admin.fetchrow(
        "SELECT status, sweep_count, woken_at, clock_timestamp() - woken_at AS since FROM export_jobs "
        "WHERE id = $1", job_id)


def sweeper(engine: AsyncEngine) -> Recovery:
    """The sweeper's statements run as Recovery's, on the application role's engine."""
    return Recovery(engine, max_attempts=3)


async def sweep_once(engine: AsyncEngine, threshold: float) -> int:
    # Bounded: the sweep never waits for a locked row, so it must finish promptly even while one is held.
    return await asyncio.wait_for(sweeper(engine).sweep(threshold_seconds=threshold, batch=500), WAIT)


@pytest.mark.spec("SW1")
async def test_lost_message_after_31_minutes_is_republished_and_29_is_not(db, store, app_engine, tenant,
                                                                          threshold):
    stale = await queued(db, store, tenant, minutes_since_wake=31)
    control = await queued(db, store, tenant, minutes_since_wake=29)
    # Not Queued: an old woken_at means nothing once the row carries the job.
    running = await queued(db, store, tenant, minutes_since_wake=31)
    assert await store.claim(running, 1, uuid.uuid4(), "worker-a") is ClaimResult.CLAIMED
    await age(db, running, 31)
    control_before = (await job(db, control))["woken_at"]

    assert await sweep_once(app_engine, threshold) == 1

    swept = await job(db, stale)
    assert (swept["status"], swept["sweep_count"]) == ("Queued", 1)
    assert swept["since"].total_seconds() < 60
    messages = await outbox(db, stale)
    assert len(messages) == 2 and len(set(messages)) == 2  # a new row with its own message ID
    assert (await job(db, control))["sweep_count"] == 0
    assert (await job(db, control))["woken_at"] == control_before
    assert len(await outbox(db, control)) == 1
    assert ((await job(db, running))["sweep_count"], len(await outbox(db, running))) == (0, 1)
    # Just swept, so not due again.
    assert await sweep_once(app_engine, threshold) == 0


@pytest.mark.spec("SW1")
async def test_sweep_all_drains_a_backlog_in_bounded_batches(db, store, app_engine, tenant, threshold):
    jobs = [await queued(db, store, tenant, minutes_since_wake=40 + i) for i in range(7)]
    assert await sweeper(app_engine).sweep(threshold_seconds=threshold, batch=3) == 3
    # Oldest first.
    assert [(await job(db, j))["sweep_count"] for j in jobs[-3:]] == [1, 1, 1]
    assert await sweeper(app_engine).sweep_all(threshold_seconds=threshold, batch=3) == 4
    for job_id in jobs:
        assert ((await job(db, job_id))["sweep_count"], len(await outbox(db, job_id))) == (1, 2)
    assert await sweeper(app_engine).sweep_all(threshold_seconds=threshold, batch=3) == 0


@pytest.mark.spec("SW2")
async def test_job_claimed_while_the_sweep_runs_gets_no_outbox_row(db, store, app_engine, tenant, threshold):
    # The interleaving: a worker's claim has taken the row (Queued -> Running, not yet committed) when the sweep
    # runs. The sweep skips the row instead of waiting (SKIP LOCKED), the claim commits, and the job, no longer
    # Queued, gets no wake-up from this sweep or the next. A row that left Queued and committed after the sweep's
    # snapshot but before its row lock is re-checked by PostgreSQL on its newest version, and the UPDATE repeats
    # `status = 'Queued'`; the concurrent test below exercises that window statistically.
    leaving = await queued(db, store, tenant, minutes_since_wake=31)
    staying = await queued(db, store, tenant, minutes_since_wake=31)
    attempt_id = uuid.uuid4()
    async with app_engine.connect() as conn:
        await conn.begin()
        claimed = await conn.execute(statement("claim"), {
            "job_id": leaving, "checked_version": 1, "attempt_id": attempt_id, "worker_id": "worker-a",
            "lease_seconds": 5.0})
        assert claimed.rowcount == 1
        assert await sweep_once(app_engine, threshold) == 1
        await conn.commit()

    assert await sweep_once(app_engine, threshold) == 0
    row = await job(db, leaving)
    assert (row["status"], row["sweep_count"]) == ("Running", 0)
    assert len(await outbox(db, leaving)) == 1
    assert ((await job(db, staying))["sweep_count"], len(await outbox(db, staying))) == (1, 2)


@pytest.mark.spec("SW2")
async def test_sweeps_racing_claims_and_cancellations_never_wake_a_job_that_left_queued(
    db, store, app_engine, tenant, threshold
):
    # Many due jobs; every one is claimed or canceled while sweeps in small batches run alongside. A sweep that
    # touched a job did so while it was Queued: its wake-up precedes the claim or cancellation that ended the
    # queued cycle, and every outbox row beyond creation's is matched by one sweep_count.
    jobs = [await queued(db, store, tenant, minutes_since_wake=31) for _ in range(60)]
    delays = random.Random(7)
    left: set[uuid.UUID] = set()

    async def leave_queue(i: int, job_id: uuid.UUID) -> None:
        # Staggered, so some jobs leave before any sweep reaches them, some after, and some during one.
        await asyncio.sleep(delays.uniform(0, 0.3))
        if i % 2:
            assert await store.claim(job_id, 1, uuid.uuid4(), "worker-a") is ClaimResult.CLAIMED
        else:
            result = await store.request_cancellation(
                tenant_id=tenant[0], job_id=job_id, request_id=uuid.uuid4(), requested_by="op", reason=None)
            assert result.job_id == job_id and result.recorded
        left.add(job_id)

    async def keep_sweeping() -> int:
        total = 0
        while len(left) < len(jobs):
            total += await asyncio.wait_for(sweeper(app_engine).sweep(threshold_seconds=threshold, batch=1), WAIT)
            await age_all()
        return total

    admin_in_use = asyncio.Lock()  # one asyncpg connection runs one command at a time

    async def age_all() -> None:
        # Every wake-up is "lost" again at once, so a job can be swept more than once before it leaves.
        async with admin_in_use:
            await db.admin.execute(
                "UPDATE export_jobs SET woken_at = clock_timestamp() - interval '31 minutes' "
                "WHERE id = ANY($1::uuid[]) AND status = 'Queued'", jobs)
            await db.admin.execute(
                "UPDATE outbox SET published_at = clock_timestamp() WHERE job_id = ANY($1::uuid[]) "
                "AND published_at IS NULL", jobs)

    results = await asyncio.wait_for(
        asyncio.gather(keep_sweeping(), keep_sweeping(), *(leave_queue(i, j) for i, j in enumerate(jobs))),
        30)
    swept_total = results[0] + results[1]
    assert swept_total > 0  # the sweeps did run while jobs were still queued

    rows = await db.admin.fetch(
        """
        SELECT j.id, j.status, j.sweep_count,
               (SELECT count(*) FROM outbox o WHERE o.job_id = j.id) AS messages,
               (SELECT max(o.created_at) FROM outbox o WHERE o.job_id = j.id) AS last_wake,
               coalesce((SELECT min(e.recorded_at) FROM export_attempt_events e WHERE e.job_id = j.id),
                        (SELECT min(c.recorded_at) FROM cancellation_requests c WHERE c.job_id = j.id)) AS left_at
        FROM export_jobs j WHERE j.id = ANY($1::uuid[])
        """, jobs)
    assert {r["status"] for r in rows} <= {"Running", "Canceled"}
    assert sum(r["sweep_count"] for r in rows) == swept_total
    for r in rows:
        assert r["messages"] == 1 + r["sweep_count"]
        if r["sweep_count"]:
            assert r["last_wake"] < r["left_at"], dict(r)
    # Settled now: nothing left to sweep.
    assert await sweep_once(app_engine, threshold) == 0


@pytest.mark.spec("SW3")
async def test_row_locked_by_a_cancellation_is_skipped_and_picked_up_next_time(
    db, store, app_engine, tenant, threshold
):
    locked = await queued(db, store, tenant, minutes_since_wake=31)
    others = [await queued(db, store, tenant, minutes_since_wake=31) for _ in range(2)]
    async with app_engine.connect() as conn:
        await conn.begin()
        # The cancellation's own locking read, held open: its transaction has the row until it ends.
        await conn.execute(text("SET LOCAL lock_timeout = 2000"))
        found = (await conn.execute(statement("cancel_lock_job"), {"job_id": locked, "tenant_id": tenant[0]}))
        assert found.mappings().one()["status"] == "Queued"
        # Proof that the row is locked while the sweep runs: a NOWAIT lock attempt fails.
        with pytest.raises(asyncpg.LockNotAvailableError):
            await db.admin.execute("SELECT 1 FROM export_jobs WHERE id = $1 FOR UPDATE NOWAIT", locked)

        assert await sweep_once(app_engine, threshold) == 2  # finished without waiting for the lock
        assert ((await job(db, locked))["sweep_count"], len(await outbox(db, locked))) == (0, 1)
        for job_id in others:
            assert ((await job(db, job_id))["sweep_count"], len(await outbox(db, job_id))) == (1, 2)
        # The cancellation ends without changing the job (as when it answers RequestIdReused): still Queued.
        await conn.commit()

    assert await sweep_once(app_engine, threshold) == 1
    row = await job(db, locked)
    assert (row["status"], row["sweep_count"]) == ("Queued", 1)
    assert len(await outbox(db, locked)) == 2
    for job_id in others:
        assert ((await job(db, job_id))["sweep_count"], len(await outbox(db, job_id))) == (1, 2)


@pytest.mark.spec("SW4")
async def test_each_republication_increments_sweep_count(db, store, app_engine, tenant, threshold):
    job_id = await queued(db, store, tenant, minutes_since_wake=31)
    for expected in (1, 2, 3):
        assert await sweep_once(app_engine, threshold) == 1
        assert (await job(db, job_id))["sweep_count"] == expected
        assert await sweep_once(app_engine, threshold) == 0  # no republication, no increment
        assert (await job(db, job_id))["sweep_count"] == expected
        await age(db, job_id, 31)  # the wake-up was lost again
    messages = await outbox(db, job_id)
    assert len(messages) == 4 and len(set(messages)) == 4
    assert (await job(db, job_id))["status"] == Status.QUEUED.value


async def test_the_sweep_finds_its_due_rows_through_the_index_bounds_not_by_reading_every_queued_row(db):
    """With a thousand queued jobs woken just now, the sweep's scan is bounded by the cutoff in the index: it reads
    only what is due (none here), so its cost does not grow with the queue. A volatile cutoff (clock_timestamp())
    cannot bound an index scan and made every sweep read the whole queue."""
    tenant_id, destination_id = await seed_tenant(db.admin)
    await db.admin.execute("""
        WITH numbered AS (SELECT gen_random_uuid() AS id, 'q' || n AS key FROM generate_series(1, 1000) AS n),
        delivery AS (INSERT INTO deliveries (tenant_id, delivery_key, original_job_id) SELECT $1, key, id FROM numbered)
        INSERT INTO export_jobs (id, tenant_id, status, version, destination_id, delivery_key, final_name, created_by,
                                 woken_at)
        SELECT id, $1, 'Queued', 1, $2, key, 'contacts-' || $1::text || '-' || key || '.csv', 't', clock_timestamp()
        FROM numbered""", tenant_id, destination_id)
    await db.admin.execute("ANALYZE export_jobs")
    sql = statement("sweep").text.replace(":threshold_seconds", "1800").replace(":batch", "500")
    plan = await db.admin.fetchval("EXPLAIN (ANALYZE, FORMAT JSON) " + sql)
    plan = plan if isinstance(plan, list) else json.loads(plan)

    def scans(node):
        yield node
        for child in node.get("Plans", []):
            yield from scans(child)

    woken = [n for n in scans(plan[0]["Plan"]) if n.get("Index Name") == "ix_export_jobs_woken"]
    assert woken and all("woken_at" in n.get("Index Cond", "") for n in woken), woken
    assert sum(n.get("Rows Removed by Filter", 0) + n["Actual Rows"] for n in woken) == 0, woken
    # An export's unsent wake-ups are asked for by an index probe, not by reading the outbox, which keeps its
    # published rows.
    probes = [n for n in scans(plan[0]["Plan"]) if n.get("Relation Name") == "outbox" and "Scan" in n["Node Type"]]
    assert probes and all(n.get("Index Name") == "ix_outbox_unpublished_job" for n in probes), probes


async def test_an_export_whose_wake_up_still_waits_unpublished_gets_no_other(db, store, app_engine, tenant,
                                                                             threshold):
    """While no dispatcher publishes (Temporal away, every dispatcher down), each sweep past the threshold found the
    export stranded again and added a wake-up: 48 a day for one export, each a signal once Temporal came back. One
    unpublished wake-up wakes the run as well as any number: the sweep adds none while one waits, and looks at the
    export again one threshold later."""
    job_id = await create_job(store, *tenant)  # its creation's wake-up, never published
    for _ in range(5):  # five sweeps, each one threshold after the last (2.5 hours of outage)
        await db.admin.execute(
            "UPDATE export_jobs SET woken_at = clock_timestamp() - interval '31 minutes' WHERE id = $1", job_id)
        assert await sweep_once(app_engine, threshold) == 0
        assert (await job(db, job_id))["since"].total_seconds() < 60  # looked at: not due again at once
    assert len(await outbox(db, job_id)) == 1
    assert (await job(db, job_id))["sweep_count"] == 0
    # Once that wake-up has gone out (and was lost on its way), the next sweep writes a fresh one.
    await db.admin.execute("UPDATE outbox SET published_at = clock_timestamp() WHERE job_id = $1", job_id)
    await age(db, job_id, 31)
    assert await sweep_once(app_engine, threshold) == 1
    assert len(await outbox(db, job_id)) == 2
