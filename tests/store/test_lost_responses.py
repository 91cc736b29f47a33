"""Lost responses, with real faults: a proxy between the store and PostgreSQL drops the server's COMMIT reply after
the server has committed, or the statement before it reaches the server, and refuses or holds the re-read's new
connection. The row in the database is the authority for every assertion."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import pytest
from sqlalchemy import text

from activities.contracts import AuthorizeInput
from activities.exports import ExportActivities
from store import errors
from store.db import make_engine
from store.jobs import JobStore
from store.models import AuthorizationResult, BuiltFile, ClaimResult, FailureCode, JobRow, Status
from tests.helpers.events import events, kinds
from tests.helpers.faults import CLAIM_STATEMENT, PgFaultProxy
from tests.helpers.support import create_job, eventually, seed_tenant

T = TypeVar("T")

CUTOFF_2 = "authorized AS ("
BOUND = 15.0  # seconds; every store call here finishes far sooner or the test fails


async def bounded(call: Awaitable[T]) -> T:
    return await asyncio.wait_for(call, BOUND)


@pytest.fixture
async def faulty(db, proxy) -> AsyncIterator[JobStore]:
    """The attempt's store, connected through the proxy as the application role."""
    engine = make_engine(proxy.url("exports_app", db.name))
    try:
        yield JobStore(engine, lease_seconds=5, reread_timeout_seconds=2)
    finally:
        await engine.dispose()


async def queued_job(db, store: JobStore) -> uuid.UUID:
    tenant_id, destination_id = await seed_tenant(db.admin)
    return await create_job(store, tenant_id, destination_id)


async def running_job(db, store: JobStore) -> tuple[uuid.UUID, uuid.UUID]:
    """A job claimed directly (no proxy) by a fresh attempt."""
    job_id = await queued_job(db, store)
    attempt_id = uuid.uuid4()
    assert await store.claim(job_id, 1, attempt_id, "worker-a") is ClaimResult.CLAIMED
    return job_id, attempt_id


async def warm(faulty: JobStore, proxy: PgFaultProxy, job_id: uuid.UUID) -> None:
    """One pooled connection for the write to use, so the re-read after a cut needs a new one."""
    await bounded(faulty.read_job(job_id))
    assert proxy.accepted == 1


def built_file(tmp_path: Path, job: JobRow) -> BuiltFile:
    path = tmp_path / "built.csv"
    path.write_bytes(b"id,email\n")
    return BuiltFile(path=str(path), final_name=job.final_name, size=9, sha256_hex="ab" * 32)


async def job_row(db, job_id: uuid.UUID) -> dict[str, Any]:
    return dict(await db.admin.fetchrow("SELECT * FROM export_jobs WHERE id = $1", job_id))


async def kinds_and_attempts(db, job_id: uuid.UUID) -> list[tuple[str, uuid.UUID]]:
    """What these tests assert on: which event, for which attempt."""
    return [(e["kind"], e["attempt_id"]) for e in await events(db, job_id)]


async def reread_waiting(proxy: PgFaultProxy) -> None:
    async def held() -> int:
        return proxy.held

    await eventually(held, lambda n: n == 1, timeout=15, what="the re-read waiting for its connection")


def uncertain_logged(caplog: pytest.LogCaptureFixture) -> bool:
    return any("is uncertain" in r.getMessage() for r in caplog.records if r.name == "store.statements")


# --- the claim and cutoff 2: the response lost after the commit, the re-read confirms ------------------------------


@pytest.mark.spec("LR1")
async def test_claim_response_lost_after_commit__reread_finds_it_claimed(db, store, proxy, faulty, caplog):
    job_id = await queued_job(db, store)
    await warm(faulty, proxy, job_id)
    cut = proxy.cut_after_commit(CLAIM_STATEMENT)
    attempt_id = uuid.uuid4()
    with caplog.at_level(logging.WARNING, logger="store"):
        result = await bounded(faulty.claim(job_id, 1, attempt_id, "worker-a"))
    assert cut.is_set() and uncertain_logged(caplog)  # the COMMIT reply really was lost
    assert proxy.accepted == 2  # the re-read went through a new connection
    assert result is ClaimResult.CLAIMED
    row = await job_row(db, job_id)
    assert (row["status"], row["attempt_id"], row["attempt_count"], row["claimed_by"]) == (
        "Running", attempt_id, 1, "worker-a")
    assert await kinds_and_attempts(db, job_id) == [("Claimed", attempt_id)]


