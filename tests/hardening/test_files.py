"""Files of a dead attempt do not linger (matrix LK4): built files on a worker's disk, and our temporary files at
the partner, against real PostgreSQL, a real worker on the Temporal dev server and the local SFTP partner."""

from __future__ import annotations

import os
import time
import uuid

import pytest

from activities.contracts import PartnerSweepOutput
from activities.partner_delivery import temp_file_name
from store.jobs import build_holder
from store.models import Status
from tests.helpers.harness import Harness
from tests.helpers.store_states import drive
from tests.helpers.support import create_job, eventually, seed_tenant
from worker import running_worker

DAY = 86400.0


@pytest.mark.spec("LK4")
async def test_a_running_worker_removes_built_files_no_attempt_can_use_within_its_interval(db, store, client,
                                                                                         tmp_path):
    tenant_id, destination_id = await seed_tenant(db.admin)
    live = await create_job(store, tenant_id, destination_id)
    settled = await create_job(store, tenant_id, destination_id)
    live_attempt = await drive(store, live, Status.RUNNING)
    # Holders as builds write them; the file's name ends with the holder's last part.
    holder, fenced = build_holder("worker-x", 1), build_holder("worker-y", 0)
    assert await store.start_build(live, live_attempt, holder, "resumed (1)", generation=1)
    settled_attempt = await drive(store, settled, Status.COMPLETED)
    work = tmp_path / "work"
    settings = db.settings(task_queue=f"exports-{uuid.uuid4().hex[:8]}", work_dir=work,
                           scavenge_interval_seconds=0.5)
    async with running_worker(settings, client, with_dispatcher=False):
        # Left behind after the worker started, so only its periodic pass can find them.
        work.mkdir(exist_ok=True)
        token = holder.rpartition("/")[2]
        keep = work / f"{live}-{live_attempt}-{token}.csv"  # the build that holds the live attempt
        stale = [work / f"{live}-{live_attempt}-{fenced.rpartition('/')[2]}.csv",  # a fenced build of it
                 work / f"{live}-{live_attempt}-9f9f.csv",  # a build of an earlier release, fenced
                 work / f"{settled}-{settled_attempt}-{token}.csv",  # an attempt that ended
                 work / f"{uuid.uuid4()}-{uuid.uuid4()}-77.csv"]  # a job that does not exist
        for path in (keep, *stale):
            path.write_text("email,first_name\n")
        started = time.monotonic()
        await eventually(lambda: _exists(stale), lambda found: not found, timeout=10, interval=0.1,
                         what="the stale built files removed")
        assert time.monotonic() - started < 5  # within a few intervals, not at the next start
        assert keep.exists()


async def _exists(paths: list) -> list:
    return [p for p in paths if p.exists()]


@pytest.mark.spec("LK4")
async def test_partner_sweep_removes_only_old_temporary_files_of_attempts_that_ended(quiet_harness: Harness):
    h = quiet_harness
    temp = h.partner.root / "incoming-tmp"
    ended_job = await create_job(h.store, h.tenant_id, h.destination_id)
    ended = await drive(h.store, ended_job, Status.COMPLETED)
    live_job = await create_job(h.store, h.tenant_id, h.destination_id)
    live = await drive(h.store, live_job, Status.DELIVERING)
    young_job = await create_job(h.store, h.tenant_id, h.destination_id)
    young = await drive(h.store, young_job, Status.OUTCOME_UNKNOWN)
    row = await h.store.read_job(ended_job)
    contract_age = await h.db.admin.fetchval("SELECT temp_file_max_age_seconds FROM destinations WHERE id = $1",
                                             h.destination_id)
    old = time.time() - contract_age - DAY
    files = {
        "ended": (temp_file_name(row.final_name, ended), old),
        "unknown attempt": (temp_file_name(row.final_name, uuid.uuid4()), old),
        "live": (temp_file_name((await h.store.read_job(live_job)).final_name, live), old),
        "young": (temp_file_name((await h.store.read_job(young_job)).final_name, young),
                  time.time() - contract_age + DAY),
        "not ours": ("upload-in-progress.tmp", old),
        "no export of ours": (temp_file_name("contacts-gone.csv", uuid.uuid4()), old),
    }
    for name, mtime in files.values():
        (temp / name).write_bytes(b"partial contact data")
        os.utime(temp / name, (mtime, mtime))

    swept = await h.client.execute_workflow("PartnerSweepWorkflow", id=f"partner-sweep-{uuid.uuid4().hex[:8]}",
                                            task_queue=h.settings.task_queue, result_type=list[PartnerSweepOutput])

    remaining = sorted(p.name for p in temp.iterdir())
    assert remaining == sorted(files[k][0] for k in ("live", "young", "not ours", "no export of ours"))
    [report] = [s for s in swept if s.destination_id == h.destination_id]
    assert sorted(report.removed) == sorted(files[k][0] for k in ("ended", "unknown attempt"))
    assert report.failed == [] and report.error is None
    assert sorted(report.kept) == sorted(files[k][0] for k in ("live", "young"))
