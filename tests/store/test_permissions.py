"""The database refuses a change without its event (GR1) and an event without its change (GR2), for every role
but the owner, against real PostgreSQL and its roles. Each refusal is checked to leave the row and its history
as they were; the documented statements are driven through the store to show they still work."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from store import errors
from store.jobs import JobStore
from store.models import AuthorizationResult, CancellationOutcome, ClaimResult, FailureCode, JobRow, Status
from store.reconciliation import Reconciliation
from store.recovery import Recovery
from store.statements import statement
from tests.helpers.events import events, kinds
from tests.helpers.store_states import built_file, drive, expire
from tests.helpers.support import create_job

# The dispatcher's own write (store/sql/outbox_mark_published.sql, for one row and without its condition).
MARK = "UPDATE outbox SET published_at = clock_timestamp() WHERE message_id = $1"

INSERT_EVENT = ("INSERT INTO export_attempt_events (job_id, attempt_id, kind, worker_id, recorded_at) "
                "VALUES ($1, $2, $3, $4, clock_timestamp())")


@pytest.fixture
async def app(db) -> AsyncIterator[asyncpg.Connection]:
    conn = await db.connect("app")
    try:
        yield conn
    finally:
        await conn.close()


@pytest.fixture
async def reconciler_conn(db) -> AsyncIterator[asyncpg.Connection]:
    conn = await db.connect("reconciler")
    try:
        yield conn
    finally:
        await conn.close()


@pytest.fixture
async def dispatcher(db) -> AsyncIterator[asyncpg.Connection]:
    conn = await db.connect("dispatcher")
    try:
        yield conn
    finally:
        await conn.close()


async def arrange(db, store: JobStore, tenant, state: str) -> tuple[uuid.UUID, uuid.UUID | None]:
    """A job in `state`, reached through the documented statements; its ID and its attempt's."""
    tenant_id, destination_id = tenant
    job_id = await create_job(store, tenant_id, destination_id)
    if state == "Queued":
        return job_id, None
    if state == "Failed":
        return job_id, await drive(store, job_id, Status.FAILED, FailureCode.BUILD_FAILED)
    if state == "Stopped":
        attempt = await drive(store, job_id, Status.RUNNING)
        await stop_request(store, tenant_id, job_id)
        assert await store.finish_stopped(job_id, attempt, "arranged")
        return job_id, attempt
    if state == "OutcomeUnknown":
        attempt = await drive(store, job_id, Status.DELIVERING)
        await expire(db, job_id)
        assert await Recovery(store.engine, max_attempts=3).resolve(
            job_id, attempt, Status.OUTCOME_UNKNOWN, "no evidence", "recovery-run-1")
        return job_id, attempt
    return job_id, await drive(store, job_id, Status(state))


async def stop_request(store: JobStore, tenant_id: uuid.UUID, job_id: uuid.UUID) -> None:
    result = await store.request_cancellation(tenant_id=tenant_id, job_id=job_id, request_id=uuid.uuid4(),
                                              requested_by="operator@example", reason=None)
    assert result.outcome is CancellationOutcome.STOP_REQUESTED


async def snapshot(db, job_id: uuid.UUID) -> tuple[str, list[str]]:
    """The whole row and the kinds of its history, as the owner sees them."""
    row = await db.admin.fetchval("SELECT to_jsonb(j)::text FROM export_jobs j WHERE id = $1", job_id)
    return row, kinds(await events(db, job_id))


async def refused(conn: asyncpg.Connection, *steps: tuple) -> asyncpg.PostgresError:
    """Run the steps in one transaction and expect the database to refuse them with insufficient_privilege,
    whether at the statement (privileges, row-level security) or at commit (the deferred checks)."""
    with pytest.raises(asyncpg.InsufficientPrivilegeError) as refusal:
        async with conn.transaction():
            for sql, *args in steps:
                await conn.execute(sql, *args)
    assert "\n" not in str(refusal.value)
    return refusal.value


# --- GR1: no change of a job's state without its event -----------------------------------------------------------


@pytest.mark.spec("GR1")
async def test_app_role_cannot_complete_a_stopped_export(db, store, tenant, app):
    job_id, attempt = await arrange(db, store, tenant, "Stopped")
    before = await snapshot(db, job_id)
    await refused(app, ("UPDATE export_jobs SET status = 'Completed', confirmed_by = 'size' WHERE id = $1", job_id))
    # Not with an event either: no event makes Stopped -> Completed a transition.
    await refused(app, ("UPDATE export_jobs SET status = 'Completed', confirmed_by = 'size' WHERE id = $1", job_id),
                  (INSERT_EVENT, job_id, attempt, "Finished", None))
    assert await snapshot(db, job_id) == before