@pytest.mark.spec("LR2")
async def test_cutoff_2_response_lost_after_commit__reread_finds_it_authorized(
    db, store, proxy, faulty, caplog, tmp_path
):
    job_id, attempt_id = await running_job(db, store)
    job = await store.read_job(job_id)
    await warm(faulty, proxy, job_id)
    cut = proxy.cut_after_commit(CUTOFF_2)
    with caplog.at_level(logging.WARNING, logger="store"):
        result = await bounded(faulty.authorize_delivery(job, attempt_id, built_file(tmp_path, job)))
    assert cut.is_set() and uncertain_logged(caplog)
    assert result is AuthorizationResult.AUTHORIZED
    row = await job_row(db, job_id)
    assert (row["status"], row["attempt_id"], row["expected_file_name"]) == (
        "Delivering", attempt_id, job.final_name)
    assert row["delivery_authorized_at"] is not None
    assert await kinds_and_attempts(db, job_id) == [("Claimed", attempt_id), ("DeliveryAuthorized", attempt_id)]


@pytest.mark.spec("LR2", "LV4")
async def test_cutoff_2_answer_lost_through_an_outage_the_lease_outlives__authorized_once_the_database_is_back(
    db, store, proxy, tmp_path
):
    """Cutoff 2 commits and its answer is lost at the moment a failover begins; the database takes longer than half
    a lease to come back, but less than the lease. The attempt still holds its row (its keeper renews it once the
    database is back), so it asks the row again for as long as the lease holds and delivers; it used to give up
    after half a lease, leaving an authorized attempt that no one uploads for recovery to take back (seen in CI's
    failover run, where no recovery runs and the export stayed Delivering)."""
    lease = 8.0
    engine = make_engine(proxy.url("exports_app", db.name))
    faulty = JobStore(engine, lease_seconds=lease, reread_timeout_seconds=1)
    try:
        job_id, attempt_id = await running_job(db, store)
        job = await store.read_job(job_id)
        file = built_file(tmp_path, job)
        activities = ExportActivities(faulty, db.settings(lease_seconds=lease, renew_every_seconds=1.0),
                                      worker_id="worker-a", worker_task_queue="unused")
        await warm(faulty, proxy, job_id)
        proxy.refuse_new_connections()
        cut = proxy.cut_after_commit(CUTOFF_2)
        attempt = asyncio.create_task(activities.authorize_delivery(AuthorizeInput(job=job, attempt_id=attempt_id,
                                                                                   file=file)))
        await eventually(lambda: _ready(cut.is_set()), bool, timeout=BOUND, what="cutoff 2 committed, its answer cut")
        outage = 0.7 * lease  # past half the lease, short of lease - renew_every - one retry delay
        await asyncio.sleep(outage)
        assert not attempt.done(), attempt  # still asking, through the outage
        refused_during_outage = proxy.refused
        proxy.accept_new_connections()
        output = await bounded(attempt)
    finally:
        await engine.dispose()
    assert refused_during_outage >= 2  # the outage was real: the re-read and the renewals were refused
    assert output.result is AuthorizationResult.AUTHORIZED
    assert Path(file.path).exists()  # kept for the upload
    row = await job_row(db, job_id)
    assert (row["status"], row["attempt_id"], row["rename_fence"]) == ("Delivering", attempt_id, "open")
    assert await kinds_and_attempts(db, job_id) == [("Claimed", attempt_id), ("DeliveryAuthorized", attempt_id)]


