"""A cutoff 2 that Temporal gave up while its worker, cut off from Temporal but not from PostgreSQL, still runs it
(LV5), through real worker processes, the Temporal dev server, PostgreSQL and the SFTP partner.

The step's own bound counts the heartbeats it sent, and a worker cut off from Temporal sends them on time to no one,
so only the run knows it gave the step up. Its next read of the row names that attempt (`AdmitInput.given_up`) and
marks it (`cutoff_2_given_up`), and cutoff 2 refuses a marked attempt. A claim step of another run, or one scheduled
before the run gave anything up, carries no such name: it can never mark the attempt a live run drives."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncssh
import pytest
import pytest_asyncio

from activities import checkpoints
from activities.contracts import AdmitInput
from activities.exports import ExportActivities
from store.models import Status
from tests.helpers.crash import crash_world, forget_dead_worker, held_with_temporal_down, processes, start_worker
from tests.helpers.events import events
from tests.helpers.harness import Harness, held_at, release_held, run_recovery
from tests.helpers.store_states import drive, expire, outbox
from tests.helpers.support import create_job, eventually, seed_tenant
from tests.helpers.tcp_cut import TcpCutProxy, temporal_upstream
from tests.workflows.test_crash import activity_runs, named
from workflows.identity import export_workflow_id

# Long enough that a held build on a worker cut off from Temporal outlives the few seconds the test takes to
# terminate its run.
LEASE = 10.0


async def _authorized_or_handed_back(h: Harness, job_id: uuid.UUID, attempt: uuid.UUID) -> str | None:
    if any(e["kind"] == "DeliveryAuthorized" and e["attempt_id"] == attempt for e in await events(h.db, job_id)):
        return "authorized"
    row = await h.db.admin.fetchrow("SELECT attempt_id, lease_expires_at <= clock_timestamp() AS lapsed "
                                    "FROM export_jobs WHERE id = $1", job_id)
    return "handed back" if row["attempt_id"] != attempt or row["lapsed"] else None


async def _marks(h: Harness, job_id: uuid.UUID) -> tuple[uuid.UUID | None, uuid.UUID | None]:
    row = await h.db.admin.fetchrow("SELECT run_waits_for, cutoff_2_given_up FROM export_jobs WHERE id = $1", job_id)
    return row["run_waits_for"], row["cutoff_2_given_up"]


async def assert_refused_and_handed_back(h: Harness, job_id: uuid.UUID, attempt: uuid.UUID, verdict: str | None,
                                        marks: tuple[uuid.UUID | None, uuid.UUID | None]) -> None:
    """The late cutoff 2 authorized nothing and handed its attempt back, which the run's read had marked."""
    late = [e["kind"] for e in await events(h.db, job_id) if e["attempt_id"] == attempt]
    assert verdict == "handed back" and "DeliveryAuthorized" not in late, (verdict, late)
    assert marks == (attempt, attempt)


@pytest.mark.spec("LV5")
async def test_a_cutoff_2_given_up_by_temporal_while_its_worker_is_cut_off_from_it_authorizes_nothing(crash_harness):
    """The worker at cutoff 2 is cut off from Temporal, not from PostgreSQL or the partner (as one waiting there for
    an upload slot or a partner session may be). Temporal gives the step up (heartbeat timeout) and the run reads the
    row again, naming the attempt it gave up. Released, the step authorizes nothing and hands the attempt back, so
    its lease, upload slot and partner session are not held a hand-over window more (found by review)."""
    h = crash_harness
    async with processes(h) as started, TcpCutProxy(*temporal_upstream(h.client)) as temporal:
        job_id = await held_with_temporal_down(h, started, temporal, checkpoints.BEFORE_CUTOFF_2)
        first = (await h.store.read_job(job_id)).attempt_id
        try:
            await eventually(lambda: activity_runs(h, job_id),
                             lambda runs: [r.outcome for r in named(runs, "authorize_delivery")] == ["timed_out"]
                             and runs[-1].name == "claim_if_allowed" and runs[-1].outcome == "completed",
                             timeout=60, interval=0.2, what="cutoff 2 given up by Temporal and the row read again")
            marks = await _marks(h, job_id)  # the run's read, before the step goes on
            release_held(h.settings, checkpoints.BEFORE_CUTOFF_2, job_id)
            verdict = await eventually(lambda: _authorized_or_handed_back(h, job_id, first), lambda v: v is not None,
                                       timeout=30, interval=0.1, what="the late cutoff 2's answer")
        finally:
            release_held(h.settings, checkpoints.BEFORE_CUTOFF_2, job_id)
            temporal.heal()
    await assert_refused_and_handed_back(h, job_id, first, verdict, marks)


