"""Hardening of leases and builds through the real worker, the Temporal dev server, PostgreSQL and the SFTP partner
(matrix "Hardening: leases, evidence and builds": LK1, LK2, LK3).

Each test walks a path the original matrix never walked, and each failed on the code before its fix.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
import uuid
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from activities.checkpoints import AFTER_CLAIM, BEFORE_CUTOFF_2, BEFORE_UPLOAD, Checkpoints
from store.jobs import build_holder
from store.models import AuthorizationResult, CancellationOutcome, ClaimResult, FailureCode, JobRow, Status
from tests.helpers.crash import crash_world, forget_dead_worker, processes, start_worker
from tests.helpers.events import events, kinds
from tests.helpers.harness import Harness, held_at, release_held, run_recovery
from tests.helpers.lease import (
    BOUND,
    LEASE,
    RENEWAL,
    Hold,
    RenewalBlocker,
    first_attempt,
    history,
    lease_harness,
    lease_state,
    open_proxy,
    wait_expired,
)
from tests.helpers.partner import assert_partner_holds
from tests.helpers.store_states import built_file
from tests.helpers.support import create_job, eventually, seed_tenant


class LoseClaimResponseOnce(Checkpoints):
    """After the first claim commits, recovery requeues the job and then the claim's activity fails, as when its
    worker dies after the commit: Temporal retries the step with the same attempt ID."""

    def __init__(self) -> None:
        self.h: Harness | None = None
        self.fired = False

    async def reached(self, name: str, job_id: uuid.UUID) -> None:
        if name != AFTER_CLAIM or self.fired:
            return
        self.fired = True
        assert self.h is not None
        await wait_expired(self.h.db, job_id)
        report = await run_recovery(self.h.client, self.h.settings)
        assert [t.recorded for t in report.taken_over if t.job_id == job_id] == ["RequeuedByRecovery"]
        raise RuntimeError("the claim's worker died after its commit (injected)")


async def settled_with(stack: AsyncExitStack, checkpoints: Checkpoints, db, store, client,
                       tmp_path: Path) -> tuple[Harness, uuid.UUID, JobRow]:
    """One export through a worker whose checkpoints inject a fault; its settled row."""
    # After its commit the claim's keeper renews the lease for the build until the hand-over window ends, which
    # counts the sticky timeout: a short one, so that LoseClaimResponseOnce's lease lapses in seconds, not 22.
    h = await lease_harness(stack, db, store, client, tmp_path, hold=None, sticky_queue_timeout_seconds=1.0)
    if isinstance(checkpoints, LoseClaimResponseOnce):
        checkpoints.h = h  # it runs recovery itself
    h.activities.checkpoints = checkpoints
    job_id = await h.create()
    # Bounded well below the harness's own wait: a claim that retries without end fails here.
    await eventually(lambda: h.store.read_job(job_id), lambda r: r is not None and r.status.is_settled,
                     timeout=BOUND, interval=0.2, what="the export settled")
    assert checkpoints.fired, "the fault was not injected"
    return h, job_id, await h.settled(job_id)


@pytest.mark.spec("LK2")
async def test_claim_retried_after_a_requeue_is_lost_and_the_next_attempt_delivers_once(db, store, client, tmp_path):
    async with AsyncExitStack() as stack:
        lose = LoseClaimResponseOnce()
        h, job_id, row = await settled_with(stack, lose, db, store, client, tmp_path)
        assert row.status is Status.COMPLETED and row.attempt_count == 2
        found = await events(db, job_id)
        first = next(e["attempt_id"] for e in found if e["kind"] == "Claimed")
        assert first != row.attempt_id
        # The spent attempt holds its claim and the requeue, and nothing else was ever written for it.
        assert [k for k in kinds(found, first) if k != "DeliveryEvidence"] == ["Claimed", "RequeuedByRecovery"]
        assert kinds(found, row.attempt_id)[0] == "Claimed" and kinds(found, row.attempt_id)[-1] == "Finished"
        claims = [result["claim"] for name, result in await history(h, job_id) if name == "claim_if_allowed"]
        assert [c["result"] for c in claims] == [ClaimResult.LOST.value, ClaimResult.CLAIMED.value]
        assert_partner_holds(h.partner, row, only=True)



class FailAfterClaimOnce(Checkpoints):
    """The policy-and-claim step fails once right after its claim commits, as when its answer is lost: Temporal
    retries the step with the same attempt ID, and nothing requeues the row meanwhile."""

    def __init__(self) -> None:
        self.fired = False

    async def reached(self, name: str, job_id: uuid.UUID) -> None:
        if name == AFTER_CLAIM and not self.fired:
            self.fired = True
            raise RuntimeError("the claim's answer was lost after its commit (injected)")


@pytest.mark.spec("LK2")
async def test_claim_retried_after_its_own_commit_finds_its_attempt_and_delivers_once(db, store, client, tmp_path):
    async with AsyncExitStack() as stack:
        h, job_id, row = await settled_with(stack, FailAfterClaimOnce(), db, store, client, tmp_path)
        # One attempt: the retry found its own claim in the row, and no lease had to lapse for recovery.
        assert row.status is Status.COMPLETED and row.attempt_count == 1
        assert [k for k in kinds(await events(db, job_id), row.attempt_id) if k != "DeliveryEvidence"] == [
            "Claimed", "BuildStarted", "DeliveryAuthorized", "Finished"]
        steps = [(name, result) for name, result in await history(h, job_id) if name == "claim_if_allowed"]
        assert [result["claim"]["result"] for _, result in steps] == [ClaimResult.CLAIMED.value]
        assert_partner_holds(h.partner, row, only=True)

# --- LK1: the lease is kept without a gap from the claim to the terminal write -----------------------------------


@pytest.mark.spec("LK1")
@pytest.mark.parametrize("checkpoint", [BEFORE_CUTOFF_2, BEFORE_UPLOAD])
async def test_lease_is_kept_between_the_steps_of_an_attempt(db, store, client, tmp_path, checkpoint):
    """The build has ended; the next step (cutoff 2, or the delivery) starts late, held here for more than two
    leases, as a backlog in Temporal would hold it. Nothing lets the lease lapse meanwhile."""
    async with AsyncExitStack() as stack:
        hold = Hold(checkpoint)
        h = await lease_harness(stack, db, store, client, tmp_path, hold=hold)
        job_id = await h.create()
        attempt_id = await first_attempt(db, job_id)
        await hold.wait_held()
        held_until = time.monotonic() + 2.5 * LEASE
        report = None
        while time.monotonic() < held_until:
            state = await lease_state(db, job_id)
            assert state["expired"] is False, f"the lease lapsed while {checkpoint} was held: {state}"
            if report is None and time.monotonic() > held_until - LEASE:
                report = await run_recovery(h.client, h.settings)
            await asyncio.sleep(0.1)
        assert report is not None and [t for t in report.taken_over if t.job_id == job_id] == []
        hold.release.set()
        row = await h.settled(job_id)
        assert row.status is Status.COMPLETED and row.attempt_count == 1 and row.attempt_id == attempt_id
        found = await events(db, job_id)
        assert kinds(found).count("DeliveryAuthorized") == 1 and kinds(found).count("Finished") == 1
        assert not {"RequeuedByRecovery", "ResolvedByRecovery"} & set(kinds(found))
        assert_partner_holds(h.partner, row, only=True)


@pytest.mark.spec("LK1")
async def test_a_delivery_that_starts_after_recovery_resolved_its_attempt_uploads_nothing(db, store, client,
                                                                                         tmp_path):
    """Past cutoff 2, the worker is cut off from PostgreSQL (its renewals never arrive) and its delivery starts
    late: recovery takes the attempt back meanwhile (its rename fence is open). When the delivery starts, its
    confirming renewal matches no row, so it never connects to the partner; the export's next attempt delivers."""
    async with AsyncExitStack() as stack:
        proxy = await open_proxy(stack, db)
        hold = Hold(BEFORE_UPLOAD)
        h = await lease_harness(stack, db, store, client, tmp_path, proxy=proxy, hold=hold)
        blocker = RenewalBlocker(proxy)
        stack.push_async_callback(blocker.stop)
        job_id = await h.create()
        attempt_id = await first_attempt(db, job_id)
        await hold.wait_held()
        blocker.start()
        await wait_expired(db, job_id)
        report = await run_recovery(h.client, h.settings)
        assert [t.recorded for t in report.taken_over if t.job_id == job_id] == ["RequeuedByRecovery"]
        assert blocker.cuts >= 1  # the keeper did try to renew, and the fault was injected
        await blocker.stop()
        hold.release.set()

        row = await h.settled(job_id)
        assert row.status is Status.COMPLETED and row.attempt_id != attempt_id
        assert_partner_holds(h.partner, row, only=True)
        assert list((h.partner.root / "incoming-tmp").iterdir()) == []
        delivers = [r for name, r in await history(h, job_id) if name == "deliver"]
        assert len(delivers) == 2 and delivers[0]["written"] is False and delivers[0]["outcome"] is None
        steps = [json.loads(r["detail"])["step"] for r in await db.admin.fetch(
            "SELECT detail FROM export_attempt_events WHERE job_id = $1 AND attempt_id = $2 "
            "AND kind = 'DeliveryEvidence' ORDER BY id", job_id, attempt_id)]
        assert "baseline" not in steps and "not_uploaded" in steps  # it never connected, and says so
        assert kinds(await events(db, job_id), attempt_id) == [
            "Claimed", "BuildStarted", "DeliveryAuthorized", "RequeuedByRecovery", "DeliveryEvidence"]


