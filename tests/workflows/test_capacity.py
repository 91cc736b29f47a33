"""A worker's capacity (LD1, LD2): it runs at most EXPORTS_MAX_BUILDS builds and EXPORTS_MAX_UPLOADS uploads at
once; an export waiting for a build slot waits Queued, one waiting for an upload slot waits before cutoff 2 with
its lease kept; neither is ever taken for a lost worker, with recovery running all along. Real PostgreSQL, the
Temporal dev server and the SFTP partner; the intervals are read from the events the row's statements wrote."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterable
from contextlib import AsyncExitStack, suppress
from datetime import datetime

import pytest
from temporalio.service import RPCError

from activities.contracts import AdmitInput
from activities.exports import ExportActivities
from activities.process.dispatcher import OutboxDispatcher
from starter.localstack.partner import LocalPartner
from starter.localstack.seed import seed_destination
from store.db import asyncpg_dsn, make_engine
from store.models import Status
from store.outbox import Outbox
from tests.helpers.harness import Harness, WorkerProcess, open_harness, run_recovery, set_contract
from tests.helpers.store_states import drive
from tests.helpers.support import create_job, eventually, seed_tenant
from workflows.identity import export_workflow_id

LEASE = 3.0
MAX_BUILDS = 2
MAX_UPLOADS = 1
EXPORTS = 6


def most_at_once(intervals: Iterable[tuple[datetime, datetime]]) -> int:
    edges = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals],
                   key=lambda edge: (edge[0], edge[1]))  # an end before a start at the same instant
    running = most = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    return most


async def completed_first_time(db, rows: list, jobs: list[uuid.UUID]) -> dict[uuid.UUID, dict[str, datetime]]:
    """Every export Completed on its first attempt, none taken over by recovery: when each event kind was first
    recorded, per export."""
    assert all(row.status is Status.COMPLETED and row.attempt_count == 1 for row in rows), \
        [(row.status, row.attempt_count) for row in rows]
    events = await db.admin.fetch(
        "SELECT job_id, kind, recorded_at FROM export_attempt_events WHERE job_id = ANY($1::uuid[]) "
        "ORDER BY recorded_at", jobs)
    kinds = {event["kind"] for event in events}
    assert not kinds & {"RequeuedByRecovery", "AttemptsExhausted", "ResolvedByRecovery"}, kinds
    at: dict[uuid.UUID, dict[str, datetime]] = {}
    for event in events:
        at.setdefault(event["job_id"], {}).setdefault(event["kind"], event["recorded_at"])
    return at


async def recovering(h: Harness, stop: asyncio.Event, runs: list[int]) -> None:
    """Recovery every half second meanwhile: an attempt taken for lost would be taken over."""
    while not stop.is_set():
        with suppress(Exception):
            await asyncio.wait_for(run_recovery(h.client, h.settings), 20)
            runs.append(1)
        with suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


@pytest.mark.spec("LD1", "LD2")
async def test_a_worker_runs_its_configured_builds_and_uploads_at_once_and_no_wait_is_a_lost_worker(
        db, store, client, tmp_path):
    async with AsyncExitStack() as stack:
        # About 18 kB per export: a build of about 1.5 s, an upload of about 4 s, longer than the lease.
        h = await open_harness(stack, db, store, client, tmp_path, lease_seconds=LEASE, renew_every_seconds=1.0,
                               max_builds=MAX_BUILDS, max_uploads=MAX_UPLOADS,
                               # One destination here: its share must not be what bounds the attempts.
                               max_per_destination=MAX_BUILDS + MAX_UPLOADS,
                               build_throttle_bytes_per_second=12_000, upload_throttle_bytes_per_second=4_500)
        stop, runs = asyncio.Event(), []
        recovery = asyncio.create_task(recovering(h, stop, runs))
        try:
            jobs = [await h.create() for _ in range(EXPORTS)]
            rows = await asyncio.wait_for(asyncio.gather(*(h.settled(job) for job in jobs)), 240)
        finally:
            stop.set()
            await asyncio.wait_for(recovery, 30)

    at = await completed_first_time(db, rows, jobs)
    assert len(runs) >= 10, f"recovery ran {len(runs)} times only"
    # The creation's wake-up is written with the row.
    created = {row["job_id"]: row["created"] for row in await db.admin.fetch(
        "SELECT job_id, min(created_at) AS created FROM outbox WHERE job_id = ANY($1::uuid[]) GROUP BY job_id", jobs)}

    building = [(at[job]["Claimed"], at[job]["DeliveryAuthorized"]) for job in jobs]
    uploading = [(at[job]["DeliveryAuthorized"], at[job]["Finished"]) for job in jobs]
    queued = max((at[job]["Claimed"] - created[job]).total_seconds() for job in jobs)
    before_cutoff_2 = max((end - start).total_seconds() for start, end in building)
    print(f"\nLD1/LD2: builds at once {most_at_once(building)} (max {MAX_BUILDS}), uploads at once "
          f"{most_at_once(uploading)} (max {MAX_UPLOADS}); longest wait Queued {queued:.1f} s, longest from claim "
          f"to cutoff 2 {before_cutoff_2:.1f} s, lease {LEASE:.0f} s; {len(runs)} recovery runs")
    assert most_at_once(building) == MAX_BUILDS
    assert most_at_once(uploading) == MAX_UPLOADS
    # The waits were real and longer than a lease: Queued for a build slot, and claimed, built and waiting for an
    # upload slot with the lease kept.
    assert queued > LEASE, queued
    assert before_cutoff_2 > LEASE + 2, before_cutoff_2


@pytest.mark.spec("LD3")
async def test_no_more_uploads_run_to_a_partner_than_its_contract_allows_across_workers(db, store, client, tmp_path):
    """A destination whose partner accepts one session at once, two workers (this process's and another process):
    the uploads to it run one at a time; the others wait before cutoff 2, visibly, their leases kept, and none is
    taken for lost."""
    async with AsyncExitStack() as stack:
        # One build at a time on each worker, so that both take exports.
        h = await open_harness(stack, db, store, client, tmp_path, lease_seconds=LEASE, renew_every_seconds=1.0,
                               upload_throttle_bytes_per_second=9_000, max_builds=1)
        await set_contract(h, max_sessions=1)
        other = await WorkerProcess(h.settings).start()
        stack.push_async_callback(other.stop)
        await eventually(lambda: asyncio.sleep(0, other.log_path.exists() and "polling" in other.log_path.read_text()),
                         bool, timeout=60, interval=0.2, what="the other worker polling")
        stop, runs = asyncio.Event(), []
        recovery = asyncio.create_task(recovering(h, stop, runs))
        try:
            jobs = [await h.create() for _ in range(4)]
            waiting = await eventually(lambda: _waiting_details(h, jobs), bool, timeout=60, interval=0.2,
                                       what="an export shown waiting for a session at its partner")
            rows = await asyncio.wait_for(asyncio.gather(*(h.settled(job) for job in jobs)), 240)
        finally:
            stop.set()
            await asyncio.wait_for(recovery, 30)
        workers = {row["claimed_by"].split("/")[0] for row in await db.admin.fetch(
            "SELECT claimed_by FROM export_jobs WHERE id = ANY($1::uuid[])", jobs)}

    at = await completed_first_time(db, rows, jobs)
    uploading = [(at[job]["DeliveryAuthorized"], at[job]["Finished"]) for job in jobs]
    print(f"\nLD3: uploads at once to the partner {most_at_once(uploading)} (its contract: 1); claimed by "
          f"{len(workers)} workers; seen waiting: {waiting}")
    assert most_at_once(uploading) == 1
    assert len(workers) == 2, workers  # both workers delivered: the limit held across them
    sessions = await db.admin.fetchval("SELECT count(*) FROM partner_sessions")
    assert sessions == 0, sessions  # each given back at its attempt's end


async def _waiting_details(h: Harness, jobs: list[uuid.UUID]) -> str | None:
    """The heartbeat details of an export's cutoff-2 step that waits for a partner session, if any shows one."""
    for job in jobs:
        try:
            described = await h.client.get_workflow_handle(export_workflow_id(job)).describe()
        except RPCError:
            continue  # not started yet
        for pending in described.raw_description.pending_activities:
            if pending.activity_type.name == "authorize_delivery" and pending.heartbeat_details.payloads:
                text = pending.heartbeat_details.payloads[0].data.decode()
                if "session" in text:
                    return text
    return None


BURST = 24  # one tenant's exports, queued at once


@pytest.mark.spec("LD5")
async def test_a_tenants_burst_does_not_hold_back_another_tenants_export(db, store, client, tmp_path):
    """One build at a time on one worker, so that claims wait in Temporal's admission queue. Tenant A queues a
    burst; then tenant B queues one export. With each run keyed to its tenant (Temporal's fairness keys; the
    suite's server has fairness on, one partition a queue), B's claim is dispatched among A's first few, not
    behind A's whole backlog (first in, first out: last of all, as seen before the keys)."""
    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path, max_builds=1, build_throttle_bytes_per_second=80_000)
        partner = h.partner.destination()
        other_tenant, other_destination = await seed_tenant(db.admin, contacts=200, destination=dict(
            host=partner.host, port=partner.port, username=partner.username, final_dir=partner.final_dir,
            temp_dir=partner.temp_dir, host_key=partner.host_key, credential_ref=partner.credential_ref))
        burst = [await h.create() for _ in range(BURST)]
        # The burst's claims are waiting in Temporal's queue before B's export is created.
        await eventually(lambda: _started(h, burst), lambda n: n == BURST, timeout=60, interval=0.2,
                         what="every export of the burst started")
        single = await h.exports.create(tenant_id=other_tenant, destination_id=other_destination, created_by="tests")
        rows = await asyncio.wait_for(asyncio.gather(*(h.settled(job) for job in [*burst, single])), 240)

    at = await completed_first_time(db, rows, [*burst, single])
    claims = sorted(at, key=lambda job: at[job]["Claimed"])
    rank = claims.index(single) + 1
    claimed_before = sum(1 for job in burst if at[job]["Claimed"] < at[single]["Claimed"])
    print(f"\nLD5: the other tenant's export claimed {rank}th of {len(claims)}; {claimed_before} of the burst's "
          f"{BURST} claimed before it")
    # First in, first out, it would come after the whole burst; fairly, among the first few (a claim or two may
    # have been dispatched, or polled, before it was queued).
    assert claimed_before <= 4, claimed_before
    assert claimed_before < BURST - 1  # the burst was still waiting when it came: the test could tell


