"""The world a release left behind, for the upgrade tests and the release recorder: a database migrated by that
release's own `exports migrate`, a Temporal dev server of its own whose namespace has only the search attributes
that release registered, a partner and a seeded tenant. Today's code then meets it as a deploy would."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
from temporalio.client import Client, WorkflowExecutionDescription
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment

from starter.localstack import processes
from starter.localstack.partner import LocalPartner
from store.db import asyncpg_dsn
from store.settings import Settings
from tests.helpers.namespaces import namespace_with
from tests.helpers.releases import ROOT, ReleaseCode
from tests.helpers.support import Ran, eventually, exports_command, process_env, seed_tenant
from workflows.identity import export_workflow_id

# Every process of a world, whichever release: seconds, not minutes, so that a lease lapses while a test watches.
FAST = dict(lease_seconds=5.0, renew_every_seconds=1.0, heartbeat_throttle_seconds=0.2, dispatcher_poll_seconds=0.5,
            reread_timeout_seconds=2.0, lock_timeout_ms=3000, recovery_interval_seconds=1.0,
            sweeper_interval_seconds=60.0, idle_recheck_seconds=5.0, http_port=0)
# What the release says it registers: where today's code keeps it, else where 0.1.0 did.
_ATTRIBUTES_OF_RELEASE = """
import json
try:
    from workflows.identity import search_attribute_kinds
    kinds = search_attribute_kinds()
except ImportError:
    from starter.localstack.temporal import SEARCH_ATTRIBUTES as kinds
print(json.dumps(kinds))
"""


@dataclass
class ReleaseWorker:
    """A worker process of some release's code; SIGTERM is a deploy's stop, SIGKILL a crash."""

    process: asyncio.subprocess.Process
    log_path: Path

    async def terminate(self, bound: float = 60) -> int:
        """SIGTERM, as a deploy stops a pod, and the exit status once the process has shut down."""
        self.process.terminate()
        return await asyncio.wait_for(self.process.wait(), bound)

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@dataclass
class ReleaseWorld:
    code: ReleaseCode
    admin: asyncpg.Connection  # the server's superuser on this world's database: arranging and asserting only
    database: str
    urls: dict[str, str]
    temporal: WorkflowEnvironment
    partner: LocalPartner
    tenant_id: uuid.UUID
    destination_id: uuid.UUID
    work_dir: Path
    settings_overrides: dict[str, object]
    release_attributes: dict[str, str] = field(default_factory=dict)  # the release's search attributes, by name
    workers: list[ReleaseWorker] = field(default_factory=list)

    @property
    def client(self) -> Client:
        return self.temporal.client

    def settings(self, **overrides: object) -> Settings:
        """Settings for every process of this world, whichever release runs it (a release ignores what it does
        not know)."""
        values = {**self.urls, "temporal_address": self.client.service_client.config.target_host,
                  "work_dir": self.work_dir, **self.settings_overrides, **overrides}
        return Settings(_env_file=None, **values)

    async def released_worker(self, **overrides: object) -> ReleaseWorker:
        """A worker process of the release's own code."""
        log_path = self.work_dir / f"worker-{self.code.release.version}-{uuid.uuid4().hex[:6]}.log"
        process = await self.code.spawn_worker(self.settings(**overrides), log_path)
        worker = ReleaseWorker(process, log_path)
        self.workers.append(worker)
        return worker

    async def todays_command(self, *args: str, bound: float = 60, **overrides: object) -> Ran:
        """This checkout's `exports` command line, on this world."""
        return await exports_command(self.settings(**overrides), *args, cwd=ROOT, bound=bound)

    async def todays_worker(self, **overrides: object) -> ReleaseWorker:
        """A worker process of this checkout's code."""
        log_path = self.work_dir / f"worker-today-{uuid.uuid4().hex[:6]}.log"
        process = await processes.spawn(sys.executable, "-m", "worker", log_path=log_path,
                                        env=process_env(self.settings(**overrides)), cwd=str(ROOT))
        worker = ReleaseWorker(process, log_path)
        self.workers.append(worker)
        return worker


@asynccontextmanager
async def release_world(code: ReleaseCode, pg_server, tmp_path: Path, **settings_overrides: object
                        ) -> AsyncIterator[ReleaseWorld]:
    """The release's world, torn down on the way out: every worker process killed, the database dropped."""
    async with AsyncExitStack() as stack:
        database = f"rel_{uuid.uuid4().hex[:12]}"
        admin = await asyncpg.connect(asyncpg_dsn(pg_server.url("owner")))
        try:
            await admin.execute(f"CREATE DATABASE {database}")
        finally:
            await admin.close()

        async def drop() -> None:
            conn = await asyncpg.connect(asyncpg_dsn(pg_server.url("owner")))
            try:
                await conn.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
            finally:
                await conn.close()

        stack.push_async_callback(drop)
        urls = pg_server.urls(database)
        bootstrap = Settings(_env_file=None, **urls)
        migrated = await code.command("migrate", settings=bootstrap, bound=120)
        assert migrated.code == 0, f"release {code.release.version}'s migrate failed: {migrated!r}"

        kinds = await code.python(_ATTRIBUTES_OF_RELEASE, settings=bootstrap)
        assert kinds.code == 0, kinds
        release_attributes = json.loads(kinds.stdout)
        temporal = await stack.enter_async_context(namespace_with(release_attributes))

        partner = LocalPartner(tmp_path / "partner")
        await asyncio.wait_for(partner.start(), 30)
        stack.push_async_callback(partner.stop)
        dest = partner.destination()
        admin = await asyncpg.connect(asyncpg_dsn(pg_server.url("owner", database)))
        stack.push_async_callback(admin.close)
        tenant_id, destination_id = await seed_tenant(admin, contacts=300, destination=dict(
            host=dest.host, port=dest.port, username=dest.username, final_dir=dest.final_dir,
            temp_dir=dest.temp_dir, host_key=dest.host_key, credential_ref=dest.credential_ref))
        world = ReleaseWorld(code=code, admin=admin, database=database, urls=urls, temporal=temporal,
                             partner=partner, tenant_id=tenant_id, destination_id=destination_id,
                             work_dir=tmp_path / "work", settings_overrides=settings_overrides,
                             release_attributes=release_attributes)

        async def stop_workers() -> None:
            for worker in world.workers:
                worker.kill()
            for worker in world.workers:
                await asyncio.wait_for(worker.process.wait(), 15)

        stack.push_async_callback(stop_workers)
        try:
            yield world
        except BaseException:
            for worker in world.workers:  # shown by pytest with the failure: what each worker process said
                print(f"--- {worker.log_path.name} (last 60 lines) ---")
                print("\n".join(worker.log().splitlines()[-60:]))
            raise


