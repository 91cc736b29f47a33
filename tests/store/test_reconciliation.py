"""Reconciliation and correction of recorded outcomes, against real PostgreSQL and its roles."""

from __future__ import annotations

import uuid

import asyncpg
import pytest

from store import errors
from store.db import make_engine
from store.models import FailureCode, Status
from store.reconciliation import Reconciliation
from tests.helpers.events import events, kinds
from tests.helpers.store_states import drive
from tests.helpers.support import create_job, seed_tenant


@pytest.fixture
async def reconciler(db):
    reconciliation = Reconciliation(make_engine(db.url("reconciler")))
    try:
        yield reconciliation
    finally:
        await reconciliation.aclose()


async def resolved_unknown(db, store) -> tuple[uuid.UUID, uuid.UUID, uuid.UUID]:
    """A Delivering attempt whose lease expired, resolved by recovery's statement to OutcomeUnknown."""
    tenant_id, destination_id = await seed_tenant(db.admin)
    job_id = await create_job(store, tenant_id, destination_id)
    attempt = await drive(store, job_id, Status.DELIVERING)
    await db.admin.execute("UPDATE export_jobs SET lease_expires_at = clock_timestamp() - interval '1 second' "
                           "WHERE id = $1", job_id)
    resolved = await db.admin.execute(
        """WITH resolved AS (UPDATE export_jobs SET status = 'OutcomeUnknown', lease_expires_at = NULL
               WHERE id = $1 AND status = 'Delivering' AND attempt_id = $2 AND lease_expires_at < clock_timestamp()
               RETURNING id, attempt_id, status)
           INSERT INTO export_attempt_events (job_id, attempt_id, kind, observed_by, detail, recorded_at)
           SELECT id, attempt_id, 'ResolvedByRecovery', 'recovery-run-1', status || ': no evidence', clock_timestamp()
           FROM resolved""", job_id, attempt)
    assert resolved == "INSERT 0 1"
    return tenant_id, job_id, attempt


@pytest.mark.spec("RC1")
@pytest.mark.parametrize("resolution", [Status.COMPLETED, Status.FAILED])
async def test_reconcile__outcome_unknown_settles_and_both_events_survive(db, store, reconciler, resolution):
    tenant_id, job_id, attempt = await resolved_unknown(db, store)
    assert await reconciler.reconcile(
        tenant_id=tenant_id, job_id=job_id, attempt_id=attempt, resolution=resolution,
        reconciled_by="ops@example", evidence_summary="partner listing")
    row = await store.read_job(job_id)
    expected_code = FailureCode.NOT_DELIVERED if resolution is Status.FAILED else None
    assert (row.status, row.failure_reason) == (resolution, expected_code)
    found = await events(db, job_id)
    assert kinds(found)[-2:] == ["ResolvedByRecovery", "Reconciled"]
    last = found[-1]
    assert (last["observed_by"], last["detail"]) == ("ops@example", f"{resolution.value}: partner listing")


@pytest.mark.spec("RC2")
async def test_reconcile__a_second_reconciled_event_is_refused(db, store, reconciler):
    tenant_id, job_id, attempt = await resolved_unknown(db, store)
    assert await reconciler.reconcile(
        tenant_id=tenant_id, job_id=job_id, attempt_id=attempt, resolution=Status.COMPLETED,
        reconciled_by="ops", evidence_summary="listing")
    # Through the statement: the row is no longer OutcomeUnknown, so nothing matches.
    assert not await reconciler.reconcile(
        tenant_id=tenant_id, job_id=job_id, attempt_id=attempt, resolution=Status.FAILED, reconciled_by="ops",
        evidence_summary="second look")
    # Directly: the unique index refuses a second Reconciled event for the attempt.
    with pytest.raises(asyncpg.UniqueViolationError) as refused:
        await db.admin.execute("INSERT INTO export_attempt_events (job_id, attempt_id, kind, recorded_at) "
                               "VALUES ($1, $2, 'Reconciled', clock_timestamp())", job_id, attempt)
    assert refused.value.constraint_name == "uq_attempt_transition"
    assert (await store.read_job(job_id)).status is Status.COMPLETED


