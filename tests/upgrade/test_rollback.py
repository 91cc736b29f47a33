"""A rollback from this release to the previous one (case UP3), by the procedure CHANGELOG.md gives: runs this
release touched carry patch markers the previous release cannot replay, and its schema is newer than the previous
release can write, so the deployment is drained first.

With exports in flight on this release's worker (one building, one waiting on a locked row), the procedure: restart
the workers with the dispatcher off (EXPORTS_DISPATCHER_ENABLED=false), wait until no export run is open (exports
created meanwhile wait in the database), remove the schedules whose workflow the previous release lacks (`exports
schedules remove`, as CHANGELOG.md names them), stop the workers, `exports migrate --to` the previous release's
revision, start the previous release's worker. Then nothing is left open, every export settles, and the previous
release's worker fails no workflow task.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from temporalio.api.enums.v1 import EventType

from starter.schedules import schedules
from store.db import asyncpg_dsn
from store.settings import Settings
from tests.helpers.release_world import (
    FAST,
    ReleaseWorld,
    closed,
    described,
    histories,
    reaches,
    release_world,
)
from tests.helpers.releases import (
    ReleaseCode,
    current_version,
    rollback_declared_unsupported,
    rollback_removes_schedules,
)
from tests.helpers.support import eventually, lock_row, unlock_row
from tests.replay.history_files import HISTORIES, load, patch_ids, workflow_type
from workflows import patches

BOUND = 120.0
OPEN_EXPORT_RUNS = "WorkflowType = 'ExportWorkflow' AND ExecutionStatus = 'Running'"


async def open_export_runs(world: ReleaseWorld) -> int:
    return (await world.client.count_workflows(OPEN_EXPORT_RUNS)).count


async def todays_create(world: ReleaseWorld) -> uuid.UUID:
    ran = await world.todays_command("create", "--tenant", str(world.tenant_id), "--destination",
                                     str(world.destination_id), "--created-by", "release-tests")
    assert ran.code == 0, ran
    return uuid.UUID(ran.stdout.strip().splitlines()[-1])


async def schema_revision(world: ReleaseWorld) -> str:
    return await world.admin.fetchval("SELECT version_num FROM alembic_version")


@pytest.mark.spec("UP3")
@pytest.mark.timeout(300)
async def test_rollback__drained_by_the_documented_procedure_the_previous_release_finishes_everything(
        previous: ReleaseCode, pg_server, tmp_path: Path):
    async with release_world(previous, pg_server, tmp_path, **FAST) as world:
        released_revision = await schema_revision(world)
        # The upgrade, as CHANGELOG.md says it.
        for step in (("migrate",), ("setup",), ("schedules", "install")):
            ran = await world.todays_command(*step, bound=BOUND)
            assert ran.code == 0, ran
        current = await world.todays_worker(build_throttle_bytes_per_second=5000)
        done = await todays_create(world)
        assert (await closed(world, done))["status"] == "Completed"
        building = await todays_create(world)
        await reaches(world, building, "Running")
        waiting = await todays_create(world)
        # Its run waits for a row that a long transaction holds.
        lock = await lock_row(asyncpg_dsn(world.urls["owner_database_url"]), waiting)
        try:

            await eventually(lambda: open_export_runs(world), lambda n: n == 2, timeout=30, interval=0.2,
                             what="the building and the waiting exports' runs open")

            # 1. The workers again, with the dispatcher off: the runs already open go on; no new one starts.
            assert await current.terminate(bound=BOUND) == 0, current.log()[-3000:]
            await world.todays_worker(dispatcher_enabled=False)
            created_while_draining = [await todays_create(world), await todays_create(world)]
            await asyncio.sleep(1)
        finally:
            await unlock_row(lock)

        # 2. Drained: no export run open. The exports created meanwhile wait in the database.
        await eventually(lambda: open_export_runs(world), lambda n: n == 0, timeout=BOUND, interval=0.5,
                         what="no export run open")
        for job_id in created_while_draining:
            assert await world.admin.fetchval("SELECT status FROM export_jobs WHERE id = $1", job_id) == "Queued"
            assert await described(world, job_id) is None  # no run: nothing this release would have to finish

        # 3. The schedules whose workflow the previous release does not know: removed, as CHANGELOG.md says.
        removed = rollback_removes_schedules(previous.release)
        if removed:
            ran = await world.todays_command("schedules", "remove", *removed, bound=BOUND)
            assert ran.code == 0, ran

        # 4. Stopped, and the schema back where the previous release left it.
        for worker in world.workers:
            if worker.process.returncode is None:
                assert await worker.terminate(bound=BOUND) == 0, worker.log()[-3000:]
        ran = await world.todays_command("migrate", "--to", released_revision, bound=BOUND)
        assert ran.code == 0, ran
        assert await schema_revision(world) == released_revision

        # 5. The previous release: its dispatcher starts the waiting exports, and everything settles.
        rolled_back = await world.released_worker()
        statuses = {job_id: (await closed(world, job_id, timeout=BOUND))["status"]
                    for job_id in (done, building, waiting, *created_while_draining)}
        assert set(statuses.values()) == {"Completed"}, statuses
        await eventually(lambda: open_export_runs(world), lambda n: n == 0, timeout=30, interval=0.5,
                         what="no export run open after the rollback")
        assert rolled_back.process.returncode is None, rolled_back.log()[-3000:]

        for run, events in (await histories(world)).items():
            failed = [e for e in events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED]
            assert not failed, f"{run}: {failed[0].workflow_task_failed_event_attributes.failure.message}"


@pytest.mark.spec("UP3")
async def test_rollback__the_previous_release_replays_the_runs_this_one_recorded(previous: ReleaseCode):
    """Rolled back by one release, the previous release's workers replay the runs this one wrote. Where CHANGELOG.md
    says that rollback is not supported (and how to drain first), the replay must fail as it says: an unexpected
    pass fails this test, so the note never outlives its reason."""
    recorded = sorted((HISTORIES / current_version()).glob("*.json"))
    assert recorded, f"no histories of {current_version()}: run `make histories`"
    # The workflows of schedules the rollback removes first are new in this release: the previous one must
    # refuse their histories as unknown types, and only so, or the note has outlived its reason.
    dropped = {schedules(Settings(_env_file=None))[i].action.workflow  # type: ignore[attr-defined]
               for i in rollback_removes_schedules(previous.release)}
    new_types = [path for path in recorded if workflow_type(load(path)) in dropped]
    if new_types:
        refused = await previous.replay(new_types)
        assert len(refused) == len(new_types) and all("not registered" in f for f in refused), refused
        recorded = [path for path in recorded if path not in new_types]
    # A case recorded with a patch this release only understands is the next release's run (recorded with the patch
    # activated, as that release writes it): this release never writes its marker (tests/replay/test_patches.py),
    # so a rollback from this release never meets it.
    ahead = [path for path in recorded if patch_ids(load(path)) & patches.UNDERSTOOD]
    recorded = [path for path in recorded if path not in ahead]
    failures = await previous.replay(recorded)
    if rollback_declared_unsupported(previous.release):
        assert failures, f"CHANGELOG.md says a rollback to {previous.release.version} needs a drain, yet its " \
                         "code replays every history of this release: correct the note"
        assert any("TMPRL1100" in failure or "not registered" in failure for failure in failures), failures
    else:
        assert not failures, "\n".join(failures)
