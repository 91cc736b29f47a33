"""A partner's session limit (LD3) through what comes at it sideways: the contract changed while an export waits
for a session, recovery taking an attempt back while its upload still runs, and a delivery that starts after its
lease keeper gave up waiting for it."""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import AsyncExitStack

import pytest
from temporalio.client import Client

from activities.checkpoints import BEFORE_RENAME_FENCE, BEFORE_STEP, BEFORE_UPLOAD, Checkpoints
from activities.exports import ExportActivities
from activities.lease import heartbeat
from store.models import Status
from tests.helpers.harness import open_harness, set_contract
from tests.helpers.store_states import drive
from tests.helpers.support import create_job, eventually, seed_tenant
from worker import running_worker

LEASE = 3.0


class HoldFirst(Checkpoints):
    """Holds the first export to reach `name` there (heartbeating) until `release` is set."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.job: uuid.UUID | None = None
        self.held = asyncio.Event()
        self.release = asyncio.Event()

    def _passes(self, job_id: uuid.UUID) -> bool:
        return self.job is not None and self.job != job_id

    async def reached(self, name: str, job_id: uuid.UUID) -> None:
        if name != self.name or self._passes(job_id):
            return
        self.job = job_id
        self.held.set()
        while not self.release.is_set():
            heartbeat()
            await asyncio.sleep(0.2)


class MostConnections:
    """The most connections the partner had open at once while watched (sampled every 20 ms), for messages."""

    def __init__(self, h) -> None:  # type: ignore[no-untyped-def]
        self.h = h
        self.most = 0
        self._watch: asyncio.Task[None] | None = None

    async def __aenter__(self) -> MostConnections:
        self._watch = asyncio.create_task(self._watching())
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._watch is not None:
            self._watch.cancel()

    async def _watching(self) -> None:
        while True:
            self.most = max(self.most, self.h.partner.open_connections)
            await asyncio.sleep(0.02)


async def _status(h, job_id):  # type: ignore[no-untyped-def]
    row = await h.store.read_job(job_id)
    return None if row is None else row.status


@pytest.mark.spec("LD3")
@pytest.mark.parametrize("change", ["no_limit", "raised"])
async def test_an_export_waiting_for_a_session_goes_on_once_the_limit_is_cleared(db, store, client, tmp_path,
                                                                                 change):
    """`exports destinations update --no-max-sessions` (or a higher limit) while an export waits for a partner
    session: the partner now has no limit, so the waiting export goes on to cutoff 2 within a retry or two. It
    waited for the first export's upload to end (or for the 6-hour bound on its step) when the limit was cleared."""
    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path, lease_seconds=LEASE, renew_every_seconds=1.0)
        await set_contract(h, max_sessions=1)
        hold = HoldFirst(BEFORE_UPLOAD)
        h.activities.checkpoints = hold
        try:
            first = await h.create()
            await asyncio.wait_for(hold.held.wait(), 60)
            second = await h.create()
            # The second waits for the partner's only session, which the first holds.
            await eventually(lambda: db.admin.fetchval(
                "SELECT count(*) FROM export_attempt_events WHERE job_id = $1 AND kind = 'BuildStarted'", second),
                lambda n: n >= 1, timeout=60, what="the second export built")
            await asyncio.sleep(3)
            assert await _status(h, second) is Status.RUNNING
            if change == "no_limit":
                await set_contract(h, max_sessions=None)   # what --no-max-sessions writes
            else:
                await set_contract(h, max_sessions=5)      # raised: works by design (control)
            started = time.monotonic()
            try:
                await eventually(lambda: _status(h, second), lambda s: s is not Status.RUNNING, timeout=20,
                                 interval=0.2, what="the second export past cutoff 2 after the limit changed")
            finally:
                waited = time.monotonic() - started
                sessions = await db.admin.fetch("SELECT * FROM partner_sessions")
                print(f"\nchange={change}: waited {waited:.1f} s; partner_sessions {[dict(r) for r in sessions]}")
        finally:
            hold.release.set()
        rows = [await h.settled(job) for job in (first, second)]
        assert all(row.status is Status.COMPLETED for row in rows), [row.status for row in rows]