@pytest.mark.spec("RC3")
async def test_failure_code__tied_to_failed_directly_and_through_the_correction(db, store, reconciler):
    tenant_id, destination_id = await seed_tenant(db.admin)
    job_id = await create_job(store, tenant_id, destination_id)
    attempt = await drive(store, job_id, Status.COMPLETED)
    for sql in ("UPDATE export_jobs SET status = 'Failed', confirmed_by = NULL WHERE id = $1",
                "UPDATE export_jobs SET failure_reason = 'NotDelivered' WHERE id = $1"):
        with pytest.raises(asyncpg.CheckViolationError) as refused:
            await db.admin.execute(sql, job_id)
        assert refused.value.constraint_name == "ck_export_jobs_failure"
    # Completed -> Failed without a code is refused through the correction too, and changes nothing.
    with pytest.raises(errors.FailureCodeMismatch):
        await reconciler.correct(
            tenant_id=tenant_id, job_id=job_id, attempt_id=attempt, recorded_status=Status.COMPLETED,
            corrected_status=Status.FAILED, failure_reason=None, corrected_by="rec@example",
            evidence_ref="ticket-1", why="no file")
    assert (await store.read_job(job_id)).status is Status.COMPLETED
    # Failed -> Completed clears the code in the same write, so no Completed row ever carries one.
    other = await create_job(store, tenant_id, destination_id)
    other_attempt = await drive(store, other, Status.FAILED, FailureCode.NOT_DELIVERED)
    assert await reconciler.correct(tenant_id=tenant_id, job_id=other, attempt_id=other_attempt,
                                    recorded_status=Status.FAILED, corrected_status=Status.COMPLETED,
                                    failure_reason=FailureCode.NOT_DELIVERED, corrected_by="rec@example",
                                    evidence_ref="ticket-2", why="partner confirmed")
    row = await store.read_job(other)
    assert (row.status, row.failure_reason, row.confirmed_by) == (Status.COMPLETED, None, "correction")


@pytest.mark.spec("RC4")
async def test_correction__once_with_who_and_why_second_refused(db, store, reconciler):
    tenant_id, destination_id = await seed_tenant(db.admin)
    job_id = await create_job(store, tenant_id, destination_id)
    attempt = await drive(store, job_id, Status.COMPLETED)
    assert await reconciler.correct(tenant_id=tenant_id, job_id=job_id, attempt_id=attempt,
                                    recorded_status=Status.COMPLETED, corrected_status=Status.FAILED,
                                    failure_reason=FailureCode.NOT_DELIVERED, corrected_by="rec@example",
                                    evidence_ref="partner ticket 7", why="partner never processed it")
    last = (await events(db, job_id))[-1]
    assert (last["kind"], last["observed_by"], last["detail"]) == (
        "Corrected", "rec@example", "Completed to Failed: partner ticket 7; partner never processed it")
    # A recorded status that no longer holds matches nothing; a second correction of the attempt is refused.
    assert not await reconciler.correct(
        tenant_id=tenant_id, job_id=job_id, attempt_id=attempt, recorded_status=Status.COMPLETED,
        corrected_status=Status.FAILED, failure_reason=FailureCode.NOT_DELIVERED, corrected_by="rec",
        evidence_ref="x", why="y")
    with pytest.raises(errors.TransitionAlreadyRecorded):
        await reconciler.correct(
            tenant_id=tenant_id, job_id=job_id, attempt_id=attempt, recorded_status=Status.FAILED,
            corrected_status=Status.COMPLETED, failure_reason=None, corrected_by="rec", evidence_ref="x",
            why="changed my mind")
    row = await store.read_job(job_id)
    assert (row.status, row.failure_reason) == (Status.FAILED, FailureCode.NOT_DELIVERED)


@pytest.mark.spec("RC5")
@pytest.mark.parametrize("role", ["app", "dispatcher"])
async def test_correction__refused_for_the_worker_and_api_roles(db, store, role):
    tenant_id, destination_id = await seed_tenant(db.admin)
    job_id = await create_job(store, tenant_id, destination_id)
    attempt = await drive(store, job_id, Status.COMPLETED)
    engine = make_engine(db.url(role))
    try:
        with pytest.raises(errors.NotPermitted):
            await Reconciliation(engine).correct(
                tenant_id=tenant_id, job_id=job_id, attempt_id=attempt, recorded_status=Status.COMPLETED,
                corrected_status=Status.FAILED, failure_reason=FailureCode.NOT_DELIVERED,
                corrected_by="intruder", evidence_ref="none", why="try")
    finally:
        await engine.dispose()
    assert (await store.read_job(job_id)).status is Status.COMPLETED
    assert "Corrected" not in kinds(await events(db, job_id))