# --- LK3: a resumed build fences the earlier build of its attempt -------------------------------------------------


@pytest.mark.spec("LK3")
async def test_store__a_build_start_fences_the_earlier_build_of_the_attempt(db, store):
    tenant_id, destination_id = await seed_tenant(db.admin)
    job_id = await create_job(store, tenant_id, destination_id)
    attempt_id = uuid.uuid4()
    assert await store.claim(job_id, 1, attempt_id, "worker-a") is ClaimResult.CLAIMED
    assert await store.start_build(job_id, attempt_id, "worker-a/1", "first build")
    assert await store.renew_lease(job_id, attempt_id, "worker-a/1")
    # The build resumes, on another worker or again on this one: from this commit on, the first build is fenced.
    assert await store.start_build(job_id, attempt_id, "worker-b/2", "resumed (1)")
    assert not await store.renew_lease(job_id, attempt_id, "worker-a/1")
    assert not await store.finish_failed(job_id, attempt_id, FailureCode.BUILD_FAILED, "late", holder="worker-a/1")
    row = await store.read_job(job_id)
    earlier = built_file(row.final_name, b"first build's bytes").model_copy(update={"holder": "worker-a/1"})
    assert await store.authorize_delivery(row, attempt_id, earlier) is AuthorizationResult.NOT_OWNER
    cancel = await store.request_cancellation(tenant_id=tenant_id, job_id=job_id, request_id=uuid.uuid4(),
                                              requested_by="op", reason="stop")
    assert cancel.outcome is CancellationOutcome.STOP_REQUESTED
    assert not await store.finish_stopped(job_id, attempt_id, "WhileBuilding", holder="worker-a/1")
    # The resumed build holds the attempt: its writes match.
    assert await store.renew_lease(job_id, attempt_id, "worker-b/2")
    assert await store.finish_stopped(job_id, attempt_id, "WhileBuilding", holder="worker-b/2")
    found = await db.admin.fetch("SELECT kind, worker_id FROM export_attempt_events WHERE job_id = $1 ORDER BY id",
                                 job_id)
    assert [(e["kind"], e["worker_id"]) for e in found] == [
        ("Claimed", "worker-a"), ("BuildStarted", "worker-a/1"), ("BuildStarted", "worker-b/2"),
        ("Stopped", "worker-b/2")]


