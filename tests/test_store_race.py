"""The race itself: a cancellation and a claim contending for one row, on separate connections."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from store.models import CancellationOutcome, ClaimResult, Status
from tests.support import create_job, seed_tenant


async def cancel(store, tenant_id, job_id, **kwargs):
    return await store.request_cancellation(
        tenant_id=tenant_id, job_id=job_id, request_id=kwargs.get("request_id", uuid.uuid4()),
        requested_by="operator@example", reason="test",
    )


@pytest.mark.spec("AR1")
async def test_race__cancel_and_claim_exactly_one_wins(db, store):
    tenant_id, destination_id = await seed_tenant(db.admin)
    winners = {"claim": 0, "cancel": 0}
    for _ in range(40):
        job_id = await create_job(store, tenant_id, destination_id)
        attempt_id = uuid.uuid4()
        claim, cancellation = await asyncio.gather(
            store.claim(job_id, 1, attempt_id, "worker-a"), cancel(store, tenant_id, job_id)
        )
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
    assert sum(winners.values()) == 40


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
