"""A stop recorded while a resumed build waits for a build slot on a busy worker (docs/design.md §5.14) reaches it
through the database, as it reaches a build under way. The build activity runs for real (temporalio's
ActivityEnvironment, the real PostgreSQL and stop listener); the only thing arranged is the worker's one build slot,
held by another attempt. Seen failing: the stop watch began only after the slot wait, so the stop waited for a slot
to free (minutes, behind slow builds) or for the next heartbeat's cancel."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from datetime import UTC, datetime, timedelta

from temporalio.testing import ActivityEnvironment

from activities.build_activities import BuildActivities
from activities.contracts import AttemptInput
from store.models import CancellationOutcome, ClaimResult, Status
from tests.helpers.support import create_job, eventually, seed_tenant


async def test_a_stop_written_while_a_resumed_build_waits_for_a_build_slot_stops_it_within_a_second(
        db, store, tmp_path):
    settings = db.settings(max_builds=1, work_dir=str(tmp_path / "work"))
    tenant_id, destination_id = await seed_tenant(db.admin)
    job_id, attempt_id = await create_job(store, tenant_id, destination_id), uuid.uuid4()
    assert await store.claim(job_id, 1, attempt_id, "worker-a") is ClaimResult.CLAIMED
    row = await store.read_job(job_id)
    activities = BuildActivities(store, settings, worker_id="worker-b", worker_task_queue="q-b")
    await activities.capacity.builds.acquire((uuid.uuid4(), uuid.uuid4()))  # another build holds the only slot
    env = ActivityEnvironment()
    now = datetime.now(UTC)
    env.info = dataclasses.replace(env.info, current_attempt_scheduled_time=now, started_time=now,
                                   heartbeat_timeout=timedelta(seconds=settings.lease_seconds))
    building = asyncio.create_task(env.run(activities.build, AttemptInput(job=row, attempt_id=attempt_id,
                                                                          resumption=1)))
    try:
        await eventually(lambda: store.read_job(job_id), lambda r: r.claimed_by.startswith("worker-b/b1."),
                         timeout=20, interval=0.05, what="the resumed build started (BuildStarted)")
        await eventually(lambda: asyncio.sleep(0, activities.capacity.builds.waiting), lambda n: n == 1,
                         timeout=10, interval=0.05, what="the build waiting for the worker's build slot")
        stop = await store.request_cancellation(tenant_id=tenant_id, job_id=job_id, request_id=uuid.uuid4(),
                                                requested_by="ann@example.com", reason="stop while it waits")
        assert stop.outcome is CancellationOutcome.STOP_REQUESTED
        asked = time.monotonic()
        done, _ = await asyncio.wait({building}, timeout=5.0)
        assert done, f"a stop recorded {time.monotonic() - asked:.1f} s ago has not reached the waiting build"
        assert building.result().ended == "Stopped"
        assert (await store.read_job(job_id)).status is Status.STOPPED
        assert activities.capacity.builds.waiting == 0  # its place in the queue given up
    finally:
        if not building.done():
            env.cancel()
        await asyncio.gather(building, return_exceptions=True)
        await activities.close()