# Each case: the state arranged, then an UPDATE (of the row $1) that changes a guarded column with no event.
WITHOUT_EVENT = {
    "running, completed": ("Running", "SET status = 'Completed', lease_expires_at = NULL, confirmed_by = 'size'"),
    "running, failed": ("Running", "SET status = 'Failed', failure_reason = 'BuildFailed', lease_expires_at = NULL"),
    "running, stopped": ("Running", "SET status = 'Stopped', lease_expires_at = NULL"),
    "running, delivering": ("Running", "SET status = 'Delivering', delivery_authorized_at = clock_timestamp()"),
    "running, requeued": ("Running", "SET status = 'Queued', attempt_id = NULL, claimed_by = NULL, "
                                     "lease_expires_at = NULL"),
    "running, another attempt": ("Running", "SET attempt_id = gen_random_uuid()"),
    "running, another holder": ("Running", "SET claimed_by = 'intruder'"),
    "running, another holder with a lease": (
        "Running", "SET claimed_by = 'intruder', lease_expires_at = clock_timestamp() + interval '1 hour'"),
    "running, lease cleared": ("Running", "SET lease_expires_at = NULL"),
    "running, lease with another change": (
        "Running", "SET lease_expires_at = clock_timestamp() + interval '1 hour', attempt_count = 0"),
    "running, stop request unrecorded": ("Running", "SET stop_request_id = gen_random_uuid()"),
    "running, attempt count": ("Running", "SET attempt_count = 0"),
    "queued, claimed": ("Queued", "SET status = 'Running', attempt_id = gen_random_uuid(), claimed_by = 'w', "
                                  "attempt_count = 1, lease_expires_at = clock_timestamp() + interval '1 hour'"),
    "queued, canceled unrecorded": ("Queued", "SET status = 'Canceled', cancellation_request_id = gen_random_uuid()"),
    "queued, leased": ("Queued", "SET lease_expires_at = clock_timestamp() + interval '1 hour'"),
    "queued, failure code": ("Queued", "SET status = 'Failed', failure_reason = 'BuildFailed'"),
    "delivering, completed": ("Delivering",
                              "SET status = 'Completed', lease_expires_at = NULL, confirmed_by = 'size'"),
    "delivering, outcome unknown": ("Delivering", "SET status = 'OutcomeUnknown', lease_expires_at = NULL"),
    "delivering, expected file": ("Delivering", "SET expected_file_name = 'other.csv'"),
    "delivering, holder": ("Delivering", "SET claimed_by = 'intruder'"),
    "failed, another code": ("Failed", "SET failure_reason = 'NotDelivered'"),
    "failed, completed": ("Failed", "SET status = 'Completed', failure_reason = NULL, confirmed_by = 'size'"),
    "completed, failed": ("Completed",
                          "SET status = 'Failed', failure_reason = 'NotDelivered', confirmed_by = NULL"),
    "completed, lease": ("Completed", "SET lease_expires_at = clock_timestamp() + interval '1 hour'"),
    "outcome unknown, completed": ("OutcomeUnknown", "SET status = 'Completed', confirmed_by = 'size'"),
}


@pytest.mark.spec("GR1")
@pytest.mark.parametrize("case", WITHOUT_EVENT)
async def test_app_role_cannot_change_a_guarded_column_without_its_event(db, store, tenant, app, case):
    state, assignment = WITHOUT_EVENT[case]
    job_id, _ = await arrange(db, store, tenant, state)
    before = await snapshot(db, job_id)
    refusal = await refused(app, (f"UPDATE export_jobs {assignment} WHERE id = $1", job_id))
    assert str(refusal).startswith("GR1: ")
    assert await snapshot(db, job_id) == before


