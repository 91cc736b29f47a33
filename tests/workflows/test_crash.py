"""Crashes of real worker processes (SIGKILL) and lost database responses, end to end on Temporal.

Every worker that builds runs as its own process (`python -m worker`), held at a named checkpoint and killed there.
Recovery, where a test needs it to run while no export worker is alive, runs in this process on a task queue of
its own: that worker polls no export workflow, so the export's Temporal state cannot move (and cannot resume a
build) until the test starts the next export worker. The row in PostgreSQL and the files at the partner are the
authority for every assertion; the workflow's history only shows which activities ran.
"""

from __future__ import annotations

import asyncio
import hashlib
import signal
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from temporalio.api.enums.v1 import EventType, TimeoutType
from temporalio.api.history.v1 import HistoryEvent

from activities import checkpoints
from activities.contracts import (
    Admission,
    AttemptInput,
    BuildOutput,
    ClaimOutput,
    ExportResult,
)
from store.models import ClaimResult, FailureCode, Status
from tests.helpers.crash import (
    crash_world,
    export_history,
    forget_dead_worker,
    held_with_temporal_down,
    processes,
    recorded_for,
    recover_on,
    recovery_only_worker,
    start_worker,
    wait_lease_expired,
)
from tests.helpers.events import events, kinds
from tests.helpers.faults import CLAIM_STATEMENT, PgFaultProxy, fault_proxy
from tests.helpers.harness import Harness, held_at, release_held, run_recovery
from tests.helpers.partner import outbound_names
from tests.helpers.support import eventually
from tests.helpers.tcp_cut import TcpCutProxy, temporal_upstream
from workflows.identity import EXPORT_STATUS, export_workflow_id

# --- reading the workflow's history ------------------------------------------------------------------------------


@dataclass
class ActivityRun:
    name: str
    task_queue: str
    input: Any
    outcome: str | None = None  # completed, failed, timed_out, canceled; None while open
    result: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


_INPUTS = {"build": AttemptInput}
_RESULTS = {"build": BuildOutput, "claim_if_allowed": Admission}


async def activity_runs(h: Harness, job_id: uuid.UUID) -> list[ActivityRun]:
    """The export workflow's activities in scheduling order, with decoded inputs and results where useful."""
    history = await export_history(h, job_id)
    if history is None:
        return []
    converter = h.client.data_converter.payload_converter
    runs: dict[int, ActivityRun] = {}

    def decode(payloads, type_):  # type: ignore[no-untyped-def]
        return converter.from_payloads(payloads, [type_])[0] if type_ is not None and payloads else None

    e: HistoryEvent
    for e in history.events:
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            a = e.activity_task_scheduled_event_attributes
            name = a.activity_type.name
            runs[e.event_id] = ActivityRun(name, a.task_queue.name, decode(a.input.payloads, _INPUTS.get(name)))
        elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            a = e.activity_task_completed_event_attributes
            run = runs[a.scheduled_event_id]
            run.outcome, run.result = "completed", decode(a.result.payloads, _RESULTS.get(run.name))
        elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED:
            runs[e.activity_task_failed_event_attributes.scheduled_event_id].outcome = "failed"
        elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT:
            a = e.activity_task_timed_out_event_attributes
            run = runs[a.scheduled_event_id]
            run.outcome = "timed_out"
            run.extra["timeout"] = a.failure.timeout_failure_info.timeout_type
        elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_CANCELED:
            runs[e.activity_task_canceled_event_attributes.scheduled_event_id].outcome = "canceled"
    return list(runs.values())


def claims(runs: list[ActivityRun]) -> list[ClaimOutput]:
    """The claims the policy-and-claim steps made (a step that found nothing to claim made none)."""
    return [r.result.claim for r in named(runs, "claim_if_allowed") if r.result is not None and r.result.claim]


def named(runs: list[ActivityRun], name: str) -> list[ActivityRun]:
    return [r for r in runs if r.name == name]


# --- TW2: a worker killed mid-build --------------------------------------------------------------------------------