@pytest.mark.spec("LR2", "PT6")
async def test_cutoff_2_answer_lost_and_no_read_write_host_yet__asked_again_not_given_up(db, store, proxy, tmp_path):
    """A failover between the commit and its answer: cutoff 2's reply is lost as the primary goes, and the re-read's
    new connection finds only a server that is not yet read-write (libpq's target_session_attrs=read-write refuses
    it: asyncpg's TargetServerAttributeNotMatched). Nothing was sent, so the write stays uncertain: the attempt asks
    the row again until a primary answers, and delivers. The re-read used to raise that error, as a definite one,
    and the activity failed at once with its attempt authorized (seen failing under load in the failover test:
    an export left Delivering, and another left Running, for a recovery that never came)."""
    engine = make_engine(proxy.url("exports_app", db.name) + "?target_session_attrs=read-write")
    faulty = JobStore(engine, lease_seconds=8.0, reread_timeout_seconds=1)
    try:
        job_id, attempt_id = await running_job(db, store)
        job = await store.read_job(job_id)
        file = built_file(tmp_path, job)
        activities = ExportActivities(faulty, db.settings(lease_seconds=8.0, renew_every_seconds=1.0),
                                      worker_id="worker-a", worker_task_queue="unused")
        await warm(faulty, proxy, job_id)
        # New sessions read-only, as on a standby not yet promoted; the pooled connection keeps its own.
        await db.admin.execute(f"ALTER DATABASE {db.name} SET default_transaction_read_only = on")
        cut = proxy.cut_after_commit(CUTOFF_2)
        attempt = asyncio.create_task(activities.authorize_delivery(AuthorizeInput(job=job, attempt_id=attempt_id,
                                                                                   file=file)))
        await eventually(lambda: _ready(cut.is_set()), bool, timeout=BOUND, what="cutoff 2 committed, its answer cut")
        await asyncio.sleep(2.0)
        assert not attempt.done(), attempt  # still asking while no host is read-write
        accepted_while_read_only = proxy.accepted
        await db.admin.execute(f"ALTER DATABASE {db.name} RESET default_transaction_read_only")  # promoted
        output = await bounded(attempt)
    finally:
        await engine.dispose()
    assert accepted_while_read_only >= 3  # the warm one, then new sessions turned away as not read-write
    assert output.result is AuthorizationResult.AUTHORIZED
    assert Path(file.path).exists()
    row = await job_row(db, job_id)
    assert (row["status"], row["attempt_id"]) == ("Delivering", attempt_id)
    assert await kinds_and_attempts(db, job_id) == [("Claimed", attempt_id), ("DeliveryAuthorized", attempt_id)]


async def _ready(value: bool) -> bool:
    return value


async def resolve_by_recovery(db, job_id: uuid.UUID, attempt_id: uuid.UUID) -> None:
    """What recovery's resolution of an expired Delivering attempt commits, done as the owner."""
    async with db.admin.transaction():
        await db.admin.execute(
            "UPDATE export_jobs SET status = 'OutcomeUnknown', lease_expires_at = NULL "
            "WHERE id = $1 AND attempt_id = $2 AND status = 'Delivering'", job_id, attempt_id)
        await db.admin.execute(
            "INSERT INTO export_attempt_events (job_id, attempt_id, kind, observed_by, detail, recorded_at) "
            "VALUES ($1, $2, 'ResolvedByRecovery', 'recovery-test', 'OutcomeUnknown: no evidence', "
            "clock_timestamp())", job_id, attempt_id)


@pytest.mark.spec("LR5")
async def test_recovery_resolves_before_the_reread__attempt_sees_wrong_state_and_writes_nothing(
    db, store, proxy, faulty, tmp_path
):
    job_id, attempt_id = await running_job(db, store)
    job = await store.read_job(job_id)
    file = built_file(tmp_path, job)
    activities = ExportActivities(faulty, db.settings(), worker_id="worker-a", worker_task_queue="unused")
    await warm(faulty, proxy, job_id)
    proxy.hold_new_connections()
    cut = proxy.cut_after_commit(CUTOFF_2)
    # The attempt's own activity: cutoff 2 commits, its reply is lost, and its re-read waits for a connection.
    attempt = asyncio.create_task(activities.authorize_delivery(AuthorizeInput(job=job, attempt_id=attempt_id,
                                                                               file=file)))
    await reread_waiting(proxy)
    assert cut.is_set()
    await resolve_by_recovery(db, job_id, attempt_id)
    resolved_row, resolved_events = await job_row(db, job_id), await kinds_and_attempts(db, job_id)
    proxy.accept_new_connections()

    output = await bounded(attempt)
    assert output.result is AuthorizationResult.NOT_OWNER  # its own ID, in OutcomeUnknown
    assert not Path(file.path).exists()  # it gives up its file and goes no further
    # Nothing written after recovery: the row and the history are exactly what recovery left.
    assert await job_row(db, job_id) == resolved_row
    assert resolved_row["status"] == "OutcomeUnknown" and resolved_row["attempt_id"] == attempt_id
    assert await kinds_and_attempts(db, job_id) == resolved_events == [
        ("Claimed", attempt_id), ("DeliveryAuthorized", attempt_id), ("ResolvedByRecovery", attempt_id)]