@pytest.mark.spec("GR1")
async def test_a_transition_needs_its_own_kind_for_its_attempt_from_this_transaction(db, store, tenant, app):
    job_id, attempt = await arrange(db, store, tenant, "Running")
    before = await snapshot(db, job_id)
    fail = ("UPDATE export_jobs SET status = 'Failed', failure_reason = 'BuildFailed', lease_expires_at = NULL "
            "WHERE id = $1", job_id)
    # Another transition's kind, or the right kind for another attempt.
    await refused(app, fail, (INSERT_EVENT, job_id, attempt, "Stopped", None))
    await refused(app, fail, (INSERT_EVENT, job_id, uuid.uuid4(), "Failed", None))
    # The right event, but the change writes more than the transition's own columns.
    await refused(app, (fail[0].replace("lease_expires_at = NULL", "lease_expires_at = NULL, attempt_count = 0"),
                        job_id),
                  (INSERT_EVENT, job_id, attempt, "Failed", None))
    # A stop with its event, but no stop request recorded: a takeover or a shutdown is never a stop.
    await refused(app, ("UPDATE export_jobs SET status = 'Stopped', lease_expires_at = NULL WHERE id = $1", job_id),
                  (INSERT_EVENT, job_id, attempt, "Stopped", None))
    # The right event, recorded earlier by another transaction (the owner's), does not prove this one.
    await db.admin.execute(INSERT_EVENT, job_id, attempt, "Failed", None)
    await refused(app, fail)
    await db.admin.execute("DELETE FROM export_attempt_events WHERE job_id = $1 AND kind = 'Failed'", job_id)
    assert await snapshot(db, job_id) == before
    # Control: the change with its event in one transaction commits.
    async with app.transaction():
        await app.execute(*fail)
        await app.execute(INSERT_EVENT, job_id, attempt, "Failed", None)
    assert (await store.read_job(job_id)).status is Status.FAILED


@pytest.mark.spec("GR1")
async def test_a_statement_inside_a_savepoint_still_proves_its_change(db, store, tenant):
    # The proof is "written with the row's current version", not "by the top-level transaction ID".
    job_id, _ = await arrange(db, store, tenant, "Queued")
    attempt = uuid.uuid4()
    async with store.engine.begin() as conn:
        async with conn.begin_nested():
            assert (await conn.execute(statement("claim"), {
                "job_id": job_id, "checked_version": 1, "attempt_id": attempt, "worker_id": "worker-a",
                "lease_seconds": 5.0})).rowcount == 1
    row = await store.read_job(job_id)
    assert (row.status, row.attempt_id) == (Status.RUNNING, attempt)


@pytest.mark.spec("GR1")
@pytest.mark.parametrize("column", ["id", "tenant_id", "delivery_key", "replaces_job_id", "created_by",
                                    "replacement_reason", "overwrite_agreement_ref"])
async def test_app_role_cannot_update_a_jobs_identity(db, store, tenant, app, column):
    job_id, _ = await arrange(db, store, tenant, "Queued")
    # Even to the same value: the column is not the application's to write.
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        await app.execute(f"UPDATE export_jobs SET {column} = {column} WHERE id = $1", job_id)


@pytest.mark.spec("GR1")
async def test_reconciler_cannot_rewrite_a_job_without_its_event_but_its_statements_work(
        db, store, tenant, reconciler, reconciler_conn):
    tenant_id, _ = tenant
    completed, completed_attempt = await arrange(db, store, tenant, "Completed")
    unknown, unknown_attempt = await arrange(db, store, tenant, "OutcomeUnknown")
    running, _ = await arrange(db, store, tenant, "Running")
    before = {job: await snapshot(db, job) for job in (completed, unknown, running)}
    for job_id, sql in (
        (completed, "UPDATE export_jobs SET status = 'Failed', failure_reason = 'NotDelivered', confirmed_by = NULL "
                    "WHERE id = $1"),
        (unknown, "UPDATE export_jobs SET status = 'Completed', confirmed_by = 'size' WHERE id = $1"),
        (running, "UPDATE export_jobs SET status = 'Failed', failure_reason = 'BuildFailed' WHERE id = $1"),
        # Columns outside status and failure_reason are not the reconciler's at all.
        (running, "UPDATE export_jobs SET claimed_by = 'intruder' WHERE id = $1"),
        (running, "UPDATE export_jobs SET lease_expires_at = NULL WHERE id = $1"),
        (unknown, "UPDATE export_jobs SET attempt_id = gen_random_uuid() WHERE id = $1"),
    ):
        await refused(reconciler_conn, (sql, job_id))
    assert {job: await snapshot(db, job) for job in before} == before

    assert await Reconciliation(reconciler).correct(
        tenant_id=tenant_id, job_id=completed, attempt_id=completed_attempt, recorded_status=Status.COMPLETED,
        corrected_status=Status.FAILED, failure_reason=FailureCode.NOT_DELIVERED, corrected_by="rec@example",
        evidence_ref="ticket 1", why="never processed")
    assert await Reconciliation(reconciler).reconcile(
        tenant_id=tenant_id, job_id=unknown, attempt_id=unknown_attempt, resolution=Status.COMPLETED,
        reconciled_by="rec@example", evidence_summary="listing")
    assert (await store.read_job(completed)).status is Status.FAILED
    assert (await store.read_job(unknown)).status is Status.COMPLETED
    assert (kinds(await events(db, completed)))[-1] == "Corrected"
    assert (kinds(await events(db, unknown)))[-1] == "Reconciled"