@pytest.mark.spec("LV5")
async def test_a_given_up_cutoff_2_is_marked_even_while_every_reachable_worker_is_building(crash_harness):
    """The run's next read is a claim, which waits on the admission queue for a worker with a build slot free; with
    every worker that reaches Temporal busy building (for hours, perhaps), the given-up step went on meanwhile and
    authorized (found by review). The read right after a give-up goes to the shared queue and marks the attempt
    without a build slot."""
    h = crash_harness
    async with processes(h) as started, TcpCutProxy(*temporal_upstream(h.client)) as temporal:
        # Worker B: live, one build slot, which another export's build holds.
        await start_worker(started, h, hold_at=checkpoints.BUILD_STARTED, max_builds=1)
        other = await h.create()
        await held_at(h.settings, checkpoints.BUILD_STARTED, other, timeout=60)
        # Worker A: one build slot, reaches Temporal through the cut; the export is built there and held at cutoff 2.
        await start_worker(started, h, hold_at=checkpoints.BEFORE_CUTOFF_2, max_builds=1,
                           temporal_address=f"127.0.0.1:{temporal.port}")
        job_id = await h.create()
        await held_at(h.settings, checkpoints.BEFORE_CUTOFF_2, job_id, timeout=60)
        first = (await h.store.read_job(job_id)).attempt_id
        temporal.go_down()  # A still reaches PostgreSQL and the partner
        await forget_dead_worker(h, job_id)
        try:
            await eventually(lambda: activity_runs(h, job_id),
                             lambda runs: [r.outcome for r in named(runs, "authorize_delivery")] == ["timed_out"]
                             and runs[-1].name == "claim_if_allowed" and runs[-1].outcome == "completed",
                             timeout=60, interval=0.2, what="cutoff 2 given up and the row read on a busy fleet")
            marks = await _marks(h, job_id)
            # B's one slot is still taken (released only below): the read ran without a build slot.
            assert (await h.store.read_job(other)).status is Status.RUNNING
            release_held(h.settings, checkpoints.BEFORE_CUTOFF_2, job_id)  # the given-up step goes on
            verdict = await eventually(lambda: _authorized_or_handed_back(h, job_id, first), lambda v: v is not None,
                                       timeout=30, interval=0.1, what="the late cutoff 2's answer")
        finally:
            release_held(h.settings, checkpoints.BEFORE_CUTOFF_2, job_id)
            release_held(h.settings, checkpoints.BUILD_STARTED, other)
            temporal.heal()
    await assert_refused_and_handed_back(h, job_id, first, verdict, marks)