async def test_terminal_write_lost_before_the_server__recovery_resolution_is_not_mistaken_for_it(
    db, store, proxy, faulty
):
    # The worker would record OutcomeUnknown itself; recovery records the same state for the same attempt first.
    # Only this attempt's own Finished event makes the re-read report the write as done.
    job_id, attempt_id = await _arrange_terminal(db, store, "delivery")
    await warm(faulty, proxy, job_id)
    proxy.hold_new_connections()
    cut = proxy.cut_before("WITH finished AS")
    attempt = asyncio.create_task(faulty.finish_delivery(
        job_id, attempt_id, Status.OUTCOME_UNKNOWN, None, "rename interrupted"))
    await reread_waiting(proxy)
    assert cut.is_set()
    await resolve_by_recovery(db, job_id, attempt_id)
    proxy.accept_new_connections()
    assert await bounded(attempt) is False
    assert kinds(await events(db, job_id)) == ["Claimed", "DeliveryAuthorized", "ResolvedByRecovery"]


async def test_claim_cut_before_the_server_and_reread_finds_the_row_untouched__unconfirmed_not_lost(
        db, store, proxy, faulty, caplog):
    """The claim never reached the server and the re-read answers: the row is Queued at the version the claim
    checked, so no one else took or changed it. Lost would leave the job to the next wake-up, which may never come
    (its wake-up was this one); Unknown has the workflow read the row again shortly, and a claim by a new attempt
    runs the job once."""
    job_id = await queued_job(db, store)
    await warm(faulty, proxy, job_id)
    cut = proxy.cut_before(CLAIM_STATEMENT)
    assert await bounded(faulty.claim(job_id, 1, uuid.uuid4(), "worker-a")) is ClaimResult.UNKNOWN
    assert cut.is_set() and uncertain_logged(caplog)
    row = await job_row(db, job_id)
    assert (row["status"], row["attempt_id"], row["attempt_count"]) == ("Queued", None, 0)
    again = uuid.uuid4()
    assert await bounded(faulty.claim(job_id, 1, again, "worker-b")) is ClaimResult.CLAIMED
    assert await kinds_and_attempts(db, job_id) == [("Claimed", again)]


async def test_claim_cut_before_the_server_after_an_edit__lost(db, store, proxy, faulty):
    """The re-read finds the row changed since the version the claim checked (an edit): Lost, as a claim that
    answered 0 rows; the edit's own wake-up brings the job back."""
    job_id = await queued_job(db, store)
    await warm(faulty, proxy, job_id)
    await db.admin.execute("UPDATE export_jobs SET version = version + 1 WHERE id = $1", job_id)
    cut = proxy.cut_before(CLAIM_STATEMENT)
    assert await bounded(faulty.claim(job_id, 1, uuid.uuid4(), "worker-a")) is ClaimResult.LOST
    assert cut.is_set()
    assert await kinds_and_attempts(db, job_id) == []


# --- the re-read fails too: Unknown, and the row says what really happened -----------------------------------------


async def test_claim_cut_before_commit_and_reread_refused__unknown_and_still_queued(db, store, proxy, faulty):
    # The store half of LR3; the unsettled wake-up and the second claim need the workflow.
    job_id = await queued_job(db, store)
    await warm(faulty, proxy, job_id)
    proxy.refuse_new_connections()
    cut = proxy.cut_before(CLAIM_STATEMENT)
    assert await bounded(faulty.claim(job_id, 1, uuid.uuid4(), "worker-a")) is ClaimResult.UNKNOWN
    assert cut.is_set() and proxy.refused >= 1
    row = await job_row(db, job_id)
    assert (row["status"], row["attempt_id"], row["attempt_count"]) == ("Queued", None, 0)
    assert await kinds_and_attempts(db, job_id) == []
    # Once the database is reachable again, a claim for a new attempt runs the job once.
    proxy.accept_new_connections()
    again = uuid.uuid4()
    assert await bounded(faulty.claim(job_id, 1, again, "worker-b")) is ClaimResult.CLAIMED
    assert await kinds_and_attempts(db, job_id) == [("Claimed", again)]