@pytest.mark.spec("GR1")
async def test_the_owner_is_exempt(db, store, tenant):
    job_id, _ = await arrange(db, store, tenant, "Stopped")
    assert await db.admin.execute("UPDATE export_jobs SET status = 'Completed', confirmed_by = 'size' WHERE id = $1",
                                  job_id) == "UPDATE 1"
    assert (await store.read_job(job_id)).status is Status.COMPLETED


# --- GR2: each role its own kinds, and no transition event without its change --------------------------------------


# Each case: the state arranged, and a transition event for the job's attempt (None: a new attempt ID) that fits
# no row change, inserted by the application role with no change at all.
ORPHANS = {
    "Finished": ("Delivering", "Finished"),
    "Reconciled": ("OutcomeUnknown", "Reconciled"),
    "Corrected": ("Completed", "Corrected"),
    "Claimed": ("Queued", "Claimed"),
    "BuildStarted": ("Running", "BuildStarted"),
    "DeliveryAuthorized": ("Running", "DeliveryAuthorized"),
    "Stopped": ("Running", "Stopped"),
    "Failed": ("Running", "Failed"),
    "AttemptsExhausted": ("Running", "AttemptsExhausted"),
    "StoppedByRecovery": ("Running", "StoppedByRecovery"),
    "ResolvedByRecovery": ("Delivering", "ResolvedByRecovery"),
    "RequeuedByRecovery": ("Queued", "RequeuedByRecovery"),
}


@pytest.mark.spec("GR2")
@pytest.mark.parametrize("case", ORPHANS)
async def test_app_role_cannot_insert_a_transition_event_on_its_own(db, store, tenant, app, case):
    state, kind = ORPHANS[case]
    job_id, attempt = await arrange(db, store, tenant, state)
    before = await snapshot(db, job_id)
    worker = (await store.read_job(job_id)).claimed_by
    refusal = await refused(app, (INSERT_EVENT, job_id, attempt or uuid.uuid4(), kind, worker))
    # Reconciled and Corrected are refused the application role before any check of their change.
    assert str(refusal).startswith("GR2: ") or "row-level security" in str(refusal)
    assert await snapshot(db, job_id) == before


@pytest.mark.spec("GR2")
async def test_a_change_without_a_transition_does_not_carry_a_transition_event(db, store, tenant, app):
    queued, _ = await arrange(db, store, tenant, "Queued")
    running, attempt = await arrange(db, store, tenant, "Running")
    before = {job: await snapshot(db, job) for job in (queued, running)}
    # A queued row's own edit (a sweep's) with a requeue event for an attempt that never was.
    await refused(app, ("UPDATE export_jobs SET woken_at = clock_timestamp() WHERE id = $1", queued),
                  (INSERT_EVENT, queued, uuid.uuid4(), "RequeuedByRecovery", None))
    # A renewal with a claim event for the current attempt (its claim is already recorded) or a delivery's.
    renew = ("UPDATE export_jobs SET lease_expires_at = clock_timestamp() + interval '5 seconds' WHERE id = $1",
             running)
    with pytest.raises(asyncpg.UniqueViolationError):
        async with app.transaction():
            await app.execute(*renew)
            await app.execute(INSERT_EVENT, running, attempt, "Claimed", "worker-test")
    await refused(app, renew, (INSERT_EVENT, running, attempt, "DeliveryAuthorized", None))
    await refused(app, renew, (INSERT_EVENT, running, attempt, "Finished", None))
    assert {job: await snapshot(db, job) for job in before} == before