class HoldOnce(HoldFirst):
    """Holds the first attempt to reach `name` there (heartbeating) until `release` is set; later ones pass, its
    export's next attempt too."""

    def _passes(self, job_id: uuid.UUID) -> bool:
        return self.held.is_set()


def _positional(sql: str, names: list[str]) -> str:
    import re
    return re.sub(r":([a-z_]+)", lambda m: f"${names.index(m.group(1)) + 1}", sql)


async def take_back_as_recovery_would(h, job_id: uuid.UUID) -> str:  # type: ignore[no-untyped-def]
    """Recovery's take-back of the export's attempt (recovery_take_back.sql, as it stands), after its lease ran
    out unrenewed: what happens when the uploading worker cannot reach PostgreSQL for longer than a lease (a
    partition between that worker and the database, not the partner). Arranged in one transaction that holds the
    row lock, so the worker's renewals wait and then find the attempt gone, exactly as after the partition."""
    from pathlib import Path
    sql = (Path(__file__).resolve().parents[2] / "store/sql/recovery_take_back.sql").read_text()
    names = ["amid_others", "with_its_worker", "max_attempts", "max_shared_losses", "max_losses_amid_others",
             "max_hand_backs", "job_id", "expired_attempt_id", "renew_seconds", "lost_by", "recovery_run_id"]
    names = [n for n in names if f":{n}" in sql]
    values = {"amid_others": False, "with_its_worker": False, "max_attempts": 5, "max_shared_losses": 5,
              "max_losses_amid_others": 5, "max_hand_backs": 5, "job_id": job_id, "lost_by": "worker-x",
              "recovery_run_id": "test-recovery"}
    conn = await h.db.connect("owner")
    try:
        async with conn.transaction():
            attempt = await conn.fetchval("SELECT attempt_id FROM export_jobs WHERE id = $1 FOR UPDATE", job_id)
            await conn.execute("UPDATE export_jobs SET lease_expires_at = clock_timestamp() - interval '1 second' "
                               "WHERE id = $1", job_id)
            values["expired_attempt_id"] = attempt
            kind = await conn.fetchval(_positional(sql, names), *[values[n] for n in names])
    finally:
        await conn.close()
    return kind


@pytest.mark.spec("LD3")
async def test_an_upload_that_lost_its_lease_keeps_its_session_and_upload_slot_while_it_runs(db, store, client,
                                                                                             tmp_path):
    """A partner that accepts one session (max_sessions 1), a worker with one upload slot (max_uploads 1). Export A
    is uploading (every byte sent, its SFTP session open, the rename not yet sent) when its attempt is taken back
    by recovery (its worker could not renew for a lease). Its upload goes on to its end, by design ("once
    started, an upload is not stopped by ... a lost lease"): its session at the partner and its upload slot are
    still in use. Export B, waiting for the partner's session, does not start its upload meanwhile: it did, with
    the partner's only session and the worker's only upload slot both counted free."""
    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path, lease_seconds=LEASE, renew_every_seconds=1.0,
                               max_uploads=1, max_builds=2, max_per_destination=2)
        await set_contract(h, max_sessions=1)
        hold = HoldOnce(BEFORE_RENAME_FENCE)
        h.activities.checkpoints = hold
        seen = await stack.enter_async_context(MostConnections(h))
        try:
            first = await h.create()
            await asyncio.wait_for(hold.held.wait(), 60)
            second = await h.create()
            await eventually(lambda: db.admin.fetchval(
                "SELECT count(*) FROM export_attempt_events WHERE job_id = $1 AND kind = 'BuildStarted'", second),
                lambda n: n >= 1, timeout=60, what="the second export built")
            await asyncio.sleep(2)
            assert await _status(h, second) is Status.RUNNING  # waiting for the session, as it should
            seen.most = h.partner.open_connections
            print(f"\nbefore the takeover: partner connections open {seen.most}, upload slots in use "
                  f"{h.activities.capacity.uploads.in_use}")
            kind = await take_back_as_recovery_would(h, first)
            assert kind == "RequeuedByRecovery", kind
            # A's upload is still under way (held before its rename fence, its SFTP session open).
            await asyncio.sleep(6)
            status = await _status(h, second)
            print(f"6 s after the takeover, A still uploading: B is {status}; partner connections seen at once "
                  f"{seen.most}; upload slots in use {h.activities.capacity.uploads.in_use}; "
                  f"partner_sessions {[dict(r) for r in await db.admin.fetch('SELECT * FROM partner_sessions')]}")
            assert status is Status.RUNNING, (
                f"B went past cutoff 2 ({status}) while A's upload still held the partner's only session and the "
                f"worker's only upload slot; partner connections open at once: {seen.most}")
        finally:
            hold.release.set()