class _PacedDispatcher(OutboxDispatcher):
    """Each publication held a moment before Temporal is asked, as under a loaded server, so that a pass through
    a backlog takes long enough to be seen; `publishing` is set as the first begins."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.publishing = asyncio.Event()

    async def publish(self, message_id: uuid.UUID, job_id: uuid.UUID, tenant_id: uuid.UUID | None = None) -> None:
        self.publishing.set()
        await asyncio.sleep(PUBLISH_PACE)
        await super().publish(message_id, job_id, tenant_id)


PUBLISH_PACE = 0.1  # seconds a publication is held: a wave of the dispatcher's 16 takes about this long


@pytest.mark.spec("LD5")
async def test_a_tenants_row_is_published_amid_another_tenants_backlog_not_after_it(db, store, client):
    """The dispatcher publishes in waves; a pass used to publish the whole batch it read (100 rows) before it read
    again, so another tenant's row inserted meanwhile waited for the rest of that batch, however fair the read's
    order. A pass that hears of new rows (NOTIFY) now gives way once it has run a moment, and the next read takes
    the new tenant's row in its turn."""
    tenant_a, destination_a = await seed_tenant(db.admin)
    tenant_b, destination_b = await seed_tenant(db.admin)
    backlog = [await create_job(store, tenant_a, destination_a) for _ in range(100)]
    engine = make_engine(db.url("dispatcher"))
    dispatcher = _PacedDispatcher(client, Outbox(engine), asyncpg_dsn(db.url("dispatcher")),
                                  task_queue=f"nobody-polls-{uuid.uuid4().hex[:8]}", poll_seconds=0.2)
    stop = asyncio.Event()
    running = asyncio.create_task(dispatcher.run(stop))
    try:
        # While the pass that read the backlog publishes its first wave, B's row comes.
        await asyncio.wait_for(dispatcher.publishing.wait(), 30)
        single = await create_job(store, tenant_b, destination_b)
        await eventually(lambda: _published(db, [*backlog, single]), lambda n: n == len(backlog) + 1, timeout=60,
                         interval=0.05, what="every row published")
    finally:
        stop.set()
        await asyncio.wait_for(running, 10)
        await engine.dispose()
    single_at = await db.admin.fetchval("SELECT published_at FROM outbox WHERE job_id = $1", single)
    after = await db.admin.fetchval("SELECT count(*) FROM outbox WHERE job_id = ANY($1::uuid[]) AND published_at > $2",
                                    backlog, single_at)
    before = len(backlog) - after
    print(f"\nLD5: the other tenant's row published after {before} of the backlog's {len(backlog)} rows")
    # Behind the batch it would come after all 100. Giving way after a moment (a few waves of 16), it comes well
    # before the backlog's end.
    assert after >= 30, (before, after)