@pytest.mark.spec("LV5")
async def test_a_given_up_cutoff_2_whose_row_is_queued_by_then_is_claimed_once_a_slot_frees(long_lease_harness):
    """The read after the give-up, on the shared queue, may find the row Queued (recovery took the dead worker's
    attempt back first) on a worker with no build slot: it must not be retried there until its tries run out and the
    run waits its idle recheck (5 minutes; found by review), but answered, and the run claims on the admission queue,
    where the first free slot takes it."""
    h = long_lease_harness
    async with processes(h) as started:
        # Worker B: one build slot, which another export's build holds (the fleet is busy).
        await start_worker(started, h, hold_at=checkpoints.BUILD_STARTED, max_builds=1)
        other = await h.create()
        await held_at(h.settings, checkpoints.BUILD_STARTED, other, timeout=60)
        # Worker A: the export is built there and held at cutoff 2; then A dies.
        a = await start_worker(started, h, hold_at=checkpoints.BEFORE_CUTOFF_2, max_builds=1)
        job_id = await h.create()
        await held_at(h.settings, checkpoints.BEFORE_CUTOFF_2, job_id, timeout=60)
        first = (await h.store.read_job(job_id)).attempt_id
        a.kill()
        await forget_dead_worker(h, job_id)
        # Recovery takes the attempt back before Temporal gives its cutoff 2 up (heartbeat timeout, one lease).
        await expire(h.db, job_id)
        await asyncio.wait_for(run_recovery(h.client, h.settings), timeout=30)
        assert (await h.store.read_job(job_id)).status is Status.QUEUED
        try:
            runs = await eventually(
                lambda: activity_runs(h, job_id),
                lambda rs: [r.outcome for r in named(rs, "authorize_delivery")] == ["timed_out"]
                and [r.outcome for r in named(rs, "claim_if_allowed")][1:2] == ["completed"],
                timeout=60, interval=0.2, what="cutoff 2 given up and the row read on the shared queue")
            read = named(runs, "claim_if_allowed")[1]
            assert (await h.store.read_job(job_id)).status is Status.QUEUED  # B was busy: nothing claimed yet
            release_held(h.settings, checkpoints.BUILD_STARTED, other)  # B's slot frees
            claimed = await eventually(lambda: h.store.read_job(job_id), lambda r: r.status is not Status.QUEUED,
                                       timeout=45, interval=0.2, what="the export claimed once B's slot was free")
            release_held(h.settings, checkpoints.BUILD_STARTED, job_id)  # B holds every build at its start
        finally:
            release_held(h.settings, checkpoints.BUILD_STARTED, other)
            release_held(h.settings, checkpoints.BUILD_STARTED, job_id)
        row = await h.settled(job_id)
    assert read.task_queue == h.settings.task_queue, read.task_queue  # the shared queue
    assert claimed.attempt_id != first and claimed.attempt_count == 2, claimed
    assert row.status is Status.COMPLETED, row


@pytest_asyncio.fixture
async def long_lease_harness(db, store, client, tmp_path) -> AsyncIterator[Harness]:
    async with crash_world(db, store, client, tmp_path, lease_seconds=LEASE) as h:
        yield h


async def _log_says(path: Path, text: str) -> bool:
    await asyncio.sleep(0)
    return path.exists() and text in path.read_text(errors="replace")


@pytest.mark.spec("LV5")
async def test_a_claim_step_of_a_terminated_run_reading_late_never_marks_the_live_runs_attempt(long_lease_harness):
    """A run's claim waits in its step for its destination's share of worker A (LD4), heartbeating; A is cut off
    from Temporal (not from PostgreSQL), and the run is terminated. Recovery wakes the export and a new run claims
    attempt Y on worker B. When A's share frees, the old claim step goes on and reads the row: it finds Y, not its
    own, and may note that a run waits on Y, but it names no attempt given up, so Y's cutoff 2 is authorized (found
    by review, against a first fix that refused any attempt a run waited on)."""
    h = long_lease_harness
    async with processes(h) as started, TcpCutProxy(*temporal_upstream(h.client)) as temporal:
        a = await start_worker(started, h, hold_at=checkpoints.BUILD_STARTED, max_builds=2, max_per_destination=1,
                               temporal_address=f"127.0.0.1:{temporal.port}")
        blocker = await h.create()  # holds worker A's one place for the destination
        await held_at(h.settings, checkpoints.BUILD_STARTED, blocker)
        job_id = await h.create()
        await eventually(lambda: _log_says(a.log_path, f"export {job_id} waits for a place"), bool, timeout=30,
                         interval=0.2, what="the export's claim waiting in its step on worker A")
        temporal.go_down()  # A still reaches PostgreSQL; its heartbeats reach no server
        for job in (blocker, job_id):
            await h.client.get_workflow_handle(export_workflow_id(job)).terminate(reason="test: a crashed run")
        try:
            await start_worker(started, h, hold_at=checkpoints.BEFORE_CUTOFF_2)
            await asyncio.wait_for(run_recovery(h.client, h.settings), timeout=60)  # wakes the closed runs' rows
            await held_at(h.settings, checkpoints.BEFORE_CUTOFF_2, job_id, timeout=60)
            attempt = (await h.store.read_job(job_id)).attempt_id
            assert attempt is not None and await _marks(h, job_id) == (None, None)
            # A's place frees (the blocker is stopped; its build hears that from PostgreSQL): A's old claim step,
            # given up by Temporal with its run, goes on and reads the export's row.
            await h.store.request_cancellation(tenant_id=h.tenant_id, job_id=blocker, request_id=uuid.uuid4(),
                                               requested_by="test", reason=None)
            await eventually(lambda: h.store.read_job(blocker), lambda r: r.status is Status.STOPPED, timeout=30,
                             what="the blocker stopped on worker A")
            # The old step's read: it notes the run it belonged to as waiting on Y (a wake-up at most).
            waits, given_up = await eventually(lambda: _marks(h, job_id), lambda m: m[0] is not None, timeout=30,
                                               interval=0.1, what="the old claim step's late read")
            live = [(r.name, r.outcome) for r in await activity_runs(h, job_id)]
            release_held(h.settings, checkpoints.BEFORE_CUTOFF_2, job_id)
            verdict = await eventually(lambda: _authorized_or_handed_back(h, job_id, attempt),
                                       lambda v: v is not None, timeout=30, interval=0.1,
                                       what="the live run's cutoff 2")
        finally:
            release_held(h.settings, checkpoints.BEFORE_CUTOFF_2, job_id)
            temporal.heal()
        row = await h.settled(job_id)
    # The interleaving meant: the old step read Y while the live run's cutoff 2 was still open.
    assert (waits, given_up) == (attempt, None)
    assert live == [("claim_if_allowed", "completed"), ("build", "completed"), ("authorize_delivery", None)], live
    assert verdict == "authorized"
    assert row.status is Status.COMPLETED and row.attempt_id == attempt and row.attempt_count == 1, row