class HoldDeliverStartThenFence(Checkpoints):
    """The first export's `deliver` held at its start (before it adopts the lease keeper) for `hold` seconds, as a
    deliver scheduled late would be (its run's workflow task delayed: Temporal away, a sticky queue waited out);
    then the first export other than it to reach the rename fence is held there until `release`."""

    def __init__(self, hold: float) -> None:
        self.start_name = f"{BEFORE_STEP}deliver"
        self.hold = hold
        self.first: uuid.UUID | None = None
        self.first_held = asyncio.Event()
        self.first_released = asyncio.Event()
        self.fence_held = asyncio.Event()
        self.release = asyncio.Event()

    async def reached(self, name: str, job_id: uuid.UUID) -> None:
        if name == self.start_name and self.first in (None, job_id) and not self.first_released.is_set():
            self.first = job_id
            self.first_held.set()
            started = time.monotonic()
            while time.monotonic() - started < self.hold:
                heartbeat()
                await asyncio.sleep(0.2)
            self.first_released.set()
        elif name == BEFORE_RENAME_FENCE and job_id != self.first and not self.fence_held.is_set():
            self.fence_held.set()
            while not self.release.is_set():
                heartbeat()
                await asyncio.sleep(0.2)


@pytest.mark.spec("LD3")
async def test_a_deliver_that_starts_after_the_hand_over_window_waits_for_its_session(db, store, client,
                                                                                           tmp_path):
    """max_sessions 1. Export A is authorized (it holds the partner's only session and an upload slot), but its
    `deliver` starts late, after the hand-over window (lease + renewal + sticky timeout + workflow task timeout):
    the keeper gives up, and with it go A's upload slot and its partner session. Export B then takes the session
    and uploads (held before its rename, its session open). No recovery ran meanwhile (Temporal was away, say), so
    A's `deliver` confirms its lease (renew_lease.sql does not look at the expiry). It uploaded then, beside B: two
    sessions at a partner whose contract allows one, and an upload that held no upload slot. It takes both again
    first, and so waits for B."""
    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path, lease_seconds=LEASE, renew_every_seconds=1.0,
                               sticky_queue_timeout_seconds=1.0, max_uploads=1, max_builds=2,
                               max_per_destination=2)
        await set_contract(h, max_sessions=1)
        window = LEASE + 1.0 + 1.0 + 10.0
        hold = HoldDeliverStartThenFence(window + 4)
        h.activities.checkpoints = hold
        seen = await stack.enter_async_context(MostConnections(h))
        try:
            first = await h.create()
            await asyncio.wait_for(hold.first_held.wait(), 60)
            second = await h.create()
            await asyncio.wait_for(hold.first_released.wait(), 60)
            b_at_fence = hold.fence_held.is_set()
            print(f"\nA's deliver released after {window + 4:.0f} s; B held in its upload: {b_at_fence}; "
                  f"partner_sessions {[dict(r) for r in await db.admin.fetch('SELECT * FROM partner_sessions')]}")
            await asyncio.sleep(5)
            a = await _status(h, first)
            print(f"5 s later: A is {a}, B is {await _status(h, second)} (held in its upload: "
                  f"{hold.fence_held.is_set() and not hold.release.is_set()}); partner connections at once "
                  f"{seen.most}; upload slots in use {h.activities.capacity.uploads.in_use}")
            assert not (b_at_fence and a is Status.COMPLETED), (
                "A uploaded (Completed) while B held the partner's only session in its upload: "
                f"{seen.most} connections at the partner at once")
        finally:
            hold.release.set()