@pytest.mark.spec("LK3")
async def test_a_build_resumed_elsewhere_fences_the_paused_build_whose_stop_write_then_matches_nothing(
        db, store, client, tmp_path):
    """Worker A is paused (SIGSTOP) in the middle of its build; Temporal resumes the build on worker B, which is
    then held before cutoff 2. An operator's stop is recorded. A wakes up while the attempt is still Running: it
    hears the stop (or its own cancellation) and tries to record it, but its stop write names its fenced build and
    matches no row. B, which holds the attempt, records the stop."""
    async with crash_world(db, store, client, tmp_path) as h, processes(h) as started:
        a = await start_worker(started, h, worker_id=f"w{uuid.uuid4().hex[:6]}", hold_at="build_started")
        job_id = await h.create()
        await held_at(h.settings, "build_started", job_id)
        first = await build_starts(db, job_id)
        assert len(first) == 1 and first[0]["worker_id"].startswith(f"{a.settings.worker_id}/")
        a.process.send_signal(signal.SIGSTOP)
        try:
            b = await start_worker(started, h, worker_id=f"w{uuid.uuid4().hex[:6]}",
                                   hold_at="before_cutoff_2")
            await forget_dead_worker(h, job_id)
            await held_at(h.settings, "before_cutoff_2", job_id)
            starts = await build_starts(db, job_id)
            assert len(starts) == 2 and starts[1]["worker_id"].startswith(f"{b.settings.worker_id}/")
            assert starts[1]["detail"].startswith("resumed")
            stop = await h.exports.cancel(tenant_id=h.tenant_id, job_id=job_id, requested_by="op", reason="stop")
            assert stop.outcome is CancellationOutcome.STOP_REQUESTED
        finally:
            a.process.send_signal(signal.SIGCONT)
        release_held(h.settings, "build_started", job_id)
        # A's build ends (the stop, its own cancellation, a renewal that matches nothing, or its keeper's clock: the
        # pause outlasted its lease, PT2) and writes nothing.
        await eventually(lambda: asyncio.sleep(0, a.log_path.read_text()),
                         lambda text: any(ended in text for ended in (
                             "Completing activity", "lost ownership", "its lease was about to lapse unrenewed")),
                         timeout=BOUND, what="the fenced build ended")
        assert (await h.store.read_job(job_id)).status is Status.RUNNING  # A's stop write matched nothing
        release_held(h.settings, "before_cutoff_2", job_id)
        row = await h.settled(job_id)
        assert row.status is Status.STOPPED and row.attempt_count == 1
        found = await db.admin.fetch("SELECT kind, worker_id FROM export_attempt_events WHERE job_id = $1 "
                                     "AND kind <> 'DeliveryEvidence' ORDER BY id", job_id)
        assert [e["kind"] for e in found] == ["Claimed", "BuildStarted", "BuildStarted", "Stopped"]
        assert found[-1]["worker_id"] == starts[1]["worker_id"]  # recorded by the build that held the attempt
        assert list((h.partner.root / "outbound").iterdir()) == []
        await eventually(lambda: asyncio.sleep(0, list(Path(h.settings.work_dir).glob("*.csv*"))), lambda f: not f,
                         timeout=BOUND, what="every built file removed")
        assert b.process.returncode is None


