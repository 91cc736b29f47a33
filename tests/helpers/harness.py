"""A worker, a partner and a seeded tenant for one test, on a task queue of its own."""

from __future__ import annotations

import asyncio
import signal
import sys
import uuid
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

from temporalio.client import Client

from activities.contracts import ExportResult, RecoveryInput, RecoveryReport
from activities.exports import ExportActivities
from starter.client import ExportsClient
from starter.localstack import processes
from starter.localstack.partner import LocalPartner
from store import outbox
from store.jobs import JobStore
from store.models import JobRow, Status
from store.settings import Settings
from tests.helpers.partner import outbound
from tests.helpers.support import built_files, eventually, process_env, seed_tenant
from worker import running_worker
from workflows.identity import export_workflow_id

SETTLE_TIMEOUT = 60.0


@dataclass
class Harness:
    db: object
    store: JobStore
    client: Client
    partner: LocalPartner
    settings: Settings
    tenant_id: uuid.UUID
    destination_id: uuid.UUID
    exports: ExportsClient
    # The in-process worker's activities (None without one): a test may replace `.checkpoints` to hold them.
    activities: ExportActivities | None = None

    async def store_create(self) -> uuid.UUID:
        """Creation as the starter does it: the row and its outbox row; the dispatcher does the rest."""
        return await self.exports.create(tenant_id=self.tenant_id, destination_id=self.destination_id,
                                         created_by="tests")

    async def create(self) -> uuid.UUID:
        return await self.store_create()

    async def settled(self, job_id: uuid.UUID) -> JobRow:
        """The row once settled, after the workflow has returned it."""
        row = await eventually(lambda: self.store.read_job(job_id), lambda r: r is not None and r.status.is_settled,
                               timeout=SETTLE_TIMEOUT, interval=0.1, what=f"export {job_id} settled")
        handle = self.client.get_workflow_handle(export_workflow_id(job_id), result_type=ExportResult)
        result = await asyncio.wait_for(handle.result(), timeout=SETTLE_TIMEOUT)
        assert result.status is row.status, (result, row.status)
        return await self.store.read_job(job_id)


async def open_harness(stack: AsyncExitStack, db, store: JobStore, client: Client, tmp_path: Path, *,
                       dispatcher: bool = True, in_process_worker: bool = True, contacts: int = 200,
                       **overrides: object) -> Harness:
    partner = LocalPartner(tmp_path / "partner")
    await partner.start()
    stack.push_async_callback(partner.stop)
    dest = partner.destination()
    tenant_id, destination_id = await seed_tenant(db.admin, contacts=contacts, destination=dict(
        host=dest.host, port=dest.port, username=dest.username, final_dir=dest.final_dir, temp_dir=dest.temp_dir,
        host_key=dest.host_key, credential_ref=dest.credential_ref))
    settings = db.settings(task_queue=f"exports-{uuid.uuid4().hex[:10]}", work_dir=tmp_path / "work",
                           temporal_address=client.service_client.config.target_host, **overrides)
    activities = None
    if in_process_worker:
        activities = await stack.enter_async_context(running_worker(settings, client, with_dispatcher=dispatcher))
    exports = ExportsClient(store, client, task_queue=settings.task_queue)
    return Harness(db=db, store=store, client=client, partner=partner, settings=settings, tenant_id=tenant_id,
                   destination_id=destination_id, exports=exports, activities=activities)


async def set_contract(h: Harness, **columns: object) -> None:
    """Changes the harness's destination's columns (its contract with the partner) in place."""
    for column, value in columns.items():
        await h.db.admin.execute(f"UPDATE destinations SET {column} = $1 WHERE id = $2", value, h.destination_id)


# --- arranged states of one export ---------------------------------------------------------------------------


async def stranded_in_queued(h: Harness) -> uuid.UUID:
    """A queued job whose only wake-up was lost (its outbox row marked published, no workflow got it), last woken
    31 minutes ago: past the sweeper's default threshold (30 minutes). The outbox's lock is held meanwhile, so
    that a harness's running dispatcher cannot publish the creation's wake-up first."""
    job_id = uuid.uuid4()
    await h.db.admin.execute("SELECT pg_advisory_lock($1)", outbox.LOCK_KEY)
    try:
        await h.store.create_job(job_id=job_id, tenant_id=h.tenant_id, destination_id=h.destination_id,
                                 delivery_key=job_id.hex, created_by="tests")
        await h.db.admin.execute("UPDATE outbox SET published_at = clock_timestamp() WHERE job_id = $1", job_id)
    finally:
        await h.db.admin.execute("SELECT pg_advisory_unlock($1)", outbox.LOCK_KEY)
    await h.db.admin.execute("UPDATE export_jobs SET woken_at = clock_timestamp() - interval '31 minutes' "
                             "WHERE id = $1", job_id)
    return job_id