@pytest.mark.spec("LD3")
async def test_a_limit_set_between_cutoff_2_and_the_upload_holds_up_neither_export(db, store, client, tmp_path):
    """One upload slot. Export A is authorized with no limit on its partner (no session taken) and its upload has
    not begun when the limit is set to one; export B then waits at cutoff 2 for the worker's only upload slot,
    A's, holding no session (the slot comes first). A's upload, authorized before the limit, goes on without a
    session: were it to wait for one, and B to hold it while waiting for A's slot, each would wait for the other
    until its step's bound."""
    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path, lease_seconds=LEASE, renew_every_seconds=1.0,
                               max_uploads=1, max_builds=2, max_per_destination=2)
        hold = HoldFirst(f"{BEFORE_STEP}deliver")
        h.activities.checkpoints = hold
        try:
            first = await h.create()
            await asyncio.wait_for(hold.held.wait(), 60)
            await set_contract(h, max_sessions=1)
            second = await h.create()
            await eventually(lambda: asyncio.sleep(0, h.activities.capacity.uploads.waiting), lambda n: n == 1,
                             timeout=60, interval=0.2, what="the second export waiting at cutoff 2 for A's upload slot")
            assert await _status(h, second) is Status.RUNNING
            assert await db.admin.fetchval("SELECT count(*) FROM partner_sessions WHERE job_id = $1", second) == 0
        finally:
            hold.release.set()
        rows = await asyncio.wait_for(asyncio.gather(h.settled(first), h.settled(second)), 90)
        assert [row.status for row in rows] == [Status.COMPLETED, Status.COMPLETED]


@pytest.mark.spec("LD3", "LD4")
async def test_a_partner_session_is_not_held_idle_by_an_attempt_waiting_for_its_workers_upload_slot(
        db, store, client, tmp_path):
    """Two workers. Partner P accepts one session (max_sessions 1). Worker W1 (one upload slot) is busy uploading
    to a slow partner Q. Export A to P, built on W1, waits at cutoff 2 for W1's upload slot. Export B to P is built
    on W2, which has upload slots free. Before (found by review), A took P's only session first and held it while
    it waited for W1's slot: nothing at all was uploaded to P for as long as W1's upload to Q lasted (hours, for a
    slow partner), so one slow partner stalled another partner's exports on every worker. Now the slot comes
    first, and B takes P's session and delivers."""
    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path, lease_seconds=3.0, renew_every_seconds=1.0,
                               max_uploads=1, max_builds=1)
        hold = HoldFirst(BEFORE_UPLOAD)
        h.activities.checkpoints = hold
        # Q: another destination of the tenant (the same local SFTP server stands in for a second partner).
        slow_q = await db.admin.fetchval(
            "INSERT INTO destinations SELECT (jsonb_populate_record(NULL::destinations, to_jsonb(d) "
            "|| jsonb_build_object('id', gen_random_uuid(), 'name', 'slow partner q'))).* "
            "FROM destinations d WHERE d.id = $1 RETURNING id", h.destination_id)
        status = {}

        async def read(job):  # type: ignore[no-untyped-def]
            row = await store.read_job(job)
            status[job] = row.status
            return row.status

        try:
            x = await h.exports.create(tenant_id=h.tenant_id, destination_id=slow_q, created_by="tests")
            await asyncio.wait_for(hold.held.wait(), 60)  # W1's only upload slot: X's upload to Q
            await set_contract(h, max_sessions=1)         # P accepts one session at once
            a = await h.create()
            await eventually(lambda: asyncio.sleep(0, h.activities.capacity.uploads.waiting), lambda n: n == 1,
                             timeout=60, interval=0.2, what="A waiting at cutoff 2 on W1 for its upload slot")
            assert await db.admin.fetchval("SELECT count(*) FROM partner_sessions WHERE job_id = $1", a) == 0
            # W2: a second worker, its upload slots free.
            second_client = await asyncio.wait_for(Client.connect(
                client.service_client.config.target_host, namespace=client.namespace,
                data_converter=client.data_converter), 30)
            w2 = h.settings.model_copy(update={"max_uploads": 4, "max_builds": 4,
                                               "work_dir": tmp_path / "work-w2"})
            await stack.enter_async_context(running_worker(w2, second_client, with_dispatcher=False))
            b = await h.create()
            await eventually(lambda: db.admin.fetchval(
                "SELECT count(*) FROM export_attempt_events WHERE job_id = $1 AND kind = 'BuildStarted'", b),
                lambda n: n >= 1, timeout=60, what="B built (on W2: W1 takes no claim, its only build slot held)")
            try:
                await eventually(lambda: read(b), lambda s: s is not Status.RUNNING, timeout=20, interval=0.5,
                                 what="B past cutoff 2 on W2")
            except AssertionError:
                uploads_to_p = await db.admin.fetchval(
                    "SELECT count(*) FROM export_jobs WHERE destination_id = $1 AND status = 'Delivering'",
                    h.destination_id)
                raise AssertionError(
                    f"for 20 s, P (max_sessions 1) had {uploads_to_p} upload(s) under way: its only session is held "
                    f"by A ({await read(a)}), which waits on W1 for the upload slot of X's upload to Q "
                    f"({await read(x)}); B ({status[b]}) waits on W2 with upload slots free") from None
            assert (await h.settled(b)).status is Status.COMPLETED  # while X's upload still holds W1's slot
            assert await read(x) is Status.DELIVERING
        finally:
            hold.release.set()
        rows = await asyncio.wait_for(asyncio.gather(h.settled(a), h.settled(x)), 90)
        assert [row.status for row in rows] == [Status.COMPLETED, Status.COMPLETED]