@pytest.mark.spec("TW2")
async def test_worker_killed_mid_build__resumed_elsewhere_under_the_same_attempt(crash_harness):
    h = crash_harness
    async with processes(h) as started:
        a = await start_worker(started, h, hold_at="build_started")
        job_id = await h.create()
        await held_at(h.settings, "build_started", job_id)
        held = await h.store.read_job(job_id)
        assert held.status is Status.RUNNING and held.attempt_count == 1
        attempt_id, claimed_by = held.attempt_id, held.claimed_by
        await start_worker(started, h)  # worker B: holds nowhere; it polls the shared queue and its own
        a.kill()
        row = await h.settled(job_id)

    # The same attempt, resumed: no takeover, no second claim.
    assert row.status is Status.COMPLETED
    assert (row.attempt_id, row.attempt_count) == (attempt_id, 1)
    evts = await events(h.db, job_id)
    assert kinds(evts, attempt_id, evidence_once=True) == [
        "Claimed", "BuildStarted", "BuildStarted", "DeliveryAuthorized", "DeliveryEvidence", "Finished"]
    # The resumed build took the attempt's build slot from the dead one, and the events say which worker did.
    builds = [e["worker_id"] for e in evts if e["kind"] == "BuildStarted"]
    assert builds[0] == claimed_by and builds[1] == row.claimed_by != claimed_by
    assert {e["attempt_id"] for e in evts} == {attempt_id}
    # Delivered by worker B: the evidence carries the worker that uploaded, not the one that claimed.
    uploaders = {e["observed_by"].split("/")[0] for e in evts if e["kind"] == "DeliveryEvidence"}
    assert len(uploaders) == 1 and claimed_by not in uploaders
    assert outbound_names(h.partner) == [row.final_name]

    builds = named(await activity_runs(h, job_id), "build")
    assert [b.input.attempt_id for b in builds] == [attempt_id] * 3
    first, returned, resumed = builds
    assert first.extra["timeout"] == TimeoutType.TIMEOUT_TYPE_HEARTBEAT
    assert first.outcome == "timed_out" and first.task_queue.startswith(f"{h.settings.task_queue}-")
    # First back to the same worker, which might hold a finished file (OU4); nobody polls there any more.
    assert returned.task_queue == first.task_queue and returned.outcome == "timed_out"
    assert returned.extra["timeout"] == TimeoutType.TIMEOUT_TYPE_SCHEDULE_TO_START
    assert resumed.task_queue == h.settings.task_queue and resumed.outcome == "completed"
    assert resumed.result.file is not None


@pytest.mark.spec("LV6")
async def test_worker_killed_mid_build__resumed_within_a_lease_and_a_recovery_interval(db, store, client, tmp_path):
    """The killed worker's build is noticed by its heartbeat timeout (one lease). The run's next task then waits on
    the dead worker's sticky queue, and the build looks on that worker's own queue first (a live worker takes it at
    once): neither may cost a whole lease more. The build resumes elsewhere within one lease plus one recovery
    interval of the kill, without recovery's help. The sticky timeout keeps its default's ratio to the lease
    (10 s of 60 s)."""
    lease = 8.0
    async with crash_world(db, store, client, tmp_path, lease_seconds=lease, renew_every_seconds=1.0,
                           recovery_interval_seconds=lease / 2, sticky_queue_timeout_seconds=lease / 6) as h, \
            processes(h) as started:
        a = await start_worker(started, h, hold_at="build_started")
        job_id = await h.create()
        await held_at(h.settings, "build_started", job_id)
        held = await h.store.read_job(job_id)
        await start_worker(started, h)
        await asyncio.sleep(1.0)  # the survivor polls
        a.kill()
        killed_at = asyncio.get_running_loop().time()
        resumed = await eventually(lambda: events(h.db, job_id),
                                   lambda found: kinds(found, held.attempt_id).count("BuildStarted") == 2,
                                   timeout=4 * lease, interval=0.1, what=f"the build of {job_id} resumed")
        took = asyncio.get_running_loop().time() - killed_at
        row = await h.settled(job_id)
    assert [e["worker_id"] for e in resumed if e["kind"] == "BuildStarted"][1] != held.claimed_by
    assert took <= lease + h.settings.recovery_interval_seconds, took
    assert (row.status, row.attempt_id, row.attempt_count) == (Status.COMPLETED, held.attempt_id, 1)
    assert outbound_names(h.partner) == [row.final_name]


@pytest.mark.spec("TW2")
async def test_worker_killed_mid_build__after_a_takeover_the_resumed_build_writes_nothing(crash_harness):
    h = crash_harness
    async with processes(h) as started:
        a = await start_worker(started, h, hold_at="build_started")
        job_id = await h.create()
        await held_at(h.settings, "build_started", job_id)
        first_attempt = (await h.store.read_job(job_id)).attempt_id
        a.kill()  # no export worker is alive now: the build cannot resume before the takeover
        await wait_lease_expired(h, job_id)
        async with recovery_only_worker(h) as queue:
            report = await recover_on(h, queue)
        assert recorded_for(report, job_id) == ["RequeuedByRecovery"]
        requeued = await h.store.read_job(job_id)
        assert (requeued.status, requeued.attempt_id, requeued.attempt_count) == (Status.QUEUED, None, 1)

        await start_worker(started, h)  # worker B: resumes the old build first, then claims again
        row = await h.settled(job_id)

    assert row.status is Status.COMPLETED and row.attempt_count == 2
    second_attempt = row.attempt_id
    assert second_attempt not in (None, first_attempt)
    evts = await events(h.db, job_id)
    # The old attempt wrote nothing after the takeover; the new one ran once, to its end.
    assert kinds(evts, first_attempt, evidence_once=True) == ["Claimed", "BuildStarted", "RequeuedByRecovery"]
    assert kinds(evts, second_attempt, evidence_once=True) == [
        "Claimed", "BuildStarted", "DeliveryAuthorized", "DeliveryEvidence", "Finished"]
    assert [e["kind"] for e in evts if e["kind"] in ("Claimed", "Finished")] == ["Claimed", "Claimed", "Finished"]
    assert outbound_names(h.partner) == [row.final_name]

    runs = await activity_runs(h, job_id)
    builds = named(runs, "build")
    assert [b.input.attempt_id for b in builds] == [first_attempt] * 3 + [second_attempt]
    # The dead worker's build, then its return to that worker's queue (OU4), both timed out.
    assert [b.outcome for b in builds[:2]] == ["timed_out", "timed_out"]
    # The resumed build's renewal matched nothing: it ended without a file and without a write.
    assert builds[2].outcome == "completed" and builds[2].result.ended == "LostOwnership"
    assert builds[2].result.file is None
    assert builds[3].outcome == "completed" and builds[3].result.file is not None
    assert len(named(runs, "authorize_delivery")) == 1 and len(named(runs, "deliver")) == 1


