"""Records this release's histories, which test_replay.py replays from then on. Run it with `make histories`.

`make test` does not collect this module (pytest collects test_*.py files only); named on the command line, it
runs each case against the real components, the way the suite's own tests produce that outcome, checks that the
run ended as the case says, and writes the run's history to histories/<version>/<case>.json, the version being
pyproject.toml's. A version that CHANGELOG.md dates is released: its folder is never written again, by this code
or later code (docs/changing-workflows.md). Earlier releases' folders stay as their own code recorded them.
"""

from __future__ import annotations

import asyncio
import uuid
from contextlib import AsyncExitStack

import pytest
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.service import RPCError

from activities import checkpoints
from activities.contracts import (
    FollowUpInput,
    FollowUpReport,
    PartnerSweepOutput,
    RecoveryInput,
    RecoveryReport,
    SweepInput,
)
from store.db import asyncpg_dsn
from store.models import CancellationOutcome, CancellationResult, Status
from tests.helpers.crash import (
    claim_waiting_for_a_build_slot,
    crash_world,
    processes,
    recorded_for,
    recovery_only_worker,
    start_worker,
    wait_lease_expired,
)
from tests.helpers.faults import CLAIM_STATEMENT, fault_proxy
from tests.helpers.harness import (
    Harness,
    building,
    delivering,
    held_at,
    open_harness,
    release_held,
    stranded_in_queued,
    unknown_original,
)
from tests.helpers.own_temporal import own_server
from tests.helpers.releases import current_version, is_released
from tests.helpers.standins import (
    pause_at_every_chance,
    pauses_before_continuing,
    records_patch,
    temporal_cancel_before_the_row,
    woken_while_recording_a_cancel,
)
from tests.helpers.support import eventually, lock_row, unlock_row
from tests.replay.history_files import save
from worker import running_worker
from workflows import patches
from workflows.identity import export_workflow_id

VERSION = current_version()


@pytest.fixture(autouse=True)
def unreleased() -> None:
    if is_released(VERSION):
        pytest.fail(f"{VERSION} is released (CHANGELOG.md dates it): its histories are kept as recorded. Set the "
                    "next version in pyproject.toml, with an (unreleased) entry in CHANGELOG.md, first")


async def record(client: Client, workflow_id: str, case: str) -> None:
    save(VERSION, case, await client.get_workflow_handle(workflow_id).fetch_history())


async def record_export(h: Harness, job_id: uuid.UUID, case: str) -> None:
    await record(h.client, export_workflow_id(job_id), case)


async def test_export_completed(harness: Harness):
    job_id = await harness.create()
    assert (await harness.settled(job_id)).status is Status.COMPLETED
    await record_export(harness, job_id, "export_completed")


async def test_export_stopped_by_cancel(slow_build_harness: Harness):
    h = slow_build_harness
    job_id = await h.create()
    await building(h, job_id)
    result = await h.exports.cancel(tenant_id=h.tenant_id, job_id=job_id, requested_by="ops@example.com",
                                    reason="wrong list")
    assert result.outcome is CancellationOutcome.STOP_REQUESTED
    assert (await h.settled(job_id)).status is Status.STOPPED
    await record_export(h, job_id, "export_stopped_by_cancel")


async def test_export_stopped_by_cancel_update(slow_build_harness: Harness, monkeypatch):
    """The cancel-update branch, as the release that activates it writes it: a malformed Update refused (no
    trace), a valid one accepted and answered, the same request asked again and answered from the run."""
    monkeypatch.setattr(patches, "ACTIVE", patches.ACTIVE | {patches.CANCEL_UPDATE})
    h = slow_build_harness
    job_id = await h.create()
    await building(h, job_id)
    handle = h.client.get_workflow_handle(export_workflow_id(job_id))
    with pytest.raises(WorkflowUpdateFailedError):
        await handle.execute_update("cancel", {"request_id": "junk"})
    request = {"request_id": str(uuid.uuid4()), "tenant": str(h.tenant_id), "operator": "ann@example.com",
               "reason": "wrong list"}
    answer = await handle.execute_update("cancel", request, result_type=CancellationResult)
    assert answer.outcome is CancellationOutcome.STOP_REQUESTED
    assert await handle.execute_update("cancel", request, result_type=CancellationResult) == answer
    assert (await h.settled(job_id)).status is Status.STOPPED
    await record_export(h, job_id, "export_stopped_by_cancel_update")