@pytest.mark.spec("LD3")
async def test_an_export_waiting_for_a_partner_session_is_not_overtaken_by_later_ones(db, store):
    """max_sessions 1. Export W has waited for the partner's only session since the start (the worker's wait loop,
    `_session_under`, asking every second). Each time the session frees, an export that began waiting after W asks
    a few hundred ms before W's next ask. Before (found by review), it took the slot: take_partner_session.sql
    handed a freed slot to whoever asked first, so W was overtaken round after round, its wait bounded only by its
    step's 6 hours. Now waiters are served in the order they began (migration 0020)."""
    tenant_id, destination_id = await seed_tenant(db.admin)
    await db.admin.execute("UPDATE destinations SET max_sessions = 1 WHERE id = $1", destination_id)
    settings = db.settings(task_queue=f"review-{uuid.uuid4().hex[:8]}")
    activities = ExportActivities(store, settings, worker_id="worker-test", worker_task_queue="review-own")

    async def live_attempt() -> tuple[uuid.UUID, uuid.UUID]:
        job = await create_job(store, tenant_id, destination_id)
        return job, await drive(store, job, Status.RUNNING)

    holder = await live_attempt()
    assert (await store.take_partner_session(destination_id, *holder)).slot == 1
    waiter_job, waiter_attempt = await live_attempt()
    waiter_row = await store.read_job(waiter_job)
    loop = asyncio.get_running_loop()
    started = loop.time()  # the waiter asks at started + 0, 1, 2, ... (one statement each, a few ms)
    waiting = asyncio.create_task(activities._session_under(1, waiter_row, waiter_attempt, {}))
    served_before_it: list[uuid.UUID] = []
    try:
        for round_ in range(1, 5):
            # Half-way between two of the waiter's asks, the holder's upload ends and it gives its session back;
            # a quarter second later an export that began waiting after the waiter asks.
            await asyncio.sleep(max(0.0, started + round_ + 0.25 - loop.time()))
            await store.release_partner_session(*holder)
            await asyncio.sleep(max(0.0, started + round_ + 0.5 - loop.time()))
            newcomer = await live_attempt()
            if (await store.take_partner_session(destination_id, *newcomer)).slot is None:
                break  # the waiter got it first, as it should
            served_before_it.append(newcomer[0])
            holder = newcomer
        assert not served_before_it, (
            f"the export that waited longest for the partner's only session was overtaken "
            f"{len(served_before_it)} time(s) in {loop.time() - started:.1f} s by exports that began waiting after "
            f"it; it still waits: {not waiting.done()}")
    finally:
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        await activities.close()