# --- RI9: a job that kills its worker on every attempt ---------------------------------------------------------------


@pytest.mark.spec("RI9")
async def test_job_that_kills_its_worker_every_attempt_ends_failed_at_the_cap(db, store, client, tmp_path):
    async with crash_world(db, store, client, tmp_path, max_attempts=2) as h, processes(h) as started:
        job_id = await h.create()
        attempts: list[uuid.UUID] = []
        recorded: list[str | None] = []
        async with recovery_only_worker(h) as queue:
            for attempt in (1, 2):
                # Each attempt's worker dies mid-build. Its marker is removed first, so the wait is for this one.
                (h.settings.work_dir / f"held-build_started-{job_id}").unlink(missing_ok=True)
                crashing = await start_worker(started, h, hold_at="build_started")
                await held_at(h.settings, "build_started", job_id)
                row = await h.store.read_job(job_id)
                assert (row.status, row.attempt_count) == (Status.RUNNING, attempt)
                attempts.append(row.attempt_id)
                crashing.kill()
                await forget_dead_worker(h, job_id)
                await wait_lease_expired(h, job_id)
                report = await recover_on(h, queue)
                recorded += recorded_for(report, job_id)
        assert recorded == ["RequeuedByRecovery", "AttemptsExhausted"]
        failed = await h.store.read_job(job_id)
        assert (failed.status, failed.failure_reason) == (Status.FAILED, FailureCode.ATTEMPTS_EXHAUSTED)
        # A healthy worker lets the workflow read the row: it returns Failed and starts nothing more.
        await start_worker(started, h)
        row = await h.settled(job_id)
        result = await h.client.get_workflow_handle(export_workflow_id(job_id), result_type=ExportResult).result()

    assert (result.status, result.failure_reason) == (Status.FAILED, FailureCode.ATTEMPTS_EXHAUSTED)
    assert (row.status, row.failure_reason, row.attempt_count, row.attempt_id) == (
        Status.FAILED, FailureCode.ATTEMPTS_EXHAUSTED, 2, attempts[1])
    evts = await events(h.db, job_id)
    assert len(set(attempts)) == 2
    assert kinds(evts, attempts[0], evidence_once=True) == ["Claimed", "BuildStarted", "RequeuedByRecovery"]
    assert kinds(evts, attempts[1], evidence_once=True) == ["Claimed", "BuildStarted", "AttemptsExhausted"]
    assert len(evts) == 6
    assert outbound_names(h.partner) == []
    runs = await activity_runs(h, job_id)
    assert len(claims(runs)) == 2 and not named(runs, "authorize_delivery")
    # Each dead build was resumed by the next worker, and each resumption's renewal matched nothing.
    builds = named(runs, "build")
    assert [(b.input.attempt_id, b.outcome) for b in builds] == [
        (attempts[0], "timed_out"), (attempts[0], "timed_out"), (attempts[0], "completed"),
        (attempts[1], "timed_out"), (attempts[1], "timed_out"), (attempts[1], "completed")]
    assert [b.result.ended for b in builds if b.result] == ["LostOwnership", "LostOwnership"]