@pytest.mark.spec("GR2")
async def test_each_role_inserts_only_its_own_kinds(db, store, tenant, reconciler_conn, dispatcher):
    tenant_id, _ = tenant
    unknown, unknown_attempt = await arrange(db, store, tenant, "OutcomeUnknown")
    completed, completed_attempt = await arrange(db, store, tenant, "Completed")
    before = {job: await snapshot(db, job) for job in (unknown, completed)}
    # The application role writes neither a reconciliation nor a correction, even through their statements.
    with pytest.raises(errors.NotPermitted):
        await Reconciliation(store.engine).reconcile(
            tenant_id=tenant_id, job_id=unknown, attempt_id=unknown_attempt, resolution=Status.COMPLETED,
            reconciled_by="app", evidence_summary="none")
    with pytest.raises(errors.NotPermitted):
        await Reconciliation(store.engine).correct(
            tenant_id=tenant_id, job_id=completed, attempt_id=completed_attempt, recorded_status=Status.COMPLETED,
            corrected_status=Status.FAILED, failure_reason=FailureCode.NOT_DELIVERED, corrected_by="app",
            evidence_ref="x", why="y")
    # The reconciler: only its own kinds, and a transition kind only with its change.
    for kind in ("Finished", "Claimed", "ResolvedByRecovery"):
        await refused(reconciler_conn, (INSERT_EVENT, unknown, unknown_attempt, kind, None))
    await refused(reconciler_conn, (INSERT_EVENT, unknown, unknown_attempt, "Reconciled", None))
    await refused(reconciler_conn, (INSERT_EVENT, completed, completed_attempt, "Corrected", None))
    # The dispatcher: none.
    for kind in ("DeliveryEvidence", "Finished"):
        await refused(dispatcher, (INSERT_EVENT, unknown, unknown_attempt, kind, None))
    assert {job: await snapshot(db, job) for job in before} == before
    # Evidence is not a transition: the reconciler and the application append it freely.
    await reconciler_conn.execute(INSERT_EVENT, unknown, unknown_attempt, "DeliveryEvidence", None)
    await store.append_evidence(unknown, unknown_attempt, "tests", {"listing": "none"})
    assert (kinds(await events(db, unknown)))[-2:] == ["DeliveryEvidence", "DeliveryEvidence"]


@pytest.mark.spec("GR2")
async def test_dispatcher_sets_published_at_once_from_null_to_the_database_clock(db, store, tenant, dispatcher):
    job_id, _ = await arrange(db, store, tenant, "Queued")
    message_id = await db.admin.fetchval("SELECT message_id FROM outbox WHERE job_id = $1", job_id)
    assert await dispatcher.execute(MARK, message_id) == "UPDATE 1"
    published = await db.admin.fetchval("SELECT published_at FROM outbox WHERE message_id = $1", message_id)
    assert published is not None
    for sql in ("UPDATE outbox SET published_at = NULL WHERE message_id = $1", MARK,
                "UPDATE outbox SET published_at = published_at WHERE message_id = $1"):
        await refused(dispatcher, (sql, message_id))
    assert await db.admin.fetchval("SELECT published_at FROM outbox WHERE message_id = $1", message_id) == published
    # Another message: not NULL, and not a time of the dispatcher's choosing.
    other, _ = await arrange(db, store, tenant, "Queued")
    other_message = await db.admin.fetchval("SELECT message_id FROM outbox WHERE job_id = $1", other)
    await refused(dispatcher, ("UPDATE outbox SET published_at = NULL WHERE message_id = $1", other_message))
    await dispatcher.execute("UPDATE outbox SET published_at = '2000-01-01' WHERE message_id = $1", other_message)
    assert await db.admin.fetchval(
        "SELECT published_at > clock_timestamp() - interval '1 minute' FROM outbox WHERE message_id = $1",
        other_message)


# --- the documented statements still work, under the application and reconciliation roles ------------------------