async def _published(db, jobs: list[uuid.UUID]) -> int:  # type: ignore[no-untyped-def]
    return await db.admin.fetchval(
        "SELECT count(*) FROM outbox WHERE job_id = ANY($1::uuid[]) AND published_at IS NOT NULL", jobs)


async def _started(h: Harness, jobs: list[uuid.UUID]) -> int:
    started = 0
    for job in jobs:
        try:
            await h.client.get_workflow_handle(export_workflow_id(job)).describe()
        except RPCError:
            continue
        started += 1
    return started


SLOW = 6  # exports to the slow partner, queued first
FAST = 3  # then exports to a healthy one


@pytest.mark.spec("LD4")
async def test_one_slow_partner_does_not_slow_the_others(db, store, client, tmp_path):
    """Two builds and two uploads a worker; a partner that takes seconds for each write, with a backlog queued to
    it, then a few exports to a healthy partner (one tenant: fairness between tenants plays no part). The slow
    partner may hold only its share of the worker (one of the two uploads), so the healthy partner's exports are
    claimed, built and delivered while the slow backlog is still waiting, rather than behind it (first in, first
    out, its claims queued behind builds that held every build slot waiting for an upload slot)."""
    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path, lease_seconds=LEASE, renew_every_seconds=1.0,
                               max_builds=2, max_uploads=2)
        slow = LocalPartner(tmp_path / "slow-partner")
        await slow.start()
        stack.push_async_callback(slow.stop)

        async def crawl(path: str, offset: int) -> None:
            await asyncio.sleep(2.0)

        slow.hooks.on_write = crawl
        dest = slow.destination()
        slow_destination = await seed_destination(
            db.admin, h.tenant_id, name="slow partner", host=dest.host, port=dest.port, username=dest.username,
            final_dir=dest.final_dir, temp_dir=dest.temp_dir, host_key=dest.host_key,
            credential_ref=dest.credential_ref)
        stop, runs = asyncio.Event(), []
        recovery = asyncio.create_task(recovering(h, stop, runs))
        try:
            backlog = [await h.exports.create(tenant_id=h.tenant_id, destination_id=slow_destination,
                                              created_by="tests") for _ in range(SLOW)]
            await eventually(lambda: _started(h, backlog), lambda n: n == SLOW, timeout=60, interval=0.2,
                             what="every export of the slow backlog started")
            fast = [await h.create() for _ in range(FAST)]
            rows = await asyncio.wait_for(asyncio.gather(*(h.settled(job) for job in [*backlog, *fast])), 300)
        finally:
            stop.set()
            await asyncio.wait_for(recovery, 30)

    at = await completed_first_time(db, rows, [*backlog, *fast])
    fast_done = max(at[job]["Finished"] for job in fast)
    claimed_after = sum(1 for job in backlog if at[job]["Claimed"] > fast_done)
    slow_uploads = [(at[job]["DeliveryAuthorized"], at[job]["Finished"]) for job in backlog]
    print(f"\nLD4: {claimed_after} of the slow partner's {SLOW} exports claimed after the healthy partner's last "
          f"delivery; slow uploads at once {most_at_once(slow_uploads)}")
    # Delivered while the slow backlog still waited: at least half of it was claimed only afterwards.
    assert claimed_after >= SLOW // 2, claimed_after
    assert most_at_once(slow_uploads) == 1  # its share: one upload slot always left to the others