@pytest.mark.spec("RI9")
async def test_exports_lost_with_their_killed_worker_are_not_ended_at_the_attempt_cap(db, store, client, tmp_path):
    """The other side of RI9: a worker killed while it holds two exports, as many times as the attempt cap allows
    (2), has not killed itself through either export. Each loss is lost with its worker (migration 0014) and counts
    against the looser cap: both exports are requeued each time and complete on the next healthy worker. Before,
    both ended Failed/AttemptsExhausted (seen failing)."""
    async with crash_world(db, store, client, tmp_path, max_attempts=2) as h, processes(h) as started:
        jobs = [await h.create() for _ in range(2)]
        recorded: dict[uuid.UUID, list[str | None]] = {job_id: [] for job_id in jobs}
        holders: list[str] = []
        async with recovery_only_worker(h) as queue:
            for attempt in (1, 2):
                for job_id in jobs:
                    (h.settings.work_dir / f"held-build_started-{job_id}").unlink(missing_ok=True)
                crashing = await start_worker(started, h, hold_at="build_started")
                for job_id in jobs:
                    await held_at(h.settings, "build_started", job_id)
                rows = [await h.store.read_job(job_id) for job_id in jobs]
                assert [(r.status, r.attempt_count) for r in rows] == [(Status.RUNNING, attempt)] * 2
                assert len({r.claimed_by.split("/")[0] for r in rows}) == 1  # one worker holds both
                holders.append(rows[0].claimed_by.split("/")[0])
                crashing.kill()  # SIGKILL
                for job_id in jobs:
                    await forget_dead_worker(h, job_id)
                    await wait_lease_expired(h, job_id)
                report = await recover_on(h, queue)
                for job_id in jobs:
                    recorded[job_id] += recorded_for(report, job_id)
        assert recorded == {job_id: ["RequeuedByRecovery", "RequeuedByRecovery"] for job_id in jobs}
        await start_worker(started, h)
        settled = [await h.settled(job_id) for job_id in jobs]

    assert [(r.status, r.attempt_count) for r in settled] == [(Status.COMPLETED, 3)] * 2
    for job_id in jobs:
        requeues = await h.db.admin.fetch(
            "SELECT worker_id, detail FROM export_attempt_events WHERE job_id = $1 AND kind = 'RequeuedByRecovery' "
            "ORDER BY id", job_id)
        assert [tuple(r) for r in requeues] == [(holder, "lost with its worker") for holder in holders]
    assert sorted(outbound_names(h.partner)) == sorted(r.final_name for r in settled)  # one file each


# --- IU4: interrupted after the partner's confirmation, before the terminal write -----------------------------------


@pytest.mark.spec("IU4")
async def test_crash_after_receipt_before_terminal_write__recovery_records_completed_without_upload(crash_harness):
    h = crash_harness
    async with processes(h) as started:
        crashing = await start_worker(started, h, hold_at="after_receipt")
        job_id = await h.create()
        await held_at(h.settings, "after_receipt", job_id)
        crashing.kill()
        await wait_lease_expired(h, job_id)
        delivering = await h.store.read_job(job_id)
        assert delivering.status is Status.DELIVERING and delivering.attempt_count == 1
        assert outbound_names(h.partner) == [delivering.final_name]  # confirmed at the partner, not on the row

        await start_worker(started, h)  # a survivor: the export workflow and recovery run on it
        # The survivor sees the dead delivery time out and leaves the row to recovery: it stays Delivering.
        await eventually(lambda: activity_runs(h, job_id),
                         lambda runs: [d.outcome for d in named(runs, "deliver")] == ["timed_out"]
                         and runs[-1].name == "claim_if_allowed" and runs[-1].outcome == "completed",
                         timeout=30, interval=0.2, what="the lost delivery seen by the workflow")
        assert (await h.store.read_job(job_id)).status is Status.DELIVERING
        report = await asyncio.wait_for(run_recovery(h.client, h.settings), timeout=30)
        assert recorded_for(report, job_id) == ["ResolvedByRecovery"]
        row = await h.settled(job_id)

    assert row.status is Status.COMPLETED and row.attempt_id == delivering.attempt_id
    evts = await events(h.db, job_id)
    # The attempt's receipt, then recovery's own listing (evidence both), then the resolution from them.
    assert kinds(evts, row.attempt_id, evidence_once=True) == [
        "Claimed", "BuildStarted", "DeliveryAuthorized", "DeliveryEvidence", "ResolvedByRecovery"]
    resolved = [e for e in evts if e["kind"] == "ResolvedByRecovery"]
    assert resolved[0]["detail"].startswith("Completed: receipt appended by the attempt")
    assert "Finished" not in [e["kind"] for e in evts]
    assert outbound_names(h.partner) == [row.final_name]
    assert list((h.partner.root / "incoming-tmp").iterdir()) == []
    assert len(named(await activity_runs(h, job_id), "deliver")) == 1  # never a second upload


# --- LV6: killed between cutoff 2's commit and its answer -------------------------------------------------------