@pytest.mark.spec("LK3")
async def test_store__a_build_the_run_scheduled_earlier_never_takes_the_slot_from_a_later_one(db, store):
    """The run returned a quiet build to its worker, gave that up too and resumed it elsewhere; the worker, paused
    with a poll open, then wakes with the return in hand. Had it taken the build slot, it would have fenced the
    build the run waits for, and held the attempt with a build nobody waits for (seen in CI: the operator's stop was
    never recorded, the row stayed Running). A build never takes the slot from one the run scheduled after it."""
    tenant_id, destination_id = await seed_tenant(db.admin)
    job_id = await create_job(store, tenant_id, destination_id)
    attempt_id = uuid.uuid4()
    assert await store.claim(job_id, 1, attempt_id, "worker-a") is ClaimResult.CLAIMED
    first, returned, elsewhere = (build_holder("worker-a", 0), build_holder("worker-a", 1),
                                  build_holder("worker-b", 2))
    assert await store.start_build(job_id, attempt_id, first, "first build", generation=0)
    assert await store.start_build(job_id, attempt_id, elsewhere, "resumed (2)", generation=2)
    assert not await store.start_build(job_id, attempt_id, returned, "resumed (1)", generation=1)  # too late
    assert (await store.read_job(job_id)).claimed_by == elsewhere
    assert await store.renew_lease(job_id, attempt_id, elsewhere)
    assert not await store.renew_lease(job_id, attempt_id, returned)
    # A later one still takes it, as does one of the same generation (a holder of an earlier release has none).
    again = build_holder("worker-c", 3)
    assert await store.start_build(job_id, attempt_id, again, "resumed (3)", generation=3)
    found = await db.admin.fetch("SELECT kind, worker_id FROM export_attempt_events WHERE job_id = $1 ORDER BY id",
                                 job_id)
    assert [(e["kind"], e["worker_id"]) for e in found] == [
        ("Claimed", "worker-a"), ("BuildStarted", first), ("BuildStarted", elsewhere), ("BuildStarted", again)]


