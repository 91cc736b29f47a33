"""LV5: the wake-up that the read after a cutoff 2 given up writes for a row it found Queued and claimable.

The run resets `woken` right before that read. The recovery take-back that queued the row wrote an outbox row of
its own; if the dispatcher signalled it while cutoff 2 was still in flight (the reset spent it) but had not yet
marked it published when the read ran (a wave still publishing, or a mark lost to a blip, so the row is sent again
under a message ID the run has seen), a read that wrote a wake-up only where none was unpublished wrote nothing,
and the run claimed only at its idle recheck (5 minutes; found by review). The read's wake-up is now always
written (wake_run.sql).

Real workflow code, real PostgreSQL (claim, recovery's take-back, the given-up read and its wake-up, the outbox and
the real dispatcher pass); only the build and cutoff 2 are stand-ins.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import asyncssh
import pytest
from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker

from activities.contracts import (
    Admission,
    AdmitInput,
    ClaimOutput,
    Evaluation,
    ExportInput,
    ExportResult,
    Wake,
)
from activities.exports import ExportActivities
from activities.process.dispatcher import OutboxDispatcher
from store.db import asyncpg_dsn, make_engine
from store.models import ClaimResult, Status
from store.outbox import Outbox
from store.recovery import Recovery
from tests.helpers.standins import cutoff_2_given_up_steps
from tests.helpers.store_states import expire
from tests.helpers.support import create_job, eventually, seed_tenant
from workflows import patches
from workflows.export import ExportWorkflow
from workflows.identity import admission_queue, export_workflow_id

# Far below the idle recheck (300 s): a woken run claims within a second or two.
CLAIM_BOUND = 20.0


async def _history_has(handle, event_type, bound: float = 30.0) -> None:
    async def types() -> set:
        return {event.event_type async for event in handle.fetch_history_events()}

    await eventually(types, lambda found: event_type in found, timeout=bound, interval=0.1,
                     what=f"{event_type} in the run's history")


@pytest.mark.parametrize("signalled_before_read", [True, False],
                         ids=["recovery-row-signalled-before-read", "recovery-row-published-after-read"])
@pytest.mark.spec("LV5")
async def test_the_run_is_woken_after_a_given_up_read_finds_its_row_queued(db, store, app_engine, client,
                                                                            signalled_before_read: bool):
    host_key = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()
    tenant_id, destination_id = await seed_tenant(db.admin, destination={
        "host": "127.0.0.1", "port": 22, "username": "exports", "final_dir": "/outbound",
        "temp_dir": "/incoming-tmp", "host_key": host_key, "credential_ref": "file:/none"})
    queue = f"wake-{uuid.uuid4().hex[:8]}"
    settings = db.settings(task_queue=queue, max_builds=4, max_uploads=4)
    real = ExportActivities(store, settings, worker_id="worker-test", worker_task_queue=queue)
    job_id = await create_job(store, tenant_id, destination_id)
    # The creation's wake-up is out of the way (published): the only outbox rows are the ones this test makes.
    await db.admin.execute("UPDATE outbox SET published_at = clock_timestamp() WHERE job_id = $1", job_id)

    authorize_may_fail = asyncio.Event()
    admission_claims: list[float] = []
    given_up_read_done: list[float] = []

    @activity.defn(name="claim_if_allowed")
    async def shared_claim_if_allowed(request: AdmitInput) -> Admission:
        if request.given_up is not None:  # the real read after the give-up (marks, and writes the wake-up)
            answer = await real.claim_if_allowed(request)
            given_up_read_done.append(time.monotonic())
            return answer
        raise ApplicationError("not expected on the shared queue", non_retryable=True)

    first_claim = True

    @activity.defn(name="claim_if_allowed")
    async def admission_claim_if_allowed(request: AdmitInput) -> Admission:
        nonlocal first_claim
        row = await store.read_job(job_id)
        if first_claim:  # the run's first claim: a real one (claim.sql)
            first_claim = False
            assert await store.claim(job_id, row.version, request.attempt_id, "worker-test") is ClaimResult.CLAIMED
            row = await store.read_job(job_id)
            return Admission(evaluation=Evaluation(row=row, allowed=True),
                             claim=ClaimOutput(result=ClaimResult.CLAIMED, worker_task_queue=queue,
                                               lease_seconds=30), attempt=1)
        # The claim after the woken run: recorded; the export is then ended (a settled row) so the run closes.
        admission_claims.append(time.monotonic())
        return Admission(evaluation=Evaluation(row=row.model_copy(update={"status": Status.CANCELED})))

    engine = make_engine(db.url("dispatcher"))
    dispatcher = OutboxDispatcher(client, Outbox(engine), asyncpg_dsn(db.url("dispatcher")), task_queue=queue,
                                  poll_seconds=0.2)
    recovery = Recovery(app_engine, max_attempts=3)
    try:
        async with Worker(client, task_queue=queue, workflows=[ExportWorkflow],
                          activities=[shared_claim_if_allowed, *cutoff_2_given_up_steps(queue, authorize_may_fail)],
                          patch_activation_callback=patches.activates), \
                Worker(client, task_queue=admission_queue(queue), activities=[admission_claim_if_allowed]):
            handle = await client.start_workflow(ExportWorkflow.run, ExportInput(job_id=job_id),
                                                 id=export_workflow_id(job_id), task_queue=queue,
                                                 result_type=ExportResult)
            await _history_has(handle, EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED)  # claim
            deadline = time.monotonic() + 30
            while (await store.read_job(job_id)).status is not Status.RUNNING:
                assert time.monotonic() < deadline, "never claimed"
                await asyncio.sleep(0.1)
            attempt = (await store.read_job(job_id)).attempt_id
            # The worker at cutoff 2 is gone: recovery takes the attempt back (Queued, and its own outbox row).
            await asyncio.sleep(1)  # cutoff 2 in flight
            await expire(db, job_id)
            assert await recovery.take_back(job_id, attempt, "test-recovery") == "RequeuedByRecovery"
            (recovery_row,) = await db.admin.fetch(
                "SELECT message_id FROM outbox WHERE job_id = $1 AND published_at IS NULL", job_id)
            if signalled_before_read:
                # The dispatcher publishes that row (the very signal-with-start it sends) while cutoff 2 is still in
                # flight; its mark comes only after its wave (or is lost, and the row published again).
                await dispatcher.publish(recovery_row["message_id"], job_id, tenant_id)
                await _history_has(handle, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED)
            # Temporal gives cutoff 2 up; the run reads the row naming the attempt, on the shared queue.
            authorize_may_fail.set()
            deadline = time.monotonic() + 30
            while not given_up_read_done:
                assert time.monotonic() < deadline, "the read after the give-up never ran"
                await asyncio.sleep(0.1)
            outbox_after_read = await db.admin.fetch(
                "SELECT message_id, published_at FROM outbox WHERE job_id = $1 ORDER BY created_at", job_id)
            # The dispatcher's pass goes on: whatever is unpublished is published and marked.
            for _ in range(3):
                await dispatcher.dispatch_once()
            deadline = time.monotonic() + CLAIM_BOUND
            while not admission_claims and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            claimed_in_bound = list(admission_claims)
            # Close the run either way (a wake-up by hand, as an operator would), so the test leaves nothing open.
            if not admission_claims:
                await handle.signal("wake", Wake(message_id=uuid.uuid4()))
            await asyncio.wait_for(handle.result(), 60)
    finally:
        await real.close()
        await engine.dispose()
    assert claimed_in_bound, (
        f"the run did not claim within {CLAIM_BOUND:g} s of the read after the give-up: no wake-up reached it "
        f"(outbox rows at the read's end: {[(str(r['message_id']), r['published_at']) for r in outbox_after_read]}, "
        f"recovery's row {recovery_row['message_id']}); it would wait its idle recheck "
        f"({settings.idle_recheck_seconds:g} s)")
    assert claimed_in_bound[0] - given_up_read_done[0] < CLAIM_BOUND