@pytest.mark.spec("GR1", "GR2")
async def test_every_documented_transition_still_commits(db, store, tenant, reconciler):
    tenant_id, destination_id = tenant
    # One worker ID claims every attempt here, so that no loss counts as lost with its worker (a live worker's other
    # attempts keep 5 s of lease, over `renew_seconds`; its earlier losses are past `together_seconds`): the
    # attempt cap applies.
    recovery = Recovery(store.engine, max_attempts=2, renew_seconds=1.0, together_seconds=0.001)

    # Claim, two builds (a resumption takes the slot from the first holder), renewal, cutoff 2, finish, correct.
    job = await create_job(store, tenant_id, destination_id)
    attempt = uuid.uuid4()
    assert await store.claim(job, 1, attempt, "worker-a") is ClaimResult.CLAIMED
    for holder in ("build-1", "build-2"):
        assert await store.start_build(job, attempt, holder, f"{holder} starts")
    assert (await store.read_job(job)).claimed_by == "build-2"
    assert await store.renew_lease(job, attempt)
    row = await store.read_job(job)
    assert await drive_authorize(store, row, attempt)
    assert await store.renew_lease(job, attempt)
    assert await store.finish_delivery(job, attempt, Status.COMPLETED, None, "delivered", confirmed_by="sha256")
    assert await Reconciliation(reconciler).correct(
        tenant_id=tenant_id, job_id=job, attempt_id=attempt, recorded_status=Status.COMPLETED,
        corrected_status=Status.FAILED, failure_reason=FailureCode.NOT_DELIVERED, corrected_by="rec@example",
        evidence_ref="ticket", why="partner lost it")
    assert kinds(await events(db, job)) == ["Claimed", "BuildStarted", "BuildStarted", "DeliveryAuthorized",
                                            "Finished", "Corrected"]

    # Recovery requeues an expired attempt; the next attempt is stopped on request; recovery stops another.
    job = await create_job(store, tenant_id, destination_id)
    first = await drive(store, job, Status.RUNNING)
    await expire(db, job)
    assert await recovery.take_back(job, first, "run-1") == "RequeuedByRecovery"
    second = await drive(store, job, Status.RUNNING)
    await stop_request(store, tenant_id, job)
    assert await store.finish_stopped(job, second, "before upload")
    assert kinds(await events(db, job)) == ["Claimed", "RequeuedByRecovery", "Claimed", "Stopped"]

    job = await create_job(store, tenant_id, destination_id)
    attempt = await drive(store, job, Status.RUNNING)
    await stop_request(store, tenant_id, job)
    await expire(db, job)
    assert await recovery.stop(job, attempt, "run-1")

    # Exhausted after the attempt cap.
    job = await create_job(store, tenant_id, destination_id)
    first = await drive(store, job, Status.RUNNING)
    await expire(db, job)
    assert await recovery.take_back(job, first, "run-1") == "RequeuedByRecovery"
    second = await drive(store, job, Status.RUNNING)
    await expire(db, job)
    assert await recovery.take_back(job, second, "run-1") == "AttemptsExhausted"
    assert (await store.read_job(job)).failure_reason is FailureCode.ATTEMPTS_EXHAUSTED

    # Recovery resolves an expired delivery to OutcomeUnknown, and reconciliation settles it.
    job = await create_job(store, tenant_id, destination_id)
    attempt = await drive(store, job, Status.DELIVERING)
    await store.append_evidence(job, attempt, "tests", {"listing": "nothing"})
    await expire(db, job)
    assert await recovery.resolve(job, attempt, Status.OUTCOME_UNKNOWN, "no evidence", "run-1")
    assert await Reconciliation(reconciler).reconcile(
        tenant_id=tenant_id, job_id=job, attempt_id=attempt, resolution=Status.FAILED,
        reconciled_by="rec@example", evidence_summary="not there")
    assert (await store.read_job(job)).failure_reason is FailureCode.NOT_DELIVERED

    # Recovery resolves another to Completed; a delivery finishes OutcomeUnknown; a build fails.
    job = await create_job(store, tenant_id, destination_id)
    attempt = await drive(store, job, Status.DELIVERING)
    await expire(db, job)
    assert await recovery.resolve(job, attempt, Status.COMPLETED, "file matches", "run-1", confirmed_by="sha256")
    job = await create_job(store, tenant_id, destination_id)
    await drive(store, job, Status.OUTCOME_UNKNOWN)
    job = await create_job(store, tenant_id, destination_id)
    await drive(store, job, Status.FAILED, FailureCode.BUILD_FAILED)

    # Queued: cancel, sweep, edit terms, reject.
    job = await create_job(store, tenant_id, destination_id)
    result = await store.request_cancellation(tenant_id=tenant_id, job_id=job, request_id=uuid.uuid4(),
                                              requested_by="operator@example", reason="no longer needed")
    assert result.outcome is CancellationOutcome.CANCELED_WHILE_QUEUED
    assert (await store.read_job(job)).status is Status.CANCELED
    job = await create_job(store, tenant_id, destination_id)
    await db.admin.execute("UPDATE export_jobs SET woken_at = clock_timestamp() - interval '2 hours' "
                           "WHERE status = 'Queued'")
    # Its creation's wake-up went out (and was lost): the sweep adds none beside one still unpublished.
    await db.admin.execute("UPDATE outbox SET published_at = clock_timestamp() WHERE job_id = $1", job)
    assert await recovery.sweep(threshold_seconds=1800, batch=500) == 1
    assert await store.edit_terms(tenant_id=tenant_id, job_id=job, expected_version=1,
                                  destination_id=destination_id)
    assert await store.reject(job, 2, "destination disabled")
    assert (await store.read_job(job)).status is Status.REJECTED

    # Nothing above left a job in a state the rules would refuse, and every change has its event.
    statuses = await db.admin.fetch("SELECT status, count(*) AS n FROM export_jobs GROUP BY status")
    assert {r["status"]: r["n"] for r in statuses} == {
        "Failed": 4, "Stopped": 2, "Completed": 1, "OutcomeUnknown": 1, "Canceled": 1, "Rejected": 1}


async def drive_authorize(store: JobStore, row: JobRow, attempt: uuid.UUID) -> bool:
    return await store.authorize_delivery(row, attempt, built_file(row.final_name)) is AuthorizationResult.AUTHORIZED


# --- a job is born Queued, with its wake-up ----------------------------------------------------------------------