async def delivering(h: Harness, job_id: uuid.UUID, timeout: float = 30.0) -> None:
    """Wait until the export is Delivering: cutoff 2 committed, the upload under way."""
    await eventually(lambda: h.store.read_job(job_id), lambda r: r.status is Status.DELIVERING, timeout=timeout,
                     what=f"export {job_id} Delivering")


async def building(h: Harness, job_id: uuid.UUID, timeout: float = 20.0) -> uuid.UUID:
    """Wait until the export is Running and its build is writing the local file, which the build opens only once
    its stop watcher is listening. Returns the attempt ID."""
    row = await eventually(lambda: h.store.read_job(job_id), lambda r: r is not None and r.status is Status.RUNNING,
                           timeout=timeout, what=f"export {job_id} Running")
    await eventually(lambda: asyncio.sleep(0, built_files(h.settings.work_dir, job_id, row.attempt_id)), bool,
                     timeout=timeout,
                     what=f"the build of {job_id} writing")
    row = await h.store.read_job(job_id)
    assert row.status is Status.RUNNING, "the build ended before the test could stop it; slow it down"
    return row.attempt_id


async def unknown_original(h: Harness) -> tuple[uuid.UUID, bytes]:
    """An original whose upload landed but whose connection dropped right after the rename: OutcomeUnknown,
    with its file at the partner."""
    async def drop(old: str, new: str) -> None:
        h.partner.close_connections()

    h.partner.hooks.after_rename = drop
    try:
        original = await h.create()
        row = await h.settled(original)
    finally:
        h.partner.hooks.after_rename = None
    assert row.status is Status.OUTCOME_UNKNOWN
    return original, (outbound(h.partner) / row.final_name).read_bytes()


# --- worker processes and recovery ----------------------------------------------------------------------------


class WorkerProcess:
    """A real worker process (`python -m worker`) for crash tests: SIGKILL is a real crash."""

    def __init__(self, settings: Settings, **overrides: object) -> None:
        self.settings = settings.model_copy(update=overrides)
        self.process: asyncio.subprocess.Process | None = None

    async def start(self) -> WorkerProcess:
        self.log_path = Path(self.settings.work_dir) / f"worker-{uuid.uuid4().hex[:6]}.log"
        self.process = await processes.spawn(
            sys.executable, "-m", "worker", log_path=self.log_path, env=process_env(self.settings),
            cwd=str(Path(__file__).resolve().parents[2]))
        return self

    def kill(self) -> None:
        """SIGKILL: no shutdown, no final writes, exactly like a crash."""
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signal.SIGKILL)

    async def stop(self) -> None:
        await processes.stop(self.process, timeout=15)


async def held_at(settings: Settings, checkpoint: str, job_id: uuid.UUID, timeout: float = 30.0) -> None:
    """Wait until a worker process started with hold_at=checkpoint holds this export there."""
    marker = Path(settings.work_dir) / f"held-{checkpoint}-{job_id}"
    await eventually(lambda: asyncio.sleep(0, marker.exists()), bool, timeout=timeout,
                     what=f"export {job_id} held at {checkpoint}")


def release_held(settings: Settings, checkpoint: str, job_id: uuid.UUID) -> None:
    """Let the export that a worker process holds at `checkpoint` go on."""
    (Path(settings.work_dir) / f"release-{checkpoint}-{job_id}").touch()


async def run_recovery(client: Client, settings: Settings) -> RecoveryReport:
    """One recovery run, as its schedule starts it, on the test's task queue."""
    return await client.execute_workflow(
        "RecoveryWorkflow", RecoveryInput(limit=settings.recovery_batch), id=f"recovery-{uuid.uuid4().hex[:8]}",
        task_queue=settings.task_queue, result_type=RecoveryReport)