@pytest.mark.spec("LD4")
async def test_a_claim_whose_retry_finds_its_own_committed_claim_counts_in_its_destinations_share(db, store):
    """A claim's first try commits and its answer is lost (a timeout, a dropped connection); Temporal tries the
    claim again and `_admit` finds the row Running under its own attempt. That retry takes a build slot for the
    attempt here (`_claim_output` -> `builds.hold`) but never reserves or settles the destination's share, so the
    attempt is not counted among its destination's attempts on this worker: with a share of 1, the next claim for
    the same destination is let through at once, and the worker holds two attempts to it."""
    tenant_id, destination_id = await seed_tenant(db.admin)
    settings = db.settings(task_queue=f"review-{uuid.uuid4().hex[:8]}", max_builds=4, max_uploads=4,
                           max_per_destination=1)
    activities = ExportActivities(store, settings, worker_id="worker-test", worker_task_queue="review-own")
    try:
        first = await create_job(store, tenant_id, destination_id)
        attempt = await drive(store, first, Status.RUNNING)  # the first try's claim, committed ("worker-test")
        admitted = await activities.claim_if_allowed(AdmitInput(job_id=first, attempt_id=attempt))
        assert admitted.claim is not None and admitted.claim.result.value == "Claimed", admitted
        assert activities.capacity.builds.holds((first, attempt))  # it holds its build slot here
        counted = activities.capacity.shares.in_flight(destination_id)
        other = (uuid.uuid4(), uuid.uuid4())
        let_through = activities.capacity.shares.reserve(destination_id, other)
        assert counted == 1 and not let_through, (
            f"the attempt holds a build slot here for its destination, yet the destination's share counts "
            f"{counted} attempt(s) in flight, and another claim to it {'was' if let_through else 'was not'} let "
            f"through at a share of {activities.capacity.shares.limit}")
    finally:
        await activities.close()