async def build_starts(db, job_id: uuid.UUID) -> list[dict]:
    rows = await db.admin.fetch("SELECT worker_id, detail FROM export_attempt_events WHERE job_id = $1 "
                                "AND kind = 'BuildStarted' ORDER BY id", job_id)
    return [dict(r) for r in rows]


# --- a renewal that throws is retried soon, not a whole interval later -------------------------------------------


@pytest.mark.spec("RN1")
async def test_a_renewal_that_throws_is_retried_soon_so_a_short_outage_never_lets_the_lease_lapse(
        db, store, client, tmp_path):
    """A lease of 4 s renewed every 3 s: one renewal lost to a cut connection must not wait 3 s more for the next
    one, or the lease lapses while the worker is healthy."""
    async with AsyncExitStack() as stack:
        proxy = await open_proxy(stack, db)
        hold = Hold(BEFORE_CUTOFF_2)
        h = await lease_harness(stack, db, store, client, tmp_path, proxy=proxy, hold=hold, lease_seconds=4.0,
                        renew_every_seconds=3.0)
        job_id = await h.create()
        await hold.wait_held()  # the keeper, handed over by the build, renews every 3 s
        cut = proxy.cut_before(RENEWAL)
        await asyncio.wait_for(cut.wait(), BOUND)
        cut_at = time.monotonic()
        before = (await lease_state(db, job_id))["lease_expires_at"]
        watch_until = cut_at + 6.0
        while time.monotonic() < watch_until:
            state = await lease_state(db, job_id)
            assert state["expired"] is False, f"the lease lapsed after one failed renewal: {state}"
            await asyncio.sleep(0.1)
        renewed = await lease_state(db, job_id)
        assert renewed["lease_expires_at"] > before
        hold.release.set()
        row = await h.settled(job_id)
        assert row.status is Status.COMPLETED and row.attempt_count == 1


# --- LV4: a PostgreSQL outage shorter than the lease minus one renewal interval never lets the lease lapse --------

# Production's proportions (lease 60 s, renewed every 20 s), scaled down so that a doubling backoff from half a second
# reaches the interval within the outage: retries after 0.5, 1 and 2 s, then a whole interval (4 s) later.
LV4_LEASE = 10.5
LV4_RENEW = 4.0
# The keeper's promise (activities/lease.py): an outage shorter than lease - renew_every - its cap on a retry's delay
# (2 s) never lets the lease lapse. The outage below stays within that, and so within lease - renew_every.
LV4_RETRY_CAP = 2.0