async def test_export_stopped_by_temporal_cancel(slow_build_harness: Harness):
    h = slow_build_harness
    job_id = await h.create()
    await building(h, job_id)
    await h.client.get_workflow_handle(export_workflow_id(job_id)).cancel()
    assert (await h.settled(job_id)).status is Status.STOPPED
    await record_export(h, job_id, "export_stopped_by_temporal_cancel")


async def test_export_canceled_while_queued(db, store, client, tmp_path):
    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path, in_process_worker=False)
        job_id = await h.create()
        result = await h.exports.cancel(tenant_id=h.tenant_id, job_id=job_id, requested_by="ops@example.com",
                                        reason="not this week")
        assert result.outcome is CancellationOutcome.CANCELED_WHILE_QUEUED
        # The worker (and its dispatcher) only now: the workflow starts on a row that is already Canceled.
        async with running_worker(h.settings, h.client):
            # The row is settled already: wait for the dispatcher's start of the workflow before its result.
            await eventually(lambda: h.db.admin.fetchval(
                "SELECT count(*) FROM outbox WHERE job_id = $1 AND published_at IS NULL", job_id),
                lambda unpublished: unpublished == 0, timeout=30, what=f"the wake-up of {job_id} published")
            assert (await h.settled(job_id)).status is Status.CANCELED
        await record_export(h, job_id, "export_canceled_while_queued")


async def test_export_canceled_while_claiming(db, store, client, tmp_path):
    """The canceled-while-claiming branch, as the release that activates it writes it: the claim, waiting for the
    only build slot, given up once the recorded cancellation left the row Canceled, and the row read at once."""
    async with crash_world(db, store, client, tmp_path) as h, processes(h) as started:
        await start_worker(started, h, hold_at=checkpoints.BUILD_STARTED, max_builds=1,
                           early_patches=patches.CANCELED_WHILE_CLAIMING)
        first, second = await claim_waiting_for_a_build_slot(h)
        try:
            result = await h.exports.cancel(tenant_id=h.tenant_id, job_id=second, requested_by="ops@example.com",
                                            reason="not this week")
            assert result.outcome is CancellationOutcome.CANCELED_WHILE_QUEUED
            assert (await h.settled(second)).status is Status.CANCELED
            await record_export(h, second, "export_canceled_while_claiming")
        finally:
            release_held(h.settings, checkpoints.BUILD_STARTED, first)


async def test_export_temporal_cancel_while_claiming(db, store, client, tmp_path):
    """The same branch reached by Temporal's cancel before the run has read its row: the request asked for the
    start's tenant at once, then the claim given up and the row read."""
    async with crash_world(db, store, client, tmp_path) as h, processes(h) as started:
        await start_worker(started, h, hold_at=checkpoints.BUILD_STARTED, max_builds=1,
                           early_patches=patches.CANCELED_WHILE_CLAIMING)
        first, second = await claim_waiting_for_a_build_slot(h)
        try:
            await h.client.get_workflow_handle(export_workflow_id(second)).cancel()
            assert (await h.settled(second)).status is Status.CANCELED
            await record_export(h, second, "export_temporal_cancel_while_claiming")
        finally:
            release_held(h.settings, checkpoints.BUILD_STARTED, first)


async def record_stopped_once_recorded(h: Harness, handle, job_id: uuid.UUID, case: str) -> None:
    """Once the run has recorded a stop request for the waiting attempt: the attempt stops, the run is woken (no
    dispatcher here) and returns Stopped, and its history is recorded as `case`."""
    row = await eventually(lambda: h.store.read_job(job_id), lambda r: r.stop_request_id is not None,
                           timeout=60, interval=0.2, what="the stop request recorded")
    assert await h.store.finish_stopped(job_id, row.attempt_id, "build")
    await handle.signal("wake", {"message_id": str(uuid.uuid4())})
    assert (await h.settled(job_id)).status is Status.STOPPED
    await record_export(h, job_id, case)