@pytest.mark.spec("LV6")
async def test_killed_after_cutoff_2_committed__the_run_reads_the_settled_row_within_a_lease(crash_harness):
    """Cutoff 2 committed, then its worker died before the step answered. Recovery takes the attempt back after the
    lease (it never passed its rename fence); the run must see that within about a lease, not after the step's whole
    start-to-close timeout (60 s), and deliver on a second attempt."""
    h = crash_harness
    async with processes(h) as started:
        crashing = await start_worker(started, h, hold_at="after_cutoff_2")
        job_id = await h.create()
        await held_at(h.settings, "after_cutoff_2", job_id)
        authorized = await h.store.read_job(job_id)
        assert authorized.status is Status.DELIVERING  # the authorization committed before the kill
        crashing.kill()
        await start_worker(started, h)  # a survivor for the workflow and recovery
        await wait_lease_expired(h, job_id)
        report = await asyncio.wait_for(run_recovery(h.client, h.settings), timeout=30)
        assert recorded_for(report, job_id) == ["RequeuedByRecovery"]
        settled_at = asyncio.get_running_loop().time()
        handle = h.client.get_workflow_handle(export_workflow_id(job_id), result_type=ExportResult)
        result = await asyncio.wait_for(handle.result(), timeout=20)
        took = asyncio.get_running_loop().time() - settled_at

    row = await h.store.read_job(job_id)
    # Nothing was uploaded and the attempt never passed its rename fence: sent round again, and delivered once.
    assert row.status is Status.COMPLETED and row.attempt_id != authorized.attempt_id
    assert (result.status, took < 3 * h.settings.lease_seconds + 5) == (Status.COMPLETED, True), took
    assert outbound_names(h.partner) == [row.final_name]
    runs = await activity_runs(h, job_id)
    assert [r.outcome for r in named(runs, "authorize_delivery")] == ["timed_out", "completed"]
    assert len(named(runs, "deliver")) == 1
    described = await handle.describe()
    assert described.typed_search_attributes.get(EXPORT_STATUS) == "Completed"


@pytest.mark.spec("HI4")
async def test_an_upload_that_settles_after_temporal_gave_it_up__the_waiting_run_returns_the_row(crash_harness):
    """Found by the chaos run (seed 712642): a worker paused after its partner's receipt, past the upload's
    heartbeat timeout. Temporal gives the step up and the run, reading the row still `Delivering`, waits for a
    wake-up. Woken, the worker makes its terminal write, `Completed`: the run must learn of it then, not at its next
    timer (300 s), and its search attributes must say `Completed`."""
    h = crash_harness
    async with processes(h) as started:
        paused = await start_worker(started, h, hold_at=checkpoints.AFTER_RECEIPT, max_builds=1)
        job_id = await h.create()
        await held_at(h.settings, checkpoints.AFTER_RECEIPT, job_id)
        assert paused.process is not None
        paused.process.send_signal(signal.SIGSTOP)
        try:
            await start_worker(started, h)  # the run goes on here
            await upload_given_up_and_run_waiting(h, job_id)
        finally:
            release_held(h.settings, checkpoints.AFTER_RECEIPT, job_id)
            paused.process.send_signal(signal.SIGCONT)
        await the_run_returns_the_row_its_upload_settled(h, job_id)


@pytest.mark.spec("HI4")
@pytest.mark.spec("PT6")
async def test_an_upload_whose_heartbeats_never_reached_temporal__the_waiting_run_returns_the_row(crash_harness):
    """Found by the chaos run (seed 738109, the Temporal server down for a second or so): the worker's heartbeats
    kept coming, so by its own count Temporal still waited for the upload, but none reached the server, which gave
    the step up. The run read the row still `Delivering` and waited for a wake-up; the terminal write then asked for
    none, and the run learnt of `Completed` only at its next timer (300 s). Here the worker's way to Temporal goes
    down (every connection reset) while its upload is held after the partner's receipt, and the write is made
    before that way heals."""
    h = crash_harness
    async with processes(h) as started, TcpCutProxy(*temporal_upstream(h.client)) as temporal:
        job_id = await held_with_temporal_down(h, started, temporal, checkpoints.AFTER_RECEIPT)
        try:
            await upload_given_up_and_run_waiting(h, job_id)
            release_held(h.settings, checkpoints.AFTER_RECEIPT, job_id)
            # The terminal write, while the worker still cannot reach Temporal: nothing it could hear from there
            # tells it that the step was given up.
            await eventually(lambda: h.store.read_job(job_id), lambda row: row.status is Status.COMPLETED,
                             timeout=30, interval=0.1, what="the held upload's terminal write")
        finally:
            release_held(h.settings, checkpoints.AFTER_RECEIPT, job_id)
            temporal.heal()
        await the_run_returns_the_row_its_upload_settled(h, job_id)
    assert temporal.passed >= 1 and "refused" in temporal.events  # the held worker's way to Temporal was cut


async def upload_given_up_and_run_waiting(h: Harness, job_id: uuid.UUID) -> None:
    """Temporal gave the upload step up, and the run, having read the row still `Delivering`, waits for a
    wake-up (its timer is the idle recheck)."""
    async def given_up_and_waiting() -> bool:
        history = await h.client.get_workflow_handle(export_workflow_id(job_id)).fetch_history()
        kinds_after = [e.event_type for e in history.events]
        if EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT not in kinds_after:
            return False
        after = kinds_after[kinds_after.index(EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT):]
        return EventType.EVENT_TYPE_TIMER_STARTED in after

    await eventually(given_up_and_waiting, bool, timeout=60, interval=0.2,
                     what="the upload given up and the run waiting for a wake-up")
    assert (await h.store.read_job(job_id)).status is Status.DELIVERING