async def test_claim_cut_after_commit_and_reread_refused__unknown_and_running(db, store, proxy, faulty):
    # The store half of LR4; the repeated wake-up and recovery's takeover need the workflow.
    job_id = await queued_job(db, store)
    await warm(faulty, proxy, job_id)
    proxy.refuse_new_connections()
    cut = proxy.cut_after_commit(CLAIM_STATEMENT)
    attempt_id = uuid.uuid4()
    assert await bounded(faulty.claim(job_id, 1, attempt_id, "worker-a")) is ClaimResult.UNKNOWN
    assert cut.is_set() and proxy.refused >= 1
    row = await job_row(db, job_id)
    assert (row["status"], row["attempt_id"], row["attempt_count"]) == ("Running", attempt_id, 1)
    assert await kinds_and_attempts(db, job_id) == [("Claimed", attempt_id)]
    # A repeated claim of the same version finds it Running with another attempt's ID: Lost, nothing written.
    proxy.accept_new_connections()
    assert await bounded(faulty.claim(job_id, 1, uuid.uuid4(), "worker-a")) is ClaimResult.LOST
    assert await kinds_and_attempts(db, job_id) == [("Claimed", attempt_id)]


async def test_cutoff_2_cut_after_commit_and_reread_held_past_its_bound__unknown(db, store, proxy, faulty, tmp_path):
    job_id, attempt_id = await running_job(db, store)
    job = await store.read_job(job_id)
    await warm(faulty, proxy, job_id)
    proxy.hold_new_connections()  # the re-read's connection never answers: its 2 s bound ends it
    cut = proxy.cut_after_commit(CUTOFF_2)
    result = await bounded(faulty.authorize_delivery(job, attempt_id, built_file(tmp_path, job)))
    assert cut.is_set() and result is AuthorizationResult.UNKNOWN
    assert (await job_row(db, job_id))["status"] == "Delivering"



@pytest.mark.spec("PT5")
async def test_cutoff_2_step_whose_answer_and_reread_are_lost_asks_the_row_again_and_finds_itself_authorized(
        db, store, proxy, faulty, tmp_path):
    """The step, not the store: cutoff 2 committed, its answer cut and its re-read held past its bound (Unknown at
    the store, as above). Once connections are taken again the step reads the row again and answers Authorized,
    keeping its file, instead of leaving an authorized attempt for recovery to take back (a failover's case)."""
    job_id, attempt_id = await running_job(db, store)
    job = await store.read_job(job_id)
    file = built_file(tmp_path, job)
    activities = ExportActivities(faulty, db.settings(), worker_id="worker-a", worker_task_queue="unused")
    await warm(faulty, proxy, job_id)
    proxy.hold_new_connections()
    cut = proxy.cut_after_commit(CUTOFF_2)
    step = asyncio.create_task(activities.authorize_delivery(AuthorizeInput(job=job, attempt_id=attempt_id,
                                                                            file=file)))
    await eventually(lambda: asyncio.sleep(0, cut.is_set()), bool, timeout=BOUND, what="cutoff 2 cut")
    await asyncio.sleep(3.0)  # past the re-read's bound: the store answered Unknown, and the step asks again
    assert not step.done()
    proxy.accept_new_connections()
    output = await asyncio.wait_for(step, BOUND)
    assert output.result is AuthorizationResult.AUTHORIZED
    assert Path(file.path).exists()  # kept for the upload
    assert (await job_row(db, job_id))["status"] == "Delivering"
    await activities.close()