@pytest.mark.spec("LD3")
async def test_a_session_taken_again_by_a_late_upload_is_not_deleted_by_the_keepers_release(db, store, monkeypatch):
    """Noted by review: the keeper that gave up waiting for the upload releases the attempt's session in a task of
    its own; a late `deliver` that takes the session again meanwhile found the old row still there (it holds it),
    and the release then deleted it: the upload ran with no session counted at a partner that limits them."""
    tenant_id, destination_id = await seed_tenant(db.admin)
    await db.admin.execute("UPDATE destinations SET max_sessions = 1 WHERE id = $1", destination_id)
    activities = ExportActivities(store, db.settings(task_queue=f"late-{uuid.uuid4().hex[:8]}"),
                                  worker_id="worker-test", worker_task_queue="late-own")
    try:
        job = await create_job(store, tenant_id, destination_id)
        attempt = await drive(store, job, Status.RUNNING)
        row = await store.read_job(job)
        await activities._session_under(1, row, attempt, {})  # cutoff 2's session
        releasing, release = asyncio.Event(), store.release_partner_session

        async def slow_release(*key):  # type: ignore[no-untyped-def]
            releasing.set()
            await asyncio.sleep(0.5)  # the database slow to answer
            await release(*key)

        monkeypatch.setattr(store, "release_partner_session", slow_release)
        activities._free((job, attempt))  # the keeper gave up waiting for the upload
        await asyncio.wait_for(releasing.wait(), 5)
        await asyncio.wait_for(activities._session_under(1, row, attempt, {}), 10)  # the late upload takes it again
        await asyncio.sleep(1)  # the release, had it come after, would have deleted it by now
        held = await db.admin.fetchval(
            "SELECT count(*) FROM partner_sessions WHERE job_id = $1 AND attempt_id = $2", job, attempt)
        assert held == 1, "the late upload's session was deleted by the keeper's release that came after it"
    finally:
        await activities.close()


@pytest.mark.spec("LD3")
async def test_a_late_upload_whose_release_failed_holds_its_session_while_it_waits_for_an_upload_slot(
        db, store, monkeypatch):
    """max_sessions 1, one upload slot on the worker. L was authorized with P's only session; its keeper gave up
    waiting for `deliver` and its release of the session failed (a database blip): the row still names L, which is
    Delivering, so the slot stays live. Export W then takes the worker's only upload slot at cutoff 2 and waits for
    the session. L's late `deliver` takes its upload slot first (`_upload_capacity`). Before (found by review), it
    still held P's session in the database while it waited for that slot: W waited for L's session, L for W's
    slot. Now it gives that session back before it waits."""
    tenant_id, destination_id = await seed_tenant(db.admin)
    await db.admin.execute("UPDATE destinations SET max_sessions = 1 WHERE id = $1", destination_id)
    activities = ExportActivities(store, db.settings(task_queue=f"rc-{uuid.uuid4().hex[:8]}", max_uploads=1,
                                                     max_builds=1),
                                  worker_id="worker-test", worker_task_queue="rc-own")
    tasks: list[asyncio.Task[None]] = []
    try:
        late_job = await create_job(store, tenant_id, destination_id)
        late_attempt = await drive(store, late_job, Status.DELIVERING)
        late_row = await store.read_job(late_job)
        await activities._session_under(1, late_row, late_attempt, {})  # cutoff 2's session
        assert (late_job, late_attempt) in activities.partner_sessions

        async def failing_release(*key):  # type: ignore[no-untyped-def]
            raise ConnectionResetError("connection reset by peer")  # the database blips as the keeper gives up

        monkeypatch.setattr(store, "release_partner_session", failing_release)
        activities._free((late_job, late_attempt))  # the keeper gave up waiting for deliver
        await asyncio.sleep(0.2)

        waiter_job = await create_job(store, tenant_id, destination_id)
        waiter_attempt = await drive(store, waiter_job, Status.RUNNING)
        waiter_row = await store.read_job(waiter_job)
        # W at cutoff 2: the worker's only upload slot first, then the session.
        await activities._slot(activities.capacity.uploads, waiter_row, waiter_attempt, {})
        tasks.append(asyncio.create_task(activities._session_under(1, waiter_row, waiter_attempt, {})))
        # L's late deliver: its upload slot, then its session.
        tasks.append(asyncio.create_task(activities._upload_capacity(1, late_row, late_attempt, {})))
        done, _ = await asyncio.wait(tasks, timeout=8)
        live = await db.admin.fetchval(
            "SELECT count(*) FROM partner_sessions WHERE job_id = $1 AND attempt_id = $2", late_job, late_attempt)
        assert done, (
            f"deadlock: for 8 s W held the worker's only upload slot waiting for P's only session, while L (its "
            f"session row still live: {live}) waited for W's upload slot")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await activities.close()
