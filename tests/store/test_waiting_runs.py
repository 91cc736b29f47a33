"""A run that waits on an attempt, and that attempt's terminal write (migration 0017): whichever takes the row first,
the run learns of the end, by reading the settled row or by the write's wake-up. The store half of the chaos
run's seed 738109; tests/workflows/test_crash.py has the run itself."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable

import pytest

from store.jobs import JobStore
from store.models import AuthorizationResult, CancellationOutcome, ClaimResult, FailureCode, Status
from store.recovery import Recovery
from tests.helpers.events import events, kinds
from tests.helpers.store_states import built_file, cancel, drive, expire, outbox
from tests.helpers.support import create_job, seed_tenant
from tests.store.test_race import BOUND, contend

RACES = 12


async def delivering(store: JobStore, db) -> tuple[uuid.UUID, uuid.UUID]:
    tenant_id, destination_id = await seed_tenant(db.admin)
    job_id = await create_job(store, tenant_id, destination_id)
    return job_id, await drive(store, job_id, Status.DELIVERING)


def finishing(store: JobStore, job_id: uuid.UUID, attempt_id: uuid.UUID) -> Awaitable[bool]:
    return store.finish_delivery(job_id, attempt_id, Status.COMPLETED, None, "uploaded", confirmed_by="size")


@pytest.mark.spec("HI4")
async def test_a_waiting_run_and_the_terminal_write__either_order_the_run_learns_of_the_end(db, app_engine):
    store = JobStore(app_engine, lease_seconds=5.0, lock_timeout_ms=int(BOUND * 1000))
    seen = {"woken": 0, "read settled": 0}
    for race in range(RACES):
        job_id, attempt_id = await delivering(store, db)
        before = len(await outbox(db, job_id))

        def waiting() -> Awaitable[bool]:
            return store.run_waits_on_attempt(job_id, attempt_id)

        def writing() -> Awaitable[bool]:
            return finishing(store, job_id, attempt_id)

        if race % 2 == 0:
            marked, written = await contend(db, job_id, waiting, writing)
        else:
            written, marked = await contend(db, job_id, writing, waiting)
        assert written
        wakeups = len(await outbox(db, job_id)) - before
        if marked:  # the mark came first: the run waits, and the write woke it
            seen["woken"] += 1
            assert wakeups == 1
        else:  # the write came first: the mark found nothing to wait on, and the run reads the settled row
            seen["read settled"] += 1
            assert wakeups == 0 and (await store.read_job(job_id)).status is Status.COMPLETED
    assert seen["woken"] >= 1 and seen["read settled"] >= 1, seen


@pytest.mark.spec("HI4")
async def test_a_terminal_write_that_no_run_waits_on_wakes_nothing(db, store):
    """The usual end: the run has the upload's answer, and no wake-up is written (none costs a signal)."""
    job_id, attempt_id = await delivering(store, db)
    before = await outbox(db, job_id)
    assert await finishing(store, job_id, attempt_id)
    assert await outbox(db, job_id) == before


@pytest.mark.spec("HI4")
async def test_a_mark_names_its_attempt_only(db, store):
    """A mark is the attempt's: for another attempt ID it matches nothing, and after a lapse of the lease (a paused
    worker) it is still taken, changing no state."""
    job_id, attempt_id = await delivering(store, db)
    assert not await store.run_waits_on_attempt(job_id, uuid.uuid4())
    await expire(db, job_id)
    row = await store.read_job(job_id)
    assert await store.run_waits_on_attempt(job_id, attempt_id)
    assert await store.read_job(job_id) == row.model_copy(update={"run_waits_for": attempt_id})


@pytest.mark.spec("HI4")
@pytest.mark.parametrize("ending", ["Stopped", "Failed"])
async def test_a_running_attempts_own_terminal_write_wakes_the_run_waiting_on_it(db, store, ending):
    """A late cutoff 2 (Temporal gave it up, and the run read the row `Running` and waits) ends the attempt itself:
    `Stopped` at a recorded stop, `Failed` at a refusal. Either wakes the run that marked the row, once."""
    tenant_id, destination_id = await seed_tenant(db.admin)
    job_id = await create_job(store, tenant_id, destination_id)
    attempt_id = await drive(store, job_id, Status.RUNNING)
    if ending == "Stopped":
        assert (await cancel(store, tenant_id, job_id)).outcome is CancellationOutcome.STOP_REQUESTED
    before = len(await outbox(db, job_id))
    assert await store.run_waits_on_attempt(job_id, attempt_id)
    if ending == "Stopped":
        assert await store.finish_stopped(job_id, attempt_id, "BeforeDelivery")
    else:
        assert await store.finish_failed(job_id, attempt_id, FailureCode.ORIGINAL_DELIVERED, "arranged")
    assert len(await outbox(db, job_id)) - before == 1


async def given_up_mark(db, job_id: uuid.UUID) -> uuid.UUID | None:
    return await db.admin.fetchval("SELECT cutoff_2_given_up FROM export_jobs WHERE id = $1", job_id)


