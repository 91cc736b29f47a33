"""A worker's capacity (LD1, LD2): it runs at most EXPORTS_MAX_BUILDS builds and EXPORTS_MAX_UPLOADS uploads at
once; an export waiting for a build slot waits Queued, one waiting for an upload slot waits before cutoff 2 with
its lease kept; neither is ever taken for a lost worker, with recovery running all along. Real PostgreSQL, the
Temporal dev server and the SFTP partner; the intervals are read from the events the row's statements wrote."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterable
from contextlib import AsyncExitStack, suppress
from datetime import datetime

import pytest

from store.models import Status
from tests.helpers.harness import Harness, open_harness, run_recovery

LEASE = 3.0
MAX_BUILDS = 2
MAX_UPLOADS = 1
EXPORTS = 6


def most_at_once(intervals: Iterable[tuple[datetime, datetime]]) -> int:
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals],
                   key=lambda edge: (edge[0], edge[1]))  # an end before a start at the same instant
    running = most = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    return most


async def recovering(h: Harness, stop: asyncio.Event, runs: list[int]) -> None:
    """Recovery every half second meanwhile: an attempt taken for lost would be taken over."""
    while not stop.is_set():
        with suppress(Exception):
            await asyncio.wait_for(run_recovery(h.client, h.settings), 20)
            runs.append(1)
        with suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


@pytest.mark.spec("LD1", "LD2")
async def test_a_worker_runs_its_configured_builds_and_uploads_at_once_and_no_wait_is_a_lost_worker(
        db, store, client, tmp_path):
    async with AsyncExitStack() as stack:
        # About 18 kB per export: a build of about 1.5 s, an upload of about 4 s, longer than the lease.
        h = await open_harness(stack, db, store, client, tmp_path, lease_seconds=LEASE, renew_every_seconds=1.0,
                               max_builds=MAX_BUILDS, max_uploads=MAX_UPLOADS,
                               build_throttle_bytes_per_second=12_000, upload_throttle_bytes_per_second=4_500)
        stop, runs = asyncio.Event(), []
        recovery = asyncio.create_task(recovering(h, stop, runs))
        try:
            jobs = [await h.create() for _ in range(EXPORTS)]
            rows = await asyncio.wait_for(asyncio.gather(*(h.settled(job) for job in jobs)), 240)
        finally:
            stop.set()
            await asyncio.wait_for(recovery, 30)

    assert all(row.status is Status.COMPLETED and row.attempt_count == 1 for row in rows), \
        [(row.status, row.attempt_count) for row in rows]
    assert len(runs) >= 10, f"recovery ran {len(runs)} times only"
    events = await db.admin.fetch(
        "SELECT job_id, kind, recorded_at FROM export_attempt_events WHERE job_id = ANY($1::uuid[]) "
        "ORDER BY recorded_at", jobs)
    kinds = {event["kind"] for event in events}
    assert not kinds & {"RequeuedByRecovery", "AttemptsExhausted", "ResolvedByRecovery"}, kinds
    at: dict[uuid.UUID, dict[str, datetime]] = {}
    for event in events:
        at.setdefault(event["job_id"], {}).setdefault(event["kind"], event["recorded_at"])
    # The creation's wake-up is written with the row.
    created = {row["job_id"]: row["created"] for row in await db.admin.fetch(
        "SELECT job_id, min(created_at) AS created FROM outbox WHERE job_id = ANY($1::uuid[]) GROUP BY job_id", jobs)}

    building = [(at[job]["Claimed"], at[job]["DeliveryAuthorized"]) for job in jobs]
    uploading = [(at[job]["DeliveryAuthorized"], at[job]["Finished"]) for job in jobs]
    queued = max((at[job]["Claimed"] - created[job]).total_seconds() for job in jobs)
    before_cutoff_2 = max((end - start).total_seconds() for start, end in building)
    print(f"\nLD1/LD2: builds at once {most_at_once(building)} (max {MAX_BUILDS}), uploads at once "
          f"{most_at_once(uploading)} (max {MAX_UPLOADS}); longest wait Queued {queued:.1f} s, longest from claim "
          f"to cutoff 2 {before_cutoff_2:.1f} s, lease {LEASE:.0f} s; {len(runs)} recovery runs")
    assert most_at_once(building) == MAX_BUILDS
    assert most_at_once(uploading) == MAX_UPLOADS
    # The waits were real and longer than a lease: Queued for a build slot, and claimed, built and waiting for an
    # upload slot with the lease kept.
    assert queued > LEASE, queued
    assert before_cutoff_2 > LEASE + 2, before_cutoff_2