# --- what an operator does, with the release's own command line or raw Temporal calls ------------------------

async def create(world: ReleaseWorld, *, bound: float = 60) -> uuid.UUID:
    """`exports create` of the release that runs this world; its worker's dispatcher starts the workflow."""
    ran = await world.code.command("create", "--tenant", str(world.tenant_id), "--destination",
                                   str(world.destination_id), "--created-by", "release-tests",
                                   settings=world.settings(), bound=bound)
    assert ran.code == 0, ran
    return uuid.UUID(ran.stdout.strip().splitlines()[-1])


async def cancel(world: ReleaseWorld, job_id: uuid.UUID, *, reason: str = "wrong list") -> Ran:
    """`exports cancel` of the release: the row write, then the signal."""
    return await world.code.command("cancel", str(job_id), "--tenant", str(world.tenant_id), "--operator",
                                    "ops@example.com", "--reason", reason, settings=world.settings())


async def signal_cancel(world: ReleaseWorld, job_id: uuid.UUID, *, reason: str = "sent raw") -> uuid.UUID:
    """A cancel signal sent raw, as from the Temporal UI: the workflow records it through an activity."""
    request_id = uuid.uuid4()
    await world.client.get_workflow_handle(export_workflow_id(job_id)).signal("cancel", {
        "request_id": str(request_id), "tenant_id": str(world.tenant_id), "requested_by": "ops@example.com",
        "reason": reason})
    return request_id


async def status(world: ReleaseWorld, job_id: uuid.UUID) -> str | None:
    return await world.admin.fetchval("SELECT status FROM export_jobs WHERE id = $1", job_id)


async def reaches(world: ReleaseWorld, job_id: uuid.UUID, *statuses: str, timeout: float = 60) -> str:
    return await eventually(lambda: status(world, job_id), lambda s: s in statuses, timeout=timeout, interval=0.1,
                            what=f"export {job_id} {' or '.join(statuses)}")


async def closed(world: ReleaseWorld, job_id: uuid.UUID, *, timeout: float = 60) -> dict:
    """The run's result once it closed, as JSON (the release's own result model may differ from today's)."""
    await eventually(lambda: described(world, job_id), bool, timeout=timeout, interval=0.2,
                     what=f"the workflow of {job_id} started")
    handle = world.client.get_workflow_handle(export_workflow_id(job_id))
    return await asyncio.wait_for(handle.result(), timeout)


async def described(world: ReleaseWorld, job_id: uuid.UUID) -> WorkflowExecutionDescription | None:
    """The export's latest run as Temporal describes it, or None before the dispatcher has started it."""
    try:
        return await world.client.get_workflow_handle(export_workflow_id(job_id)).describe()
    except RPCError as err:
        if err.status is not RPCStatusCode.NOT_FOUND:
            raise
        return None


async def activity_in_flight(world: ReleaseWorld, job_id: uuid.UUID, activity_type: str | tuple[str, ...], *,
                             beyond_attempt: int = 0, started_after: datetime | None = None,
                             timeout: float = 30) -> int:
    """Wait until the run has this activity (or one of these) pending (scheduled or started, not yet completed) in
    an attempt past `beyond_attempt`, or, with `started_after`, started since then (a retry, or the step asked
    again as a new activity); that attempt's number."""
    types = (activity_type,) if isinstance(activity_type, str) else activity_type

    def counts(a: Any) -> bool:
        if started_after is None:
            return True
        return a.HasField("last_started_time") and a.last_started_time.ToDatetime(tzinfo=UTC) >= started_after

    async def attempts() -> list[int]:
        description = await described(world, job_id)
        return [] if description is None else [a.attempt for a in description.raw_description.pending_activities
                                                if a.activity_type.name in types and counts(a)]

    found = await eventually(attempts, lambda found: any(a > beyond_attempt or started_after for a in found),
                             timeout=timeout,
                             interval=0.1, what=f"{activity_type} of {job_id} in flight past attempt {beyond_attempt}")
    return max(found)


def completed_activity(history_events: list, activity_type: str) -> bool:
    """Whether an activity of this type completed in these events."""
    scheduled = {e.event_id for e in history_events
                 if e.activity_task_scheduled_event_attributes.activity_type.name == activity_type}
    return any(e.activity_task_completed_event_attributes.scheduled_event_id in scheduled for e in history_events
               if e.HasField("activity_task_completed_event_attributes"))


async def histories(world: ReleaseWorld) -> dict[str, list]:
    """Every workflow run of this world's namespace and its events."""
    found = {}
    async for execution in world.client.list_workflows():
        handle = world.client.get_workflow_handle(execution.id, run_id=execution.run_id)
        found[f"{execution.id}/{execution.run_id}"] = (await handle.fetch_history()).events
    return found
