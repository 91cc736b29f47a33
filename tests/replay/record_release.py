"""Records workflow histories with the code of an earlier commit, into histories/<folder>/: for a release that
shipped no recorder of its own (0.1.0), or for a commit between releases whose shapes a change must still replay.

    EXPORTS_RECORD_COMMIT=7130f50 EXPORTS_RECORD_FOLDER=0.1.0 .venv/bin/pytest tests/replay/record_release.py

Each case runs that commit's own worker processes and `exports` command line (tests/helpers/releases.py) against
real PostgreSQL (migrated by that commit), a Temporal dev server of its own and the local SFTP partner; only the
arranging (a held row lock, a raw signal, a partner fault) comes from here. `make test` does not collect this
module. A folder once recorded is never recorded again by later code: it is the evidence of what that code wrote.
"""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest

from tests.helpers.release_world import (
    FAST,
    ReleaseWorld,
    cancel,
    closed,
    completed_activity,
    create,
    reaches,
    release_world,
    signal_cancel,
)
from tests.helpers.releases import Release, release_code
from tests.helpers.support import eventually
from tests.replay.history_files import HISTORIES, save
from workflows.identity import export_workflow_id

COMMIT = os.environ.get("EXPORTS_RECORD_COMMIT", "")
FOLDER = os.environ.get("EXPORTS_RECORD_FOLDER", "")
# Only the cases named here (comma-separated), when set: a commit between releases needs only the shapes at stake.
CASES = {c.strip() for c in os.environ.get("EXPORTS_RECORD_CASES", "").split(",") if c.strip()}

pytestmark = pytest.mark.skipif(not (COMMIT and FOLDER), reason="set EXPORTS_RECORD_COMMIT and EXPORTS_RECORD_FOLDER")

# A lock held by a case answers Busy at once: the recordings want that answer, not a wait.
RECORDING = {**FAST, "lock_timeout_ms": 500}
SLOW_BUILD = dict(build_throttle_bytes_per_second=4000)
SLOW_UPLOAD = dict(upload_throttle_bytes_per_second=4000)


@pytest.fixture(scope="module")
def code():
    with release_code(Release(FOLDER, COMMIT)) as checked_out:
        yield checked_out


@pytest.fixture
async def world(code, pg_server, tmp_path, request):
    if CASES and request.node.name.removeprefix("test_") not in CASES:
        pytest.skip("not among EXPORTS_RECORD_CASES")
    async with release_world(code, pg_server, tmp_path, **RECORDING) as w:
        yield w


async def record(world: ReleaseWorld, workflow_id: str, case: str) -> None:
    target = HISTORIES / FOLDER / f"{case}.json"
    save(FOLDER, case, await world.client.get_workflow_handle(workflow_id).fetch_history())
    assert target.exists()


async def record_export(world: ReleaseWorld, job_id: uuid.UUID, case: str) -> None:
    await record(world, export_workflow_id(job_id), case)


async def activity_completed(world: ReleaseWorld, job_id: uuid.UUID, activity_type: str) -> None:
    handle = world.client.get_workflow_handle(export_workflow_id(job_id))

    async def events() -> list:
        return (await handle.fetch_history()).events

    await eventually(events, lambda evs: completed_activity(evs, activity_type), timeout=30, interval=0.2,
                     what=f"{activity_type} of {job_id} completed")


async def test_export_completed(world: ReleaseWorld):
    await world.released_worker()
    job_id = await create(world)
    assert (await closed(world, job_id))["status"] == "Completed"
    await record_export(world, job_id, "export_completed")


async def test_export_stopped_by_cancel(world: ReleaseWorld):
    await world.released_worker(**SLOW_BUILD)
    job_id = await create(world)
    await reaches(world, job_id, "Running")
    ran = await cancel(world, job_id)
    assert ran.code == 0 and "StopRequested" in ran.stdout, ran
    assert (await closed(world, job_id))["status"] == "Stopped"
    await record_export(world, job_id, "export_stopped_by_cancel")


async def test_export_stopped_by_temporal_cancel(world: ReleaseWorld):
    await world.released_worker(**SLOW_BUILD)
    job_id = await create(world)
    await reaches(world, job_id, "Running")
    await world.client.get_workflow_handle(export_workflow_id(job_id)).cancel()
    assert (await closed(world, job_id))["status"] == "Stopped"
    await record_export(world, job_id, "export_stopped_by_temporal_cancel")


async def test_export_canceled_while_queued(world: ReleaseWorld):
    job_id = await create(world)  # no worker yet: nothing starts the workflow
    ran = await cancel(world, job_id)
    assert ran.code == 0 and "CanceledWhileQueued" in ran.stdout, ran
    await world.released_worker()
    assert (await closed(world, job_id))["status"] == "Canceled"
    await record_export(world, job_id, "export_canceled_while_queued")


async def test_export_rejected(world: ReleaseWorld):
    await world.admin.execute("UPDATE destinations SET enabled = false WHERE id = $1", world.destination_id)
    await world.released_worker()
    job_id = await create(world)
    assert (await closed(world, job_id))["status"] == "Rejected"
    await record_export(world, job_id, "export_rejected")


