"""A deploy of this release over the previous one, with exports in flight (case UP1), run with the previous
release's own code: its worker, its migrations and its command line, checked out from this repository's history
(tests/helpers/releases.py). Nothing here was recorded by today's code.

The previous release's worker takes exports into each state a deploy meets: one uploading, one building, one whose
claim waits on a locked row, one whose operator's cancel is being recorded against a locked row. It is stopped as a
deploy stops a pod (SIGTERM), `exports migrate` of this release runs, this release's worker refuses to start on a
namespace that lacks a search attribute it needs (UP4), `exports setup` adds it, and this release's worker finishes
every export: each as asked, with the right bytes at the partner, no workflow task failed, no run left open.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowExecutionStatus

from store.db import asyncpg_dsn
from tests.helpers.release_world import (
    FAST,
    ReleaseWorld,
    activity_in_flight,
    closed,
    create,
    histories,
    reaches,
    release_world,
    signal_cancel,
)
from tests.helpers.releases import ReleaseCode
from tests.helpers.support import eventually, lock_row, unlock_row
from workflows.identity import EXPORT_STATUS, export_workflow_id, search_attribute_kinds

# Slow enough that each export is caught in its step when the old worker stops (about 27 kB of contacts: a build
# of about 9 s). The upload, slower still (about 18 s), outlasts the claims and build starts of the two exports
# created after it reaches Delivering, on a loaded machine too (at 9 s it did not, once, with three test processes).
SLOW = dict(build_throttle_bytes_per_second=3000, upload_throttle_bytes_per_second=1500)
BOUND = 120.0
# The step whose claim meets the locked row: one step from 0.2.0 on, 0.1.0's own `claim` before.
CLAIM_STEPS = ("claim_if_allowed", "claim")


async def building(world: ReleaseWorld, job_id: uuid.UUID) -> None:
    await reaches(world, job_id, "Running")
    await eventually(lambda: asyncio.sleep(0, list(world.work_dir.glob(f"{job_id}-*.csv*"))), bool, timeout=30,
                     what=f"the build of {job_id} writing")


def file_at_partner(world: ReleaseWorld, name: str) -> bytes:
    return (world.partner.root / "outbound" / name).read_bytes()


@pytest.mark.spec("UP1", "UP4")
@pytest.mark.timeout(300)
async def test_upgrade__exports_in_flight_on_the_previous_release_are_finished_by_this_one(
        previous: ReleaseCode, pg_server, tmp_path: Path):
    async with release_world(previous, pg_server, tmp_path, **FAST) as world:
        owner = asyncpg_dsn(world.urls["owner_database_url"])
        installed = await previous.command("schedules", "install", settings=world.settings())
        assert installed.code == 0, installed

        # Queued: its claim waits on a row another transaction holds, from before the old worker starts.
        queued = await create(world)
        queued_lock = await lock_row(owner, queued)
        cancel_lock = None
        old = await world.released_worker(**SLOW)
        try:
            await activity_in_flight(world, queued, CLAIM_STEPS)
            delivering = await create(world)
            await reaches(world, delivering, "Delivering")
            built, cancelled = await create(world), await create(world)
            await building(world, built)
            await building(world, cancelled)
            assert await reaches(world, delivering, "Delivering") == "Delivering"

            # The deploy: SIGTERM; the old worker lets the upload in flight end, then exits.
            assert await old.terminate(bound=BOUND) in (0, -15), old.log()[-3000:]
            await activity_in_flight(world, queued, CLAIM_STEPS)
            # A migration that needs the long transaction's lock waits its bound and rolls back, keeping those
            # before it; the Job runs it again once that transaction has ended, and it goes on from there
            # (tests/upgrade/test_migrate.py). One that needs no lock it holds goes through.
            blocked = await world.todays_command("migrate", migration_lock_timeout_seconds=1, bound=BOUND)
            assert blocked.code in (0, 3), blocked
            if blocked.code == 3:
                assert "rolled back" in blocked.stderr and "run it again" in blocked.stderr, blocked
            await unlock_row(queued_lock)
            migrated = await world.todays_command("migrate", bound=BOUND)
            assert migrated.code == 0, migrated
            # Meanwhile an operator cancels `cancelled` from the UI, and its row is locked again, as is the queued
            # one's: this release's worker meets both.
            queued_lock, cancel_lock = await lock_row(owner, queued), await lock_row(owner, cancelled)
            request_id = await signal_cancel(world, cancelled, reason="wrong list")

            # Where this release sets a search attribute the previous one lacks, its worker says so and takes nothing
            # until `exports setup` adds it (UP4).
            needed = sorted(set(search_attribute_kinds()) - set(world.release_attributes))
            if needed:
                refused = await world.todays_worker()
                assert await asyncio.wait_for(refused.process.wait(), 60) == 2, refused.log()[-3000:]
                assert all(name in refused.log() for name in needed), refused.log()[-3000:]
                assert "temporal operator search-attribute create" in refused.log(), refused.log()[-3000:]
            setup = await world.todays_command("setup")
            assert setup.code == 0, setup
            assert (await world.todays_command("schedules", "install")).code == 0

            todays_started = datetime.now(UTC)
            await world.todays_worker(build_throttle_bytes_per_second=10_000)
            handle = world.client.get_workflow_handle(export_workflow_id(cancelled))

            async def claim_retried_then_unlocked() -> None:
                # The claim, asked again by this release's worker (a retry, or a new step once the statement's
                # bound made its answer Unknown), still meets the lock; then the lock goes.
                await activity_in_flight(world, queued, CLAIM_STEPS, started_after=todays_started, timeout=60)
                await unlock_row(queued_lock)

            async def cancel_busy_then_unlocked() -> None:
                # The cancel, recorded here, answers Busy; the run asks again (patched) and the lock goes.
                await eventually(lambda: handle.fetch_history(), lambda h: any(
                    b"busy-cancel-retry" in e.marker_recorded_event_attributes.SerializeToString()
                    for e in h.events), timeout=60, interval=0.2, what="the busy cancel to be asked again")
                await unlock_row(cancel_lock)

            await asyncio.gather(claim_retried_then_unlocked(), cancel_busy_then_unlocked())

            results = {job: await closed(world, job, timeout=BOUND) for job in (queued, delivering, built, cancelled)}
        finally:
            for held in (queued_lock, cancel_lock):
                if held is not None:
                    await unlock_row(held)

        rows = {r["id"]: r for r in await world.admin.fetch("SELECT * FROM export_jobs")}
        assert {job: rows[job]["status"] for job in results} == {
            queued: "Completed", delivering: "Completed", built: "Completed",
            cancelled: rows[cancelled]["status"]}, results
        assert rows[cancelled]["status"] in ("Stopped", "Canceled"), rows[cancelled]
        assert await world.admin.fetchval("SELECT id FROM cancellation_requests WHERE job_id = $1",
                                          cancelled) == request_id
        # Each result is the row's, and so is each run's ExportStatus.
        for job, result in results.items():
            assert result["status"] == rows[job]["status"], (job, result)
            description = await world.client.get_workflow_handle(export_workflow_id(job)).describe()
            assert description.status is WorkflowExecutionStatus.COMPLETED
            assert description.typed_search_attributes.get(EXPORT_STATUS) == rows[job]["status"], job

        # The right bytes, once each: the file the row names, with the sha256 it expected.
        completed = [job for job in results if rows[job]["status"] == "Completed"]
        at_partner = sorted(p.name for p in (world.partner.root / "outbound").iterdir())
        assert at_partner == sorted(rows[job]["expected_file_name"] for job in completed)
        for job in completed:
            content = file_at_partner(world, rows[job]["expected_file_name"])
            assert hashlib.sha256(content).digest() == bytes(rows[job]["expected_file_sha256"])
            assert content.count(b"\n") == 301  # the header and every contact
        assert rows[delivering]["attempt_count"] == 1  # finished by the old worker's upload, not uploaded again

        # No workflow task failed, in any run of either release; nothing open.
        for run, events in (await histories(world)).items():
            failed = [e for e in events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED]
            assert not failed, f"{run}: {failed[0].workflow_task_failed_event_attributes.failure.message}"
        running = [w.id async for w in world.client.list_workflows(
            "WorkflowType = 'ExportWorkflow' AND ExecutionStatus = 'Running'")]
        assert running == [], running