async def the_run_returns_the_row_its_upload_settled(h: Harness, job_id: uuid.UUID) -> None:
    """The run returns `Completed`, and shows it, well before its idle recheck: the upload's own terminal write
    settled the row, and woke the run that waited for it."""
    handle = h.client.get_workflow_handle(export_workflow_id(job_id), result_type=ExportResult)
    result = await asyncio.wait_for(handle.result(), timeout=30)
    described = await handle.describe()
    row = await h.store.read_job(job_id)
    assert row.status is Status.COMPLETED and result.status is Status.COMPLETED
    assert "Finished" in kinds(await events(h.db, job_id))  # the held worker's own terminal write settled it
    assert described.typed_search_attributes.get(EXPORT_STATUS) == "Completed"
    assert outbound_names(h.partner) == [row.final_name]
    runs = await activity_runs(h, job_id)
    assert [r.outcome for r in named(runs, "deliver")] == ["timed_out"]


@pytest.mark.spec("RI4")
async def test_a_paused_upload_taken_back_by_recovery_never_renames(crash_harness):
    """The adversary's case for the rename fence: a worker paused (SIGSTOP) with every byte sent, before its rename,
    past its lease. Recovery takes the attempt back and a second attempt delivers. Woken, the first worker must not
    rename its temporary file into place: its fence is refused, and the partner holds one file, the second's."""
    h = crash_harness
    async with processes(h) as started:
        # One build slot, so one claim poll left open while paused (with the default eight, the SDK keeps several,
        # and the next claim may be handed to each in turn, 30 s apiece).
        paused = await start_worker(started, h, hold_at=checkpoints.BEFORE_RENAME_FENCE, max_builds=1)
        job_id = await h.create()
        await held_at(h.settings, checkpoints.BEFORE_RENAME_FENCE, job_id)
        first = await h.store.read_job(job_id)
        temp_dir = h.partner.root / "incoming-tmp"
        assert first.status is Status.DELIVERING and len(list(temp_dir.iterdir())) == 1  # every byte is there
        assert paused.process is not None
        paused.process.send_signal(signal.SIGSTOP)
        try:
            await wait_lease_expired(h, job_id)
            await start_worker(started, h)
            report = await asyncio.wait_for(run_recovery(h.client, h.settings), timeout=30)
            assert recorded_for(report, job_id) == ["RequeuedByRecovery"]
            # The next claim may be handed to the poll the paused worker left open: it waits out the claim's
            # heartbeat timeout (30 s) before another worker takes it.
            await eventually(lambda: h.store.read_job(job_id), lambda r: r.status.is_settled, timeout=100,
                             interval=0.2, what="the second attempt settled")
            row = await asyncio.wait_for(h.settled(job_id), timeout=60)
            assert row.status is Status.COMPLETED and row.attempt_id != first.attempt_id
        finally:
            release_held(h.settings, checkpoints.BEFORE_RENAME_FENCE, job_id)
            paused.process.send_signal(signal.SIGCONT)
        # The woken worker tries its fence, is refused, and removes its temporary file instead of renaming it.
        await eventually(lambda: asyncio.sleep(0, list(temp_dir.iterdir())), lambda left: left == [], timeout=30,
                         interval=0.2, what="the woken worker removing its temporary file")
        refused = await eventually(
            lambda: events(h.db, job_id),
            lambda evts: [e for e in evts if e["attempt_id"] == first.attempt_id and e["kind"] == "DeliveryEvidence"
                          and "rename fence refused" in e["detail"]],
            timeout=30, interval=0.2, what="the woken worker's evidence that its fence was refused")
        assert refused  # the first worker did come back and try: the interleaving happened

    assert outbound_names(h.partner) == [row.final_name]
    delivered = (h.partner.root / "outbound" / row.final_name).read_bytes()
    assert hashlib.sha256(delivered).digest() == row.expected_file_sha256
    assert (await h.store.read_job(job_id)).status is Status.COMPLETED  # the late attempt changed nothing
    renames = [e["attempt_id"] for e in await events(h.db, job_id)
               if e["kind"] == "DeliveryEvidence" and '"step": "rename"' in e["detail"]]
    assert renames == [row.attempt_id]


# --- LV5: a cutoff-2 step that reaches its worker after its bound authorizes nothing ---------------------------