@pytest.mark.spec("GR1")
@pytest.mark.parametrize("status,confirmed_by,with_wakeup", [("Completed", "sha256", True),
                                                             ("Queued", None, False)])
async def test_app_role_cannot_insert_a_settled_job_or_one_without_its_wakeup(db, tenant, app, status,
                                                                             confirmed_by, with_wakeup):
    tenant_id, destination_id = tenant
    job_id, key = uuid.uuid4(), f"k{uuid.uuid4().hex[:12]}"
    steps = [
        ("INSERT INTO deliveries (tenant_id, delivery_key, original_job_id) VALUES ($1, $2, $3)",
         tenant_id, key, job_id),
        ("INSERT INTO export_jobs (id, tenant_id, status, version, destination_id, delivery_key, final_name, "
         "created_by, woken_at, confirmed_by) VALUES ($1, $2, $3, 1, $4, $5, $7, "
         "'intruder', clock_timestamp(), $6)",
         job_id, tenant_id, status, destination_id, key, confirmed_by, f"contacts-{tenant_id}-{key}.csv"),
    ]
    if with_wakeup:
        steps.append(("INSERT INTO outbox (message_id, kind, job_id, created_at) "
                      "VALUES (gen_random_uuid(), 'ExportReady', $1, clock_timestamp())", job_id))
    refusal = await refused(app, *steps)
    assert "GR1" in str(refusal) and "born" not in str(refusal)
    assert await db.admin.fetchval("SELECT count(*) FROM export_jobs WHERE id = $1", job_id) == 0


async def _committed_or_refused(conn: asyncpg.Connection, *steps: tuple) -> asyncpg.PostgresError | None:
    """The steps in one transaction: the database's refusal, or None when it committed them."""
    try:
        async with conn.transaction():
            for sql, *args in steps:
                await conn.execute(sql, *args)
    except asyncpg.PostgresError as exc:
        return exc
    return None


_BORN_WITH = {
    "rename fence passed": ("rename_fence", "passed"),
    "hand-backs at the cap": ("handed_back_count", 3),
    "a counted hand-back": ("handed_back_attempt", uuid.UUID(int=1)),
    "a run waiting on an attempt": ("run_waits_for", uuid.UUID(int=2)),
    "a cutoff 2 given up": ("cutoff_2_given_up", uuid.UUID(int=3)),
}


@pytest.mark.spec("GR1")
@pytest.mark.parametrize("case", list(_BORN_WITH))
async def test_a_new_export_is_born_with_nothing_of_an_attempt_including_the_columns_of_0010_to_0018(
        db, tenant, app, case):
    """The creation rule listed 0001's columns only: the application could create an export whose hand-back count
    already stood at the cap, which recovery would end AttemptsExhausted at its first hand-back (found by review;
    migration 0021)."""
    column, value = _BORN_WITH[case]
    tenant_id, destination_id = tenant
    job_id, key = uuid.uuid4(), f"k{uuid.uuid4().hex[:12]}"
    refusal = await _committed_or_refused(
        app,
        ("INSERT INTO deliveries (tenant_id, delivery_key, original_job_id) VALUES ($1, $2, $3)",
         tenant_id, key, job_id),
        (f"INSERT INTO export_jobs (id, tenant_id, status, version, destination_id, delivery_key, final_name, "
         f"created_by, woken_at, {column}) VALUES ($1, $2, 'Queued', 1, $3, $4, $5, 'intruder', clock_timestamp(), "
         f"$6)", job_id, tenant_id, destination_id, key, f"contacts-{tenant_id}-{key}.csv", value),
        ("INSERT INTO outbox (message_id, kind, job_id, created_at) "
         "VALUES (gen_random_uuid(), 'ExportReady', $1, clock_timestamp())", job_id))
    assert await db.admin.fetchval("SELECT count(*) FROM export_jobs WHERE id = $1", job_id) == 0
    assert isinstance(refusal, asyncpg.InsufficientPrivilegeError) and str(refusal).startswith("GR1"), refusal


_QUEUED_EDITS = {
    "hand-back count put back to 0": "SET handed_back_count = 0",
    "counted hand-back forgotten": "SET handed_back_attempt = NULL",
    "waiting mark forged": "SET run_waits_for = gen_random_uuid()",
    "given-up mark forged": "SET cutoff_2_given_up = gen_random_uuid()",
}