async def test_export_temporal_cancel_asked_until_recorded(db, store, client, tmp_path):
    """The temporal-cancel-until-recorded branch: Temporal's cancel finds the row locked past the five tries any Busy
    request gets, is asked again after longer pauses, and is recorded once the row is free; the attempt then stops
    and the run returns Stopped."""
    from tests.workflows.test_cancel_update import _waiting_run
    from tests.workflows.test_temporal_cancel_kept import _asks

    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path, dispatcher=False, lock_timeout_ms=200,
                               early_patches=patches.TEMPORAL_CANCEL_UNTIL_RECORDED)
        job_id, handle = await _waiting_run(h)
        locker = await lock_row(asyncpg_dsn(h.db.url("owner")), job_id)
        try:
            await handle.cancel()
            await eventually(lambda: _asks(handle), lambda n: n >= 7, timeout=60, interval=0.5,
                             what="Temporal's cancel asked past its five tries")
        finally:
            await unlock_row(locker)
        await record_stopped_once_recorded(h, handle, job_id, "export_temporal_cancel_asked_until_recorded")


async def test_export_busy_signal_sent_again(db, store, client, tmp_path):
    """The busy-signal-sent-again branch: a cancel signal finds the row locked through its five tries and is given
    up; sent again with the same request ID, it is asked with all its tries, and recorded once the row is free; the
    attempt then stops and the run returns Stopped."""
    from tests.workflows.test_cancel_update import _waiting_run
    from tests.workflows.test_temporal_cancel_kept import asked_again_while_locked, given_up_as_busy_then_sent_again

    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path, dispatcher=False, lock_timeout_ms=200,
                               early_patches=patches.BUSY_SIGNAL_SENT_AGAIN)
        job_id, handle = await _waiting_run(h)
        async with AsyncExitStack() as locked:
            await given_up_as_busy_then_sent_again(h, job_id, handle, locked)
            await asked_again_while_locked(handle)
        await record_stopped_once_recorded(h, handle, job_id, "export_busy_signal_sent_again")


async def test_export_rejected(harness: Harness):
    await harness.db.admin.execute("UPDATE destinations SET enabled = false WHERE id = $1", harness.destination_id)
    job_id = await harness.create()
    assert (await harness.settled(job_id)).status is Status.REJECTED
    await record_export(harness, job_id, "export_rejected")


async def test_export_outcome_unknown(harness: Harness):
    job_id, _ = await unknown_original(harness)
    await record_export(harness, job_id, "export_outcome_unknown")


async def test_export_resumed_after_crash(db, store, client, tmp_path):
    """The building worker is killed; another resumes the build under the same attempt and delivers."""
    async with crash_world(db, store, client, tmp_path) as h, processes(h) as started:
        crashing = await start_worker(started, h, hold_at="build_started")
        job_id = await h.create()
        await held_at(h.settings, "build_started", job_id)
        await start_worker(started, h)
        crashing.kill()
        row = await h.settled(job_id)
        assert (row.status, row.attempt_count) == (Status.COMPLETED, 1)
        await record_export(h, job_id, "export_resumed_after_crash")


async def test_export_requeued_by_recovery_and_recovery_run(db, store, client, tmp_path):
    """The building worker is killed while no other runs; recovery requeues the attempt, and a new worker's
    second attempt delivers. Records both the export and the recovery run that took it over."""
    async with crash_world(db, store, client, tmp_path) as h, processes(h) as started:
        crashing = await start_worker(started, h, hold_at="build_started")
        job_id = await h.create()
        await held_at(h.settings, "build_started", job_id)
        crashing.kill()
        await wait_lease_expired(h, job_id)
        recovery_id = f"recovery-{uuid.uuid4().hex[:8]}"
        async with recovery_only_worker(h) as queue:
            report = await asyncio.wait_for(h.client.execute_workflow(
                "RecoveryWorkflow", RecoveryInput(limit=h.settings.recovery_batch), id=recovery_id,
                task_queue=queue, result_type=RecoveryReport), timeout=30)
        assert recorded_for(report, job_id) == ["RequeuedByRecovery"]
        await start_worker(started, h)
        row = await h.settled(job_id)
        assert (row.status, row.attempt_count) == (Status.COMPLETED, 2)
        await record_export(h, job_id, "export_requeued_by_recovery")
        await record(h.client, recovery_id, "recovery_requeued_one")