@pytest.mark.spec("LV5")
async def test_a_cutoff_2_step_that_starts_after_its_bound_authorizes_nothing(crash_harness):
    """The worker holds the cutoff-2 step at its start (as a worker paused with a poll open would) past the step's
    heartbeat timeout: the run moves on. Released, the late step must authorize nothing and hand the attempt back,
    so recovery requeues it and a second attempt delivers: Completed, not OutcomeUnknown."""
    h = crash_harness
    hold = f"{checkpoints.BEFORE_STEP}authorize_delivery"
    async with processes(h) as started:
        worker = await start_worker(started, h, hold_at=hold)
        job_id = await h.create()
        await held_at(h.settings, hold, job_id)
        first = (await h.store.read_job(job_id)).attempt_id
        # The run gives the step up (heartbeat timeout, one lease) and reads the row again.
        await eventually(lambda: activity_runs(h, job_id),
                         lambda runs: [r.outcome for r in named(runs, "authorize_delivery")] == ["timed_out"],
                         timeout=30, interval=0.2, what="the run giving the held cutoff-2 step up")
        release_held(h.settings, hold, job_id)
        # Released late: it authorizes nothing and ends the lease, so recovery takes the attempt back at once.
        await wait_lease_expired(h, job_id)
        report = await asyncio.wait_for(run_recovery(h.client, h.settings), timeout=30)
        assert recorded_for(report, job_id) == ["RequeuedByRecovery"]
        row = await h.settled(job_id)
        # What the operator sees of it (exports_cutoff_2_refused_total{reason="late"} counts it too).
        said = worker.log_path.read_text(errors="replace")
        assert f"cutoff 2 of export {job_id} attempt {first} came past its bound" in said, said[-3000:]

    assert row.status is Status.COMPLETED and row.attempt_count == 2, row
    evts = await events(h.db, job_id)
    assert kinds(evts, first, evidence_once=True) == ["Claimed", "BuildStarted", "RequeuedByRecovery"]
    assert outbound_names(h.partner) == [row.final_name]


# --- LR3 / LR4: the claim's response lost, and the re-read failing too ----------------------------------------------


@pytest.fixture
async def proxy(db) -> AsyncIterator[PgFaultProxy]:
    async with fault_proxy(db.server) as running:
        yield running


def cut_then_refuse(proxy: PgFaultProxy, fired: asyncio.Event) -> asyncio.Event:
    """At the very moment a cut fires, also drop every other connection and refuse new ones, so the re-read (from
    whatever pooled connection) fails too. Synchronous with the cut: there is no window for the re-read."""
    original = fired.set

    def trip() -> None:
        proxy.refuse_new_connections()
        proxy.cut_all()
        original()

    fired.set = trip  # type: ignore[method-assign]
    return fired


async def claim_answered(h: Harness, job_id: uuid.UUID) -> ClaimOutput:
    runs = await eventually(lambda: activity_runs(h, job_id),
                            lambda runs: any(r.name == "claim_if_allowed" and r.outcome for r in runs),
                            timeout=30, interval=0.1, what="the first claim answered")
    first = named(runs, "claim_if_allowed")[0]
    assert first.outcome == "completed" and first.result.claim is not None, first
    return first.result.claim


async def assert_run_once_after_an_unknown_claim(h, job_id, row) -> None:
    """Completed by one attempt: the claim that answered Unknown, then one that claimed, one build, one delivery."""
    assert row.status is Status.COMPLETED and row.attempt_count == 1
    assert outbound_names(h.partner) == [row.final_name]
    runs = await activity_runs(h, job_id)
    assert [c.result for c in claims(runs)] == [ClaimResult.UNKNOWN, ClaimResult.CLAIMED]
    assert len(named(runs, "build")) == 1 and len(named(runs, "deliver")) == 1


@pytest.mark.spec("LR3")
async def test_claim_lost_before_commit_and_reread_refused__wakeup_comes_again_and_runs_once(
        crash_harness, proxy, db):
    h = crash_harness
    cut = cut_then_refuse(proxy, proxy.cut_before(CLAIM_STATEMENT))
    async with processes(h) as started:
        await start_worker(started, h, database_url=proxy.url("exports_app", db.name))
        job_id = await h.create()
        first = await claim_answered(h, job_id)
        assert cut.is_set() and proxy.refused >= 1
        assert first.result is ClaimResult.UNKNOWN
        # Nothing committed: still Queued, no attempt, no event.
        row = await h.store.read_job(job_id)
        assert (row.status, row.attempt_id, row.attempt_count) == (Status.QUEUED, None, 0)
        assert await events(h.db, job_id) == []
        proxy.accept_new_connections()
        row = await h.settled(job_id)

    evts = await events(h.db, job_id)
    assert [e["kind"] for e in evts if e["kind"] in ("Claimed", "Finished")] == ["Claimed", "Finished"]
    assert {e["attempt_id"] for e in evts} == {row.attempt_id}
    await assert_run_once_after_an_unknown_claim(h, job_id, row)