@pytest.mark.spec("PT5", "PT6")
async def test_cutoff_2_step_started_during_a_database_outage_shorter_than_its_lease_authorizes_afterwards(
        db, store, proxy, faulty, tmp_path):
    """A failover seen by the step that reaches cutoff 2 just then: its connections cut, new ones refused for
    longer than half a lease but less than the lease less one renewal. The lease never lapses (the keeper renews as
    soon as the database answers again), so the step waits the outage out and authorizes; giving up earlier lost
    the attempt to a lapse a lease later (the clean failover test, under load)."""
    lease, renew, outage = 10.0, 1.0, 7.0
    job_id, attempt_id = await running_job(db, store)
    job = await store.read_job(job_id)
    file = built_file(tmp_path, job)
    activities = ExportActivities(faulty, db.settings(lease_seconds=lease, renew_every_seconds=renew),
                                  worker_id="worker-a", worker_task_queue="unused")
    await warm(faulty, proxy, job_id)
    proxy.cut_all()
    proxy.refuse_new_connections()
    step = asyncio.create_task(activities.authorize_delivery(AuthorizeInput(job=job, attempt_id=attempt_id,
                                                                            file=file)))
    await asyncio.sleep(outage)
    assert not step.done(), step.result() if not step.exception() else step.exception()
    assert proxy.refused >= 3  # the outage was seen: the step and its keeper asked again meanwhile
    proxy.accept_new_connections()
    output = await asyncio.wait_for(step, BOUND)
    assert output.result is AuthorizationResult.AUTHORIZED
    assert Path(file.path).exists()  # kept for the upload
    row = await job_row(db, job_id)
    assert (row["status"], row["attempt_id"]) == ("Delivering", attempt_id)
    await activities.close()

# --- the terminal writes ---------------------------------------------------------------------------------------


async def _arrange_terminal(db, store: JobStore, which: str) -> tuple[uuid.UUID, uuid.UUID]:
    job_id, attempt_id = await running_job(db, store)
    if which == "stopped":
        await db.admin.execute("UPDATE export_jobs SET stop_request_id = $2 WHERE id = $1", job_id, uuid.uuid4())
    elif which == "delivery":
        job = await store.read_job(job_id)
        file = BuiltFile(path="/nonexistent", final_name=job.final_name, size=1, sha256_hex="00" * 32)
        assert await store.authorize_delivery(job, attempt_id, file) is AuthorizationResult.AUTHORIZED
    return job_id, attempt_id


def _terminal_call(faulty: JobStore, which: str, job_id: uuid.UUID, attempt_id: uuid.UUID) -> Awaitable[bool]:
    if which == "stopped":
        return faulty.finish_stopped(job_id, attempt_id, "WhileBuilding")
    if which == "failed":
        return faulty.finish_failed(job_id, attempt_id, FailureCode.BUILD_FAILED, "disk full")
    return faulty.finish_delivery(job_id, attempt_id, Status.COMPLETED, None, "confirmed", confirmed_by="size")


TERMINAL = {  # which -> (marker, expected status, its event)
    "stopped": ("WITH stopped AS", "Stopped", "Stopped"),
    "failed": ("WITH failed AS", "Failed", "Failed"),
    "delivery": ("WITH finished AS", "Completed", "Finished"),
}


@pytest.mark.parametrize("which", sorted(TERMINAL))
async def test_terminal_write_response_lost_after_commit__reread_reports_true(
    db, store, proxy, faulty, caplog, which
):
    marker, status, kind = TERMINAL[which]
    job_id, attempt_id = await _arrange_terminal(db, store, which)
    await warm(faulty, proxy, job_id)
    cut = proxy.cut_after_commit(marker)
    with caplog.at_level(logging.WARNING, logger="store"):
        assert await bounded(_terminal_call(faulty, which, job_id, attempt_id)) is True
    assert cut.is_set() and uncertain_logged(caplog)
    row = await job_row(db, job_id)
    assert (row["status"], row["attempt_id"], row["lease_expires_at"]) == (status, attempt_id, None)
    found = kinds(await events(db, job_id))
    assert found.count(kind) == 1 and found[-1] == kind
    # Asked again, the row still says this attempt recorded it, and no second event is added.
    assert await bounded(_terminal_call(faulty, which, job_id, attempt_id)) is True
    assert kinds(await events(db, job_id)) == found