async def test_sweeper_swept_one(harness: Harness):
    h = harness
    job_id = await stranded_in_queued(h)
    sweep_id = f"sweep-{uuid.uuid4().hex[:8]}"
    swept = await asyncio.wait_for(h.client.execute_workflow(
        "SweeperWorkflow", SweepInput(threshold_seconds=1800, batch=10), id=sweep_id,
        task_queue=h.settings.task_queue, result_type=int), timeout=30)
    assert swept == 1
    assert (await h.settled(job_id)).status is Status.COMPLETED
    await record(h.client, sweep_id, "sweeper_swept_one")


async def test_partner_sweep(harness: Harness):
    sweep_id = f"partner-sweep-{uuid.uuid4().hex[:8]}"
    swept = await asyncio.wait_for(harness.client.execute_workflow(
        "PartnerSweepWorkflow", id=sweep_id, task_queue=harness.settings.task_queue,
        result_type=list[PartnerSweepOutput]), timeout=30)
    assert [s.destination_id for s in swept] == [harness.destination_id]
    await record(harness.client, sweep_id, "partner_sweep_one_destination")


async def test_follow_up_confirmed_one(harness: Harness):
    """An OutcomeUnknown export whose file is at the partner, settled by the evidence follow-up's read-back."""
    h = harness
    job_id, _ = await unknown_original(h)
    follow_up_id = f"follow-up-{uuid.uuid4().hex[:8]}"
    report = await asyncio.wait_for(h.client.execute_workflow(
        "EvidenceFollowUpWorkflow", FollowUpInput(limit=10, window_seconds=3600), id=follow_up_id,
        task_queue=h.settings.task_queue, result_type=FollowUpReport), timeout=60)
    assert (report.looked, report.confirmed) == (1, 1)
    await record(h.client, follow_up_id, "follow_up_confirmed_one")


# --- the branches and timers that the cases above do not walk (UP5) ----------------------------------------------


async def test_export_claim_unknown_then_claimed(db, store, client, tmp_path):
    """The claim's statement never reaches the server and the re-read finds the row untouched: Unknown, the
    5-second timer, and a claim on the next read."""
    async with fault_proxy(db.server) as proxy, crash_world(db, store, client, tmp_path) as h, \
            processes(h) as started:
        cut = proxy.cut_before(CLAIM_STATEMENT)
        await start_worker(started, h, database_url=proxy.url("exports_app", db.name))
        job_id = await h.create()
        row = await h.settled(job_id)
        assert cut.is_set() and (row.status, row.attempt_count) == (Status.COMPLETED, 1)
        await record_export(h, job_id, "export_claim_unknown_then_claimed")


async def test_export_idle_recheck(db, store, client, tmp_path):
    """A run finds its row held by another attempt and waits for a wake-up that never comes: its idle re-check
    fires, reads the row again, and claims it once the other attempt has let it go."""
    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path, in_process_worker=False,
                               idle_recheck_seconds=2.0)
        job_id = await h.create()
        # Another attempt holds the row (written as the owner, who is exempt from the event rules).
        await h.db.admin.execute(
            "UPDATE export_jobs SET status = 'Running', attempt_id = $2, attempt_count = 1, version = version + 1, "
            "claimed_by = 'elsewhere', lease_expires_at = clock_timestamp() + interval '1 hour' WHERE id = $1",
            job_id, uuid.uuid4())
        async with running_worker(h.settings, h.client):
            handle = h.client.get_workflow_handle(export_workflow_id(job_id))

            async def events() -> list:
                try:
                    return (await handle.fetch_history()).events
                except RPCError:  # not started yet: the dispatcher publishes the wake-up first
                    return []

            await eventually(events, lambda evs: any(e.HasField("timer_fired_event_attributes") for e in evs),
                             timeout=30, interval=0.2, what="the idle re-check fired")
            # Let go without a wake-up, as an attempt requeued by hand would be.
            await h.db.admin.execute(
                "UPDATE export_jobs SET status = 'Queued', attempt_id = NULL, claimed_by = NULL, "
                "lease_expires_at = NULL, version = version + 1 WHERE id = $1", job_id)
            row = await h.settled(job_id)
        assert (row.status, row.attempt_count) == (Status.COMPLETED, 2)
        await record_export(h, job_id, "export_idle_recheck")