@pytest.mark.spec("LV5")
async def test_cutoff_2_refuses_an_attempt_its_run_said_it_gave_up_and_no_other(db, store):
    """The run's read names the attempt whose cutoff 2 it gave up (migration 0022): that attempt's cutoff 2 is refused
    (NotOwner, nothing written), while a read that names another attempt, or none, marks only the wait."""
    tenant_id, destination_id = await seed_tenant(db.admin)
    kept, given_up = [await create_job(store, tenant_id, destination_id) for _ in range(2)]
    kept_attempt, given_up_attempt = [await drive(store, job_id, Status.RUNNING) for job_id in (kept, given_up)]
    assert await store.run_waits_on_attempt(kept, kept_attempt, uuid.uuid4())  # a step of another run, or older
    assert await store.run_waits_on_attempt(kept, kept_attempt)
    assert await store.run_waits_on_attempt(given_up, given_up_attempt, given_up_attempt)
    assert (await given_up_mark(db, kept), await given_up_mark(db, given_up)) == (None, given_up_attempt)

    row = await store.read_job(given_up)
    assert await store.authorize_delivery(row, given_up_attempt, built_file(row.final_name)) \
        is AuthorizationResult.NOT_OWNER
    assert (await store.read_job(given_up)).status is Status.RUNNING
    assert "DeliveryAuthorized" not in kinds(await events(db, given_up))
    row = await store.read_job(kept)
    assert await store.authorize_delivery(row, kept_attempt, built_file(row.final_name)) \
        is AuthorizationResult.AUTHORIZED


@pytest.mark.spec("LV5")
async def test_a_given_up_mark_on_a_row_past_cutoff_2_is_not_written(db, store):
    """Once cutoff 2 committed (the run's read came after it), the mark would mean nothing: only the wait is noted."""
    job_id, attempt_id = await delivering(store, db)
    assert await store.run_waits_on_attempt(job_id, attempt_id, attempt_id)
    assert await given_up_mark(db, job_id) is None


@pytest.mark.spec("LV5")
async def test_a_stale_given_up_mark_refuses_none_of_the_later_attempts_writes(db, store, app_engine, tenant):
    """A mark names one attempt for good (0022): every write of a later attempt goes through, from the claim to the
    terminal write, the fence and its retry included (found sound by review)."""
    recovery = Recovery(app_engine, max_attempts=5, on_ended=lambda _s: None)
    job_id = await create_job(store, *tenant)
    a1 = await drive(store, job_id, Status.RUNNING)
    assert await store.run_waits_on_attempt(job_id, a1, a1)  # the run gave a1's cutoff 2 up
    assert await store.release_lease(job_id, a1, "worker-test")  # the step handed it back
    await expire(db, job_id)
    [candidate] = [c for c in await recovery.nominate(limit=10) if c.job_id == job_id]
    assert await recovery.take_over_running(candidate, uuid.uuid4()) is not None
    row = await store.read_job(job_id)
    assert row.status is Status.QUEUED
    assert await db.admin.fetchval("SELECT cutoff_2_given_up FROM export_jobs WHERE id = $1", job_id) == a1
    a2 = uuid.uuid4()
    assert await store.claim(job_id, row.version, a2, "worker-test") is ClaimResult.CLAIMED
    assert await store.renew_lease(job_id, a2)
    assert await store.run_waits_on_attempt(job_id, a2)
    assert await store.run_waits_on_attempt(job_id, a2, a1)  # a later read still naming a1
    row = await store.read_job(job_id)
    assert await store.authorize_delivery(row, a2, built_file(row.final_name)) is AuthorizationResult.AUTHORIZED
    assert await store.renew_lease(job_id, a2)
    assert await store.pass_rename_fence(job_id, a2, "worker-test", "worker-test/t", {"step": "rename"})
    assert await store.pass_rename_fence(job_id, a2, "worker-test", "worker-test/t", {"step": "rename"})
    assert await store.finish_delivery(job_id, a2, Status.COMPLETED, None, "done", confirmed_by="size")
    assert (await store.read_job(job_id)).status is Status.COMPLETED


@pytest.mark.spec("LV5")
async def test_a_later_attempt_given_up_too_is_marked_and_its_stop_recorded(db, store, app_engine, tenant):
    recovery = Recovery(app_engine, max_attempts=5, on_ended=lambda _s: None)
    job_id = await create_job(store, *tenant)
    a1 = await drive(store, job_id, Status.RUNNING)
    assert await store.run_waits_on_attempt(job_id, a1, a1)
    await expire(db, job_id)
    [candidate] = [c for c in await recovery.nominate(limit=10) if c.job_id == job_id]
    assert await recovery.take_over_running(candidate, uuid.uuid4()) is not None
    a2 = await drive(store, job_id, Status.RUNNING)
    assert await store.run_waits_on_attempt(job_id, a2, a2)  # a2 given up too: the mark moves to the row's own
    await cancel(store, tenant[0], job_id)
    assert await store.finish_stopped(job_id, a2, "WhileBuilding")
    assert (await store.read_job(job_id)).status is Status.STOPPED, kinds(await events(db, job_id))
