"""Crash tests' machinery: a world with no in-process export worker, worker processes that a test starts and
kills, recovery on a queue of its own, and waits for a dead worker's lease to lapse."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType
from temporalio.api.workflowservice.v1 import ResetStickyTaskQueueRequest
from temporalio.client import WorkflowHistory
from temporalio.service import RPCError, RPCStatusCode

from activities import checkpoints
from activities.contracts import RecoveryInput, RecoveryReport
from tests.helpers.harness import Harness, WorkerProcess, held_at, open_harness
from tests.helpers.lease import LEASE, RENEW
from tests.helpers.support import eventually
from tests.helpers.tcp_cut import TcpCutProxy
from worker import running_worker
from workflows.identity import export_workflow_id

# --- the world of one crash test --------------------------------------------------------------------------------


@asynccontextmanager
async def crash_world(db, store, client, tmp_path, *, lease_seconds: float = LEASE,
                      **overrides: object) -> AsyncIterator[Harness]:
    """A tenant and a partner, no in-process export worker: the test starts (and kills) worker processes. The
    lease is short so that recovery may take a dead worker's attempt over within seconds."""
    async with AsyncExitStack() as stack:
        yield await open_harness(stack, db, store, client, tmp_path, in_process_worker=False,
                                 **{"lease_seconds": lease_seconds, "renew_every_seconds": RENEW, **overrides})


@asynccontextmanager
async def processes(h: Harness) -> AsyncIterator[list[WorkerProcess]]:
    """Every worker process a test starts is appended here and killed on the way out, whatever happened."""
    started: list[WorkerProcess] = []
    try:
        yield started
    except BaseException:
        for process in started:  # shown by pytest with the failure: what each worker process said
            log_path = getattr(process, "log_path", None)
            if log_path is not None and log_path.exists():
                print(f"--- {log_path.name} (last 60 lines) ---")
                print("\n".join(log_path.read_text(errors="replace").splitlines()[-60:]))
        raise
    finally:
        for process in started:
            process.kill()
        for process in started:
            if process.process is not None:
                await asyncio.wait_for(process.process.wait(), timeout=15)


async def start_worker(started: list[WorkerProcess], h: Harness, **overrides: object) -> WorkerProcess:
    process = await WorkerProcess(h.settings, **overrides).start()
    started.append(process)
    return process


@asynccontextmanager
async def recovery_only_worker(h: Harness) -> AsyncIterator[str]:
    """A live worker for the recovery workflow on a queue of its own (no dispatcher): it never sees the export
    workflow, so nothing resumes the dead worker's build before the takeover commits."""
    queue = f"{h.settings.task_queue}-recovery"
    settings = h.settings.model_copy(update={"task_queue": queue})
    async with running_worker(settings, h.client, with_dispatcher=False):
        yield queue


async def recover_on(h: Harness, queue: str) -> RecoveryReport:
    return await asyncio.wait_for(h.client.execute_workflow(
        "RecoveryWorkflow", RecoveryInput(limit=h.settings.recovery_batch), id=f"recovery-{uuid.uuid4().hex[:8]}",
        task_queue=queue, result_type=RecoveryReport), timeout=30)


async def forget_dead_worker(h: Harness, job_id: uuid.UUID) -> None:
    """After a SIGKILL, Temporal keeps the export's workflow tasks on the dead worker's sticky queue for 10 s
    before it falls back to the shared queue. Only to save those seconds, ask now, as a graceful shutdown would.
    This changes when another worker sees the workflow, never what the row allows."""
    await h.client.workflow_service.reset_sticky_task_queue(ResetStickyTaskQueueRequest(
        namespace=h.client.namespace, execution=WorkflowExecution(workflow_id=export_workflow_id(job_id))))


def recorded_for(report: RecoveryReport, job_id: uuid.UUID) -> list[str | None]:
    return [t.recorded for t in report.taken_over if t.job_id == job_id]


async def lease_expired(h: Harness, job_id: uuid.UUID) -> bool:
    return await h.db.admin.fetchval(
        "SELECT lease_expires_at < clock_timestamp() FROM export_jobs WHERE id = $1", job_id)


async def wait_lease_expired(h: Harness, job_id: uuid.UUID) -> None:
    await eventually(lambda: lease_expired(h, job_id), bool, timeout=20, interval=0.1,
                     what="the dead worker's lease expired")


async def held_with_temporal_down(h: Harness, started: list[WorkerProcess], temporal: TcpCutProxy,
                                  checkpoint: str) -> uuid.UUID:
    """A new export held at `checkpoint` on a worker that reaches Temporal only through `temporal`, whose way there
    then goes down (PostgreSQL and the partner still answer it); a second worker carries the run on at once (the
    held worker's cached run is forgotten). The export's ID."""
    await start_worker(started, h, hold_at=checkpoint, max_builds=1, temporal_address=f"127.0.0.1:{temporal.port}")
    job_id = await h.create()
    await held_at(h.settings, checkpoint, job_id)
    temporal.go_down()
    await start_worker(started, h)
    await forget_dead_worker(h, job_id)
    return job_id


async def claim_waiting_for_a_build_slot(h: Harness) -> tuple[uuid.UUID, uuid.UUID]:
    """With a worker of one build slot held at `build_started` running: a first export holds that slot, and a second
    export's claim is scheduled on the admission queue, where no worker takes it. Both exports' IDs."""
    first = await h.create()
    await held_at(h.settings, checkpoints.BUILD_STARTED, first)
    second = await h.create()

    async def scheduled() -> list[str]:
        history = await export_history(h, second)
        return [e.activity_task_scheduled_event_attributes.activity_type.name for e in history.events
                if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED] if history is not None else []

    await eventually(scheduled, lambda names: names == ["claim_if_allowed"], timeout=30, interval=0.2,
                     what="the second export's claim waiting for a build slot")
    return first, second


async def export_history(h: Harness, job_id: uuid.UUID) -> WorkflowHistory | None:
    """The export workflow's history, or None before its run has started (the dispatcher has not published the
    creation's wake-up yet)."""
    try:
        return await h.client.get_workflow_handle(export_workflow_id(job_id)).fetch_history()
    except RPCError as err:
        if err.status is RPCStatusCode.NOT_FOUND:
            return None
        raise