async def test_export_busy_cancel_retried(slow_build_harness: Harness):
    """A raw cancel that finds the row locked answers Busy, is asked again after its timer, and stops the build."""
    h = slow_build_harness
    job_id = await h.create()
    await building(h, job_id)
    locker = await lock_row(asyncpg_dsn(h.db.url("owner")), job_id)
    try:
        await h.client.get_workflow_handle(export_workflow_id(job_id)).signal("cancel", {
            "request_id": str(uuid.uuid4()), "tenant": str(h.tenant_id), "operator": "ann@example.com"})
        handle = h.client.get_workflow_handle(export_workflow_id(job_id))
        await eventually(lambda: handle.fetch_history(),
                         lambda history: any(e.HasField("timer_started_event_attributes") for e in history.events),
                         timeout=30, interval=0.1, what="the Busy answer's retry timer")
    finally:
        await unlock_row(locker)
    assert (await h.settled(job_id)).status is Status.STOPPED
    await record_export(h, job_id, "export_busy_cancel_retried")


async def test_export_woken_during_delivery(slow_upload_harness: Harness):
    h = slow_upload_harness
    job_id = await h.create()
    await delivering(h, job_id)
    await h.client.get_workflow_handle(export_workflow_id(job_id)).signal("wake", {"message_id": str(uuid.uuid4())})
    assert (await h.settled(job_id)).status is Status.COMPLETED
    await record_export(h, job_id, "export_woken_during_delivery")


async def test_export_too_late_cancel_during_delivery(slow_upload_harness: Harness):
    h = slow_upload_harness
    job_id = await h.create()
    await delivering(h, job_id)
    # Raw, as from the UI: the run records it itself and learns TooLate while the upload runs.
    handle = h.client.get_workflow_handle(export_workflow_id(job_id))
    await handle.signal("cancel", {"request_id": str(uuid.uuid4()), "tenant": str(h.tenant_id),
                                   "operator": "ann@example.com", "reason": "too late"})
    assert (await h.settled(job_id)).status is Status.COMPLETED
    assert await h.db.admin.fetchval("SELECT outcome FROM cancellation_requests WHERE job_id = $1",
                                     job_id) == CancellationOutcome.TOO_LATE.value
    await record_export(h, job_id, "export_too_late_cancel_during_delivery")


async def test_export_woken_while_recording_a_cancel(client: Client):
    """The wake-after-settled branch: the run has read its row settled and records a cancellation when a
    correction's wake-up arrives; it reads the row again before it returns. Its steps are stand-ins."""
    handle, result, _ = await woken_while_recording_a_cancel(client)
    assert result.status is Status.COMPLETED
    save(VERSION, "export_woken_while_recording_a_cancel", await handle.fetch_history())


async def test_export_cancel_before_continuing_as_new(tmp_path):
    """The cancel-before-continuing-as-new branch, without pause-once-before-continuing-as-new: Temporal's cancel
    reaches a run whose claim failed in one task with the signals that make Temporal suggest continuing as new; the
    run pauses, sees the cancel, records it once its row is read, then pauses again and continues as new. Its steps
    are stand-ins."""
    async with own_server(tmp_path, {"limit.historyCount.suggestContinueAsNew": 20}) as client:
        run = await temporal_cancel_before_the_row(client, cancel_comes="with-signals",
                                                   activates=pause_at_every_chance)
    assert run.marked and run.recorded == ["temporal-cancel"], (run.recorded, run.runs)
    save(VERSION, "export_cancel_before_continuing_as_new", run.first_run)


async def test_export_pause_once_before_continuing_as_new(tmp_path):
    """The pause-once-before-continuing-as-new branch: the same run pauses once, sees the cancel, waits what is
    left of its idle recheck, records the cancel once its row is read, and then continues as new with no second
    pause. Its steps are stand-ins."""
    async with own_server(tmp_path, {"limit.historyCount.suggestContinueAsNew": 20}) as client:
        run = await temporal_cancel_before_the_row(client, cancel_comes="with-signals")
    assert run.marked and run.recorded == ["temporal-cancel"], (run.recorded, run.runs)
    assert pauses_before_continuing(run.first_run) == 1, pauses_before_continuing(run.first_run)
    assert records_patch(run.first_run, patches.PAUSE_ONCE_BEFORE_CONTINUING_AS_NEW)
    save(VERSION, "export_pause_once_before_continuing_as_new", run.first_run)