@pytest.mark.spec("LV4")
async def test_a_postgresql_outage_shorter_than_the_lease_minus_one_interval_never_lets_the_lease_lapse(
        db, store, client, tmp_path, caplog):
    """The delivery is held before its upload while the keeper renews the lease every 4 s (lease 10.5 s). Every
    connection of the worker to PostgreSQL is cut and refused from just before a scheduled renewal until right after
    the third retry has failed (about 4 s). The next retry must come within a few seconds of PostgreSQL's return,
    not a whole interval later: the lease never lapses, recovery takes nothing over and the attempt delivers."""
    async with AsyncExitStack() as stack:
        proxy = await open_proxy(stack, db)
        hold = Hold(BEFORE_UPLOAD)
        h = await lease_harness(stack, db, store, client, tmp_path, proxy=proxy, hold=hold,
                                lease_seconds=LV4_LEASE, renew_every_seconds=LV4_RENEW)
        job_id = await h.create()
        attempt_id = await first_attempt(db, job_id)
        await hold.wait_held()  # the delivery has adopted the keeper; only its scheduled renewals touch the lease

        # A scheduled renewal, seen in the row: the next one is due one interval later.
        seen = (await lease_state(db, job_id))["lease_expires_at"]
        renewed = await eventually(lambda: lease_state(db, job_id), lambda s: s["lease_expires_at"] > seen,
                                   timeout=BOUND, interval=0.02, what="a scheduled renewal")
        renewed_at = time.monotonic()

        lapsed: list[dict] = []

        async def sample_the_lease() -> None:  # the database's clock, through the admin's own connection
            while True:
                state = await lease_state(db, job_id)
                if state["expired"]:
                    lapsed.append(state)
                await asyncio.sleep(0.05)

        sampler = asyncio.create_task(sample_the_lease())

        async def stop_sampling() -> None:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)

        stack.push_async_callback(stop_sampling)
        stack.callback(proxy.accept_new_connections)  # never leave the worker cut off, whatever fails below

        def failed_renewals() -> list[str]:
            return [r.getMessage() for r in caplog.records
                    if r.name == "activities.lease" and r.getMessage().startswith(f"lease renewal for {job_id} ")
                    and "failed" in r.getMessage()]

        with caplog.at_level(logging.WARNING, logger="activities.lease"):
            await asyncio.sleep(renewed_at + LV4_RENEW - 0.3 - time.monotonic())
            proxy.refuse_new_connections()
            proxy.cut_all()
            outage_from = time.monotonic()
            # The scheduled renewal fails, then its retries after 0.5, 1 and 2 s; PostgreSQL comes back right after
            # the third retry has failed.
            await eventually(lambda: asyncio.sleep(0, failed_renewals()), lambda f: len(f) >= 4, timeout=BOUND,
                             interval=0.01, what="four failed renewals")
            proxy.accept_new_connections()
            outage = time.monotonic() - outage_from
            failed = failed_renewals()
            # Watch the lease past the point where it would lapse had the keeper waited a whole interval.
            await asyncio.sleep(renewed_at + LV4_LEASE + 1.5 - time.monotonic())
            failed_after = failed_renewals()
        await stop_sampling()

        # The precondition: the outage was shorter than the lease minus one renewal interval (and the retry cap).
        assert outage < LV4_LEASE - LV4_RENEW - LV4_RETRY_CAP, f"the outage lasted {outage:.1f} s"
        # The outage really happened: the keeper's renewals failed, and the worker's connections were refused.
        assert len(failed) == 4 and failed_after == failed, failed_after
        assert proxy.refused >= 4
        assert lapsed == [], f"the lease lapsed after an outage of {outage:.1f} s: {lapsed[0]}"
        state = await lease_state(db, job_id)
        assert state["expired"] is False and state["lease_expires_at"] > renewed["lease_expires_at"]
        report = await run_recovery(h.client, h.settings)
        assert [t for t in report.taken_over if t.job_id == job_id] == []

        hold.release.set()
        row = await h.settled(job_id)
        assert row.status is Status.COMPLETED and row.attempt_count == 1 and row.attempt_id == attempt_id
        found = await events(db, job_id)
        assert kinds(found).count("DeliveryAuthorized") == 1 and kinds(found).count("Finished") == 1
        assert not {"RequeuedByRecovery", "ResolvedByRecovery"} & set(kinds(found))
        assert_partner_holds(h.partner, row, only=True)