async def test_export_outcome_unknown(world: ReleaseWorld):
    async def drop(old: str, new: str) -> None:
        world.partner.close_connections()

    world.partner.hooks.after_rename = drop
    await world.released_worker()
    job_id = await create(world)
    assert (await closed(world, job_id))["status"] == "OutcomeUnknown"
    await record_export(world, job_id, "export_outcome_unknown")


async def test_export_resumed_after_crash(world: ReleaseWorld):
    crashing = await world.released_worker(hold_at="build_started")
    job_id = await create(world)
    marker = world.work_dir / f"held-build_started-{job_id}"
    await eventually(lambda: asyncio.sleep(0, marker.exists()), bool, timeout=30, what="the build held")
    await world.released_worker()
    crashing.kill()
    result = await closed(world, job_id, timeout=90)
    assert result["status"] == "Completed"
    await record_export(world, job_id, "export_resumed_after_crash")


async def test_export_requeued_by_recovery(world: ReleaseWorld):
    """The building worker is killed with no other running; recovery requeues the attempt; a second attempt
    delivers. Records the export and the recovery run."""
    crashing = await world.released_worker(hold_at="build_started")
    job_id = await create(world)
    marker = world.work_dir / f"held-build_started-{job_id}"
    await eventually(lambda: asyncio.sleep(0, marker.exists()), bool, timeout=30, what="the build held")
    crashing.kill()
    await eventually(lambda: world.admin.fetchval(
        "SELECT lease_expires_at < clock_timestamp() FROM export_jobs WHERE id = $1", job_id), bool, timeout=30,
        what="the lease lapsed")
    # The recovery run on a queue no export workflow is on, so nothing resumes the build before the takeover.
    await world.released_worker(task_queue="recovery-only")
    recovery_id = f"recovery-{uuid.uuid4().hex[:8]}"
    report = await asyncio.wait_for(world.client.execute_workflow(
        "RecoveryWorkflow", {"limit": 100}, id=recovery_id, task_queue="recovery-only"), 60)
    assert [t["recorded"] for t in report["taken_over"]] == ["RequeuedByRecovery"], report
    await world.released_worker()
    result = await closed(world, job_id, timeout=90)
    assert result["status"] == "Completed"
    await record_export(world, job_id, "export_requeued_by_recovery")
    await record(world, recovery_id, "recovery_requeued_one")


async def test_export_busy_cancel(world: ReleaseWorld):
    """A raw cancel that finds the row locked answers Busy and records nothing; the export goes on."""
    await world.released_worker(**SLOW_BUILD)
    job_id = await create(world)
    await reaches(world, job_id, "Running")
    async with world.admin.transaction():
        await world.admin.execute("SELECT 1 FROM export_jobs WHERE id = $1 FOR UPDATE", job_id)
        await signal_cancel(world, job_id)
        await activity_completed(world, job_id, "record_cancellation")
    assert (await closed(world, job_id))["status"] == "Completed"
    await record_export(world, job_id, "export_busy_cancel")


async def test_export_too_late_cancel_during_delivery(world: ReleaseWorld):
    await world.released_worker(**SLOW_UPLOAD)
    job_id = await create(world)
    await reaches(world, job_id, "Delivering")
    await signal_cancel(world, job_id)  # raw: the workflow records it, and learns TooLate
    await activity_completed(world, job_id, "record_cancellation")
    assert (await closed(world, job_id))["status"] == "Completed"
    await record_export(world, job_id, "export_too_late_cancel_during_delivery")


async def test_export_woken_during_delivery(world: ReleaseWorld):
    """A wake-up (an outbox row published while the upload runs) reaches the run during the delivery."""
    await world.released_worker(**SLOW_UPLOAD)
    job_id = await create(world)
    await reaches(world, job_id, "Delivering")
    await world.client.get_workflow_handle(export_workflow_id(job_id)).signal(
        "wake", {"message_id": str(uuid.uuid4())})
    assert (await closed(world, job_id))["status"] == "Completed"
    await record_export(world, job_id, "export_woken_during_delivery")


async def test_sweeper_swept_one(world: ReleaseWorld):
    # A queued job whose only wake-up was published to no one, last woken 31 minutes ago: created while no worker
    # (and so no dispatcher) runs, its outbox row then marked published.
    job_id = await create(world)
    await world.admin.execute("UPDATE outbox SET published_at = clock_timestamp() WHERE job_id = $1", job_id)
    await world.admin.execute("UPDATE export_jobs SET woken_at = clock_timestamp() - interval '31 minutes' "
                              "WHERE id = $1", job_id)
    await world.released_worker()
    sweep_id = f"sweep-{uuid.uuid4().hex[:8]}"
    swept = await asyncio.wait_for(world.client.execute_workflow(
        "SweeperWorkflow", {"threshold_seconds": 1800, "batch": 10}, id=sweep_id, task_queue="exports"), 60)
    assert swept == 1
    assert (await closed(world, job_id))["status"] == "Completed"
    await record(world, sweep_id, "sweeper_swept_one")