@pytest.mark.parametrize("which", sorted(TERMINAL))
async def test_terminal_write_cut_before_the_server__reread_reports_false(db, store, proxy, faulty, which):
    marker, _, _ = TERMINAL[which]
    job_id, attempt_id = await _arrange_terminal(db, store, which)
    before = await job_row(db, job_id)
    await warm(faulty, proxy, job_id)
    cut = proxy.cut_before(marker)
    assert await bounded(_terminal_call(faulty, which, job_id, attempt_id)) is False
    assert cut.is_set()
    assert await job_row(db, job_id) == before


async def test_terminal_write_lost_and_reread_refused__false_without_raising(db, store, proxy, faulty, caplog):
    job_id, attempt_id = await _arrange_terminal(db, store, "failed")
    await warm(faulty, proxy, job_id)
    proxy.refuse_new_connections()
    cut = proxy.cut_after_commit("WITH failed AS")
    with caplog.at_level(logging.WARNING, logger="store"):
        written = await bounded(faulty.finish_failed(job_id, attempt_id, FailureCode.BUILD_FAILED, "disk full"))
    assert cut.is_set() and written is False
    assert any("leaving it to recovery" in r.getMessage() for r in caplog.records)
    # It did commit: recovery, not this attempt, will find the row Failed.
    assert (await job_row(db, job_id))["status"] == "Failed"


@pytest.mark.spec("OU3")
async def test_delivery_terminal_write_lost_and_reread_refused__raises_so_the_delivery_asks_again(
        db, store, proxy, faulty):
    """The delivery alone knows its outcome: no answer is an error it waits out, and asking again after the
    database returns finds its own commit."""
    job_id, attempt_id = await _arrange_terminal(db, store, "delivery")
    await warm(faulty, proxy, job_id)
    proxy.refuse_new_connections()
    cut = proxy.cut_after_commit("WITH finished AS")
    with pytest.raises(Exception) as raised:
        await bounded(faulty.finish_delivery(job_id, attempt_id, Status.COMPLETED, None, "confirmed",
                                             confirmed_by="size"))
    assert cut.is_set() and errors.is_transient(raised.value)
    proxy.accept_new_connections()
    assert await bounded(faulty.finish_delivery(job_id, attempt_id, Status.COMPLETED, None, "confirmed",
                                                confirmed_by="size")) is True
    assert (await job_row(db, job_id))["status"] == "Completed"


# --- real answers stay answers -------------------------------------------------------------------------------------


async def test_constraint_violations_are_raised_as_domain_errors_not_uncertain(db, store, proxy, faulty, caplog):
    job_id = await queued_job(db, store)
    attempt_id = uuid.uuid4()
    # An event already recorded for this attempt makes the claim's insert, and so the whole statement, fail: the
    # attempt ID is spent (a retry after a requeue), which is a definite answer, Lost (LK2), and nothing changed.
    await db.admin.execute(
        "INSERT INTO export_attempt_events (job_id, attempt_id, kind, recorded_at) "
        "VALUES ($1, $2, 'Claimed', clock_timestamp())", job_id, attempt_id)
    with caplog.at_level(logging.WARNING, logger="store"):
        assert await bounded(faulty.claim(job_id, 1, attempt_id, "worker-a")) is ClaimResult.LOST
        assert (await job_row(db, job_id))["status"] == "Queued"

        running_id, running_attempt = await running_job(db, store)
        await db.admin.execute(
            "INSERT INTO export_attempt_events (job_id, attempt_id, kind, recorded_at) "
            "VALUES ($1, $2, 'Failed', clock_timestamp())", running_id, running_attempt)
        with pytest.raises(errors.TransitionAlreadyRecorded):
            await bounded(faulty.finish_failed(running_id, running_attempt, FailureCode.BUILD_FAILED))
        assert (await job_row(db, running_id))["status"] == "Running"
    assert not uncertain_logged(caplog)