@pytest.mark.spec("LV5")
async def test_the_read_after_a_give_up_claims_nothing_even_on_a_worker_with_slots_free(db, store):
    """The read after a give-up runs on the shared queue, where no admission poll's ticket counts a claim: one made
    there took a build slot uncounted (a worker could hold more than its limit), and a late try of it could claim
    under an attempt ID the run had dropped, leaving the row to an attempt no run drives (found by review). It reads
    and marks only; for a claimable row it writes a wake-up, even with an older one still unpublished (the
    dispatcher signals before it marks a row published, so that one may have been spent already), and the run,
    woken, claims on the admission queue."""
    host_key = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()
    tenant_id, destination_id = await seed_tenant(db.admin, destination={
        "host": "127.0.0.1", "port": 22, "username": "exports", "final_dir": "/outbound",
        "temp_dir": "/incoming-tmp", "host_key": host_key, "credential_ref": "file:/none"})
    settings = db.settings(task_queue=f"given-up-{uuid.uuid4().hex[:8]}", max_builds=4, max_uploads=4)
    activities = ExportActivities(store, settings, worker_id="worker-test", worker_task_queue="given-up-own")
    try:
        queued, running = [await create_job(store, tenant_id, destination_id) for _ in range(2)]
        given_up = await drive(store, running, Status.RUNNING)
        before = [len(await outbox(db, job_id)) for job_id in (queued, running)]  # the creations' own, unpublished
        answers = [await activities.claim_if_allowed(AdmitInput(job_id=job_id, attempt_id=uuid.uuid4(),
                                                                given_up=given_up))
                   for job_id in (queued, running)]
        assert [(a.claim, a.evaluation.allowed, a.evaluation.row.status) for a in answers] == [
            (None, True, Status.QUEUED), (None, False, Status.RUNNING)]
        assert activities.capacity.builds.in_use == 0  # no slot taken, none counted
        assert [len(await outbox(db, job_id)) - n for job_id, n in zip((queued, running), before, strict=True)] \
            == [1, 0]
        row = await store.read_job(queued)
        assert (row.status, row.attempt_count) == (Status.QUEUED, 0)
        assert await db.admin.fetchval("SELECT cutoff_2_given_up FROM export_jobs WHERE id = $1", running) \
            == given_up
    finally:
        await activities.close()
