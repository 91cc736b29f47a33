"""The race itself: a cancellation and a claim contending for one row, on separate connections."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from starter.localstack.postgres import ROLES
from store.jobs import JobStore
from store.models import CancellationOutcome, ClaimResult, Status
from tests.helpers.store_states import cancel
from tests.helpers.support import create_job, eventually, seed_tenant

RACES = 40
BOUND = 10.0  # seconds; each contender reaches the row, and each race ends, far sooner or the test fails


async def blocked_on_a_lock(db) -> list[int]:
    """The application's backends in this database that are waiting, right now, for a lock."""
    rows = await db.admin.fetch(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND usename = $1 "
        "AND wait_event_type = 'Lock'", ROLES["app"])
    return [r["pid"] for r in rows]


async def contend(db, job_id: uuid.UUID, first: Callable[[], Awaitable[Any]],
                  second: Callable[[], Awaitable[Any]]) -> tuple[Any, Any]:
    """Both contenders waiting on the row at the same time, then released together.

    A third transaction holds the row; `first` reaches it and waits, then `second` reaches it and waits, each on
    its own connection. Rolling the holder back releases both at once: PostgreSQL lets the first in the row's
    queue proceed, and the other waits for its commit and then decides from the row as that left it."""
    holder = await db.connect("owner")
    hold = holder.transaction()
    tasks: list[asyncio.Task[Any]] = []
    held = False
    try:
        await hold.start()
        held = True
        await holder.execute("SELECT 1 FROM export_jobs WHERE id = $1 FOR UPDATE", job_id)
        for n, contender in enumerate((first, second), start=1):
            tasks.append(asyncio.create_task(contender()))
            await eventually(lambda: blocked_on_a_lock(db), lambda pids, n=n: len(pids) == n, timeout=BOUND,
                             interval=0.005, what=f"{n} contender(s) waiting on the row")
        await hold.rollback()
        held = False
        results = await asyncio.wait_for(asyncio.gather(*tasks), BOUND)
        return results[0], results[1]
    finally:
        if held:
            await hold.rollback()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await holder.close()


@pytest.mark.spec("AR1")
async def test_race__cancel_and_claim_exactly_one_wins(db, app_engine):
    # The row is held while the second contender arrives: that wait must not count as the operator's Busy.
    store = JobStore(app_engine, lease_seconds=5.0, lock_timeout_ms=int(BOUND * 1000))
    tenant_id, destination_id = await seed_tenant(db.admin)
    winners = {"claim": 0, "cancel": 0}
    for race in range(RACES):
        job_id = await create_job(store, tenant_id, destination_id)
        attempt_id = uuid.uuid4()

        def claiming() -> Awaitable[ClaimResult]:
            return store.claim(job_id, 1, attempt_id, "worker-a")

        def cancelling() -> Awaitable[Any]:
            return cancel(store, tenant_id, job_id)

        # Each side is first in the row's queue in half the races.
        if race % 2 == 0:
            claim, cancellation = await contend(db, job_id, claiming, cancelling)
        else:
            cancellation, claim = await contend(db, job_id, cancelling, claiming)
        row = await store.read_job(job_id)
        if claim is ClaimResult.CLAIMED:
            winners["claim"] += 1
            # The cancellation came second, so it is only a stop request for the running attempt.
            assert cancellation.outcome is CancellationOutcome.STOP_REQUESTED
            assert (row.status, row.attempt_id, row.stop_request_id) == (
                Status.RUNNING, attempt_id, cancellation.request_id)
        else:
            winners["cancel"] += 1
            assert claim is ClaimResult.LOST
            assert cancellation.outcome is CancellationOutcome.CANCELED_WHILE_QUEUED
            assert (row.status, row.attempt_id, row.cancellation_request_id) == (
                Status.CANCELED, None, cancellation.request_id)
        events = await db.admin.fetchval(
            "SELECT count(*) FROM export_attempt_events WHERE job_id = $1 AND kind = 'Claimed'", job_id)
        assert events == (1 if claim is ClaimResult.CLAIMED else 0)
        assert await db.admin.fetchval(
            "SELECT count(*) FROM cancellation_requests WHERE job_id = $1", job_id) == 1
    # The race went both ways: each branch above was taken, each time against a contender that was waiting.
    assert winners["claim"] >= 1 and winners["cancel"] >= 1, winners
    assert sum(winners.values()) == RACES


@pytest.mark.spec("AR2")
async def test_race__cancel_just_after_claim_is_a_stop_request(db, store):
    tenant_id, destination_id = await seed_tenant(db.admin)
    job_id = await create_job(store, tenant_id, destination_id)
    attempt_id = uuid.uuid4()
    assert await store.claim(job_id, 1, attempt_id, "worker-a") is ClaimResult.CLAIMED
    result = await cancel(store, tenant_id, job_id)
    assert result.outcome is CancellationOutcome.STOP_REQUESTED
    row = await store.read_job(job_id)
    assert (row.status, row.stop_request_id, row.cancellation_request_id) == (
        Status.RUNNING, result.request_id, None)
    recorded = await db.admin.fetchrow("SELECT outcome, found_status, found_attempt_id FROM cancellation_requests")
    assert tuple(recorded) == ("StopRequested", "Running", attempt_id)
    # A second click is a second request, and finds the stop already recorded.
    again = await cancel(store, tenant_id, job_id)
    assert again.outcome is CancellationOutcome.STOP_ALREADY_REQUESTED
    assert (await store.read_job(job_id)).stop_request_id == result.request_id