async def test_uncertainty_is_what_a_cut_raises_and_nothing_else(db, proxy):
    conn = await asyncpg.connect(f"postgresql://postgres@127.0.0.1:{proxy.port}/{db.name}")
    try:
        # Two operations at once on one connection: refused by the adapter before anything is sent.
        results = await asyncio.gather(conn.fetchval("SELECT pg_sleep(0.2)"), conn.fetchval("SELECT 1"),
                                       return_exceptions=True)
        refused = [r for r in results if isinstance(r, BaseException)]
        assert len(refused) == 1 and isinstance(refused[0], asyncpg.InterfaceError)
        assert not errors.is_uncertain(refused[0])
    finally:
        await conn.close()
    with pytest.raises(asyncpg.InterfaceError) as closed:
        await conn.fetchval("SELECT 1")
    assert errors.is_uncertain(closed.value)  # "connection is closed"

    # A statement in flight when every connection is cut, through SQLAlchemy as the store runs it.
    engine = make_engine(proxy.url("exports_app", db.name))
    try:
        async with engine.connect() as sa_conn:
            sleeping = asyncio.create_task(sa_conn.execute(text("SELECT pg_sleep(10)")))
            await eventually(
                lambda: db.admin.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(10)' AND state = 'active'"),
                lambda n: n == 1, timeout=15, what="the statement running on the server")
            proxy.cut_all()
            with pytest.raises(Exception) as cut:
                await bounded(sleeping)
        assert errors.is_uncertain(cut.value), repr(cut.value)
    finally:
        await engine.dispose()


async def test_a_pooled_connection_the_server_closed_is_replaced_before_a_write_uses_it(
        db, store, proxy, faulty, caplog):
    """No ping before each statement (it cost three round trips), yet a connection closed while it sat in the pool
    (a restart, a cut) is never handed to a write: asyncpg has seen it close, and the pool replaces it at checkout,
    so the claim is answered at once instead of going through the uncertain path and its re-read."""
    job_id = await queued_job(db, store)
    await warm(faulty, proxy, job_id)
    proxy.cut_all()
    await eventually(lambda: asyncio.sleep(0, proxy.open_connections), lambda n: n == 0, timeout=BOUND,
                     what="the proxy closed the pooled connection")
    await asyncio.sleep(0.2)  # the client's event loop reads the close (it does in well under this)
    with caplog.at_level(logging.WARNING, logger="store"):
        assert await bounded(faulty.claim(job_id, 1, uuid.uuid4(), "worker-a")) is ClaimResult.CLAIMED
    assert proxy.accepted == 2  # the closed connection was replaced, not used
    assert not [r for r in caplog.records if "uncertain" in r.getMessage()], caplog.text
    assert (await store.read_job(job_id)).status is Status.RUNNING


@pytest.mark.spec("RI4", "LR2")
async def test_rename_fence_cut_before_the_server__not_a_refusal_but_an_error_to_try_again(db, store, proxy, faulty):
    """The fence's write never reached the server and the re-read finds the attempt still holding its row with the
    fence open: that is no refusal (recovery took nothing back), so the upload must try again, not give up its
    rename (it once did, ending a delivery Failed/NotDelivered for a blip). Then it passes."""
    job_id, attempt_id = await _arrange_terminal(db, store, "delivery")
    await warm(faulty, proxy, job_id)
    cut = proxy.cut_before("rename_fence = 'passed'")
    with pytest.raises(ConnectionError, match="was not written") as raised:
        await bounded(faulty.pass_rename_fence(job_id, attempt_id, "worker-a", "worker-a/test", {"step": "rename"}))
    assert cut.is_set() and errors.is_transient(raised.value)
    assert await db.admin.fetchval("SELECT rename_fence FROM export_jobs WHERE id = $1", job_id) == "open"
    assert await bounded(faulty.pass_rename_fence(job_id, attempt_id, "worker-a", "worker-a/test", {"step": "rename"}))


@pytest.mark.spec("RI4", "LR2")
async def test_rename_fence_cut_after_commit__the_reread_says_passed(db, store, proxy, faulty):
    job_id, attempt_id = await _arrange_terminal(db, store, "delivery")
    await warm(faulty, proxy, job_id)
    cut = proxy.cut_after_commit("rename_fence = 'passed'")
    assert await bounded(faulty.pass_rename_fence(job_id, attempt_id, "worker-a", "worker-a/test", {"step": "rename"}))
    assert cut.is_set()
    assert await db.admin.fetchval("SELECT rename_fence FROM export_jobs WHERE id = $1", job_id) == "passed"