async def test_claim_lost_before_commit_and_reread_finds_it_untouched__read_again_at_once_and_runs_once(
        crash_harness, proxy, db):
    """The claim never reached the server; the re-read answers: Queued, at the version the claim checked. The
    wake-up that started this attempt is spent, so a Lost here would leave the job Queued until the workflow's
    idle re-check (5 minutes) or the sweeper; Unknown reads the row again in seconds."""
    h = crash_harness
    cut = proxy.cut_before(CLAIM_STATEMENT)
    async with processes(h) as started:
        await start_worker(started, h, database_url=proxy.url("exports_app", db.name))
        job_id = await h.create()
        first = await claim_answered(h, job_id)
        assert cut.is_set()
        assert first.result is ClaimResult.UNKNOWN
        row = await h.settled(job_id)  # within the harness's bound, far below the idle re-check

    await assert_run_once_after_an_unknown_claim(h, job_id, row)


@pytest.mark.spec("LR4")
async def test_claim_lost_after_commit_and_reread_refused__wakeup_finds_running_recovery_takes_over(
        crash_harness, proxy, db):
    h = crash_harness
    cut = cut_then_refuse(proxy, proxy.cut_after_commit(CLAIM_STATEMENT))
    async with processes(h) as started:
        await start_worker(started, h, database_url=proxy.url("exports_app", db.name))
        job_id = await h.create()
        first = await claim_answered(h, job_id)
        assert cut.is_set() and proxy.refused >= 1
        assert first.result is ClaimResult.UNKNOWN
        # The claim did commit: Running under an attempt the workflow never heard of.
        claimed = await h.store.read_job(job_id)
        assert (claimed.status, claimed.attempt_count) == (Status.RUNNING, 1)
        first_attempt = claimed.attempt_id
        proxy.accept_new_connections()

        # The repeated wake-up reads the row, finds it Running, and does nothing: no claim, no build.
        runs = await eventually(
            lambda: activity_runs(h, job_id),
            lambda runs: len(named(runs, "claim_if_allowed")) == 2 and runs[-1].outcome == "completed",
            timeout=30, interval=0.2, what="the repeated wake-up")
        assert runs[-1].result.evaluation.row.status is Status.RUNNING
        assert not runs[-1].result.evaluation.allowed and runs[-1].result.claim is None
        assert len(claims(runs)) == 1 and not named(runs, "build")

        # Nobody renews the attempt's lease; once it expires, recovery takes the attempt over.
        await wait_lease_expired(h, job_id)
        report = await asyncio.wait_for(run_recovery(h.client, h.settings), timeout=30)
        assert recorded_for(report, job_id) == ["RequeuedByRecovery"]
        row = await h.settled(job_id)

    assert row.status is Status.COMPLETED and row.attempt_count == 2 and row.attempt_id != first_attempt
    evts = await events(h.db, job_id)
    assert kinds(evts, first_attempt, evidence_once=True) == ["Claimed", "RequeuedByRecovery"]  # it never built
    assert kinds(evts, row.attempt_id, evidence_once=True) == [
        "Claimed", "BuildStarted", "DeliveryAuthorized", "DeliveryEvidence", "Finished"]
    assert outbound_names(h.partner) == [row.final_name]
    runs = await activity_runs(h, job_id)
    assert [c.result for c in claims(runs)] == [ClaimResult.UNKNOWN, ClaimResult.CLAIMED]
    assert [b.input.attempt_id for b in named(runs, "build")] == [row.attempt_id]
    assert len(named(runs, "deliver")) == 1


@pytest.mark.spec("AR3", "TW6")
async def test_stop_while_the_builds_worker_is_dead__ends_stopped_and_the_workflow_returns_it(
        db, store, client, tmp_path):
    """Found by the chaos run: a stop recorded while the build's worker is dead must not fail the workflow. The
    build cannot record it, so the workflow records the stop without a build; the row and the result agree.
    A 6 s lease (the dead build's heartbeat timeout) makes sure the stop is seen before the build could resume."""
    async with crash_world(db, store, client, tmp_path, lease_seconds=6.0) as h, processes(h) as started:
        a = await start_worker(started, h, hold_at="build_started")
        job_id = await h.create()
        await held_at(h.settings, "build_started", job_id)
        await start_worker(started, h)  # worker B, which would resume the build
        a.kill()
        # Until A is gone, its open long-poll can still be handed the signal's workflow task, which then waits out
        # the workflow task timeout past the build's heartbeat timeout: a different (also correct) interleaving.
        await asyncio.wait_for(a.process.wait(), timeout=15)
        await forget_dead_worker(h, job_id)
        stop = await h.exports.cancel(tenant_id=h.tenant_id, job_id=job_id, requested_by="op", reason="stop")
        assert stop.outcome.value == "StopRequested"
        row = await h.settled(job_id)  # also asserts the workflow's result equals the row's status
    assert row.status is Status.STOPPED and row.stop_request_id == stop.request_id
    # Recorded by the workflow's stop, not by recovery.
    assert kinds(await events(h.db, job_id)) == ["Claimed", "BuildStarted", "Stopped"]
    assert outbound_names(h.partner) == []
    assert [b.outcome for b in named(await activity_runs(h, job_id), "build")] == ["timed_out"]