@pytest.mark.spec("GR1")
@pytest.mark.parametrize("case", list(_QUEUED_EDITS))
async def test_a_queued_rows_own_edits_leave_its_hand_backs_and_waiting_mark_alone(db, store, tenant, app, case):
    """A queued row's unchecked edits change only destination_id, version, woken_at and sweep_count: the check
    knew 0010's fence but not 0013's count, 0017's mark or 0018's hand-back, so the application could put the
    hand-back count back to 0, undoing its cap, with no event (found by review; migration 0021)."""
    tenant_id, destination_id = tenant
    job_id = await create_job(store, tenant_id, destination_id)
    # As the owner: the export's attempts were handed back twice, then taken back, so it is Queued with its count.
    await db.admin.execute("UPDATE export_jobs SET handed_back_count = 2, handed_back_attempt = $2 WHERE id = $1",
                           job_id, uuid.uuid4())
    columns = "status, handed_back_count, handed_back_attempt, run_waits_for, cutoff_2_given_up"
    before = await db.admin.fetchrow(f"SELECT {columns} FROM export_jobs WHERE id = $1", job_id)
    refusal = await _committed_or_refused(app, (f"UPDATE export_jobs {_QUEUED_EDITS[case]} WHERE id = $1", job_id))
    assert await db.admin.fetchrow(f"SELECT {columns} FROM export_jobs WHERE id = $1", job_id) == before
    assert isinstance(refusal, asyncpg.InsufficientPrivilegeError), refusal


_FENCE_PASSES = {
    "a bare update": (),
    "evidence naming no holder": (None,),
    "evidence naming another build": ("worker-other",),
}


@pytest.mark.spec("GR1")
@pytest.mark.parametrize("case", list(_FENCE_PASSES))
async def test_the_rename_fence_passes_only_with_its_holders_evidence_in_the_same_transaction(
        db, store, tenant, app, case):
    """The rule asked only that the fence move to `passed`: a bare UPDATE by the application, naming neither the
    attempt nor its holder and writing no evidence, passed it, and recovery then resolved the attempt from evidence
    instead of taking it back (found by review; migration 0023). Evidence the stamp (0008) leaves without the row's
    holder proves nothing either."""
    tenant_id, destination_id = tenant
    job_id = await create_job(store, tenant_id, destination_id)
    attempt_id = await drive(store, job_id, Status.DELIVERING)
    steps: list[tuple] = [("UPDATE export_jobs SET rename_fence = 'passed' WHERE id = $1", job_id)]
    for holder in _FENCE_PASSES[case]:
        steps.append(("INSERT INTO export_attempt_events (job_id, attempt_id, kind, worker_id, observed_by, detail, "
                      "recorded_at) VALUES ($1, $2, 'DeliveryEvidence', $3, 'intruder', '{\"step\": \"rename\"}', "
                      "clock_timestamp())", job_id, attempt_id, holder))
    refusal = await _committed_or_refused(app, *steps)
    assert await db.admin.fetchval("SELECT rename_fence FROM export_jobs WHERE id = $1", job_id) == "open"
    assert isinstance(refusal, asyncpg.InsufficientPrivilegeError) and str(refusal).startswith("GR1"), refusal
    # The statement itself, naming the attempt and its holder, passes it.
    assert await store.pass_rename_fence(job_id, attempt_id, "worker-test", "worker-test/t", {"step": "rename"})
    assert await db.admin.fetchval("SELECT rename_fence FROM export_jobs WHERE id = $1", job_id) == "passed"


@pytest.mark.spec("GR1")
@pytest.mark.parametrize("edit", ["SET cutoff_2_given_up = NULL", "SET cutoff_2_given_up = gen_random_uuid()"])
async def test_a_runs_given_up_mark_is_never_cleared_or_moved(db, store, tenant, app, edit):
    """A renewal-shaped write may mark the row's own attempt as given up (run_waits_on_attempt.sql), nothing else:
    cleared, the mark let the given-up step's cutoff 2 authorize again (found by review; migration 0022)."""
    tenant_id, destination_id = tenant
    job_id = await create_job(store, tenant_id, destination_id)
    attempt_id = await drive(store, job_id, Status.RUNNING)
    assert await store.run_waits_on_attempt(job_id, attempt_id, attempt_id)  # the run gave this cutoff 2 up
    refusal = await _committed_or_refused(app, (f"UPDATE export_jobs {edit} WHERE id = $1", job_id))
    assert isinstance(refusal, asyncpg.InsufficientPrivilegeError) and str(refusal).startswith("GR1"), refusal
    assert await db.admin.fetchval("SELECT cutoff_2_given_up FROM export_jobs WHERE id = $1", job_id) == attempt_id
    row = await store.read_job(job_id)
    assert await store.authorize_delivery(row, attempt_id, built_file(row.final_name)) \
        is AuthorizationResult.NOT_OWNER
    assert "DeliveryAuthorized" not in kinds(await events(db, job_id))
