"""Recording a cancellation request (reference design, Recording Cancellation Requests).

One short transaction: lock this tenant's job row, look up the request ID, decide from the row as found, make at
most one conditional update, insert the request record. A lock timeout is Busy with nothing recorded; the client
retries with the same request ID and gets the outcome already recorded, if an earlier submission committed.
"""

from __future__ import annotations

import logging
from typing import TypedDict
from uuid import UUID

from sqlalchemy.ext.asyncio import AsyncConnection

from store import errors
from store.models import CancellationOutcome, CancellationResult, JobRow, Status
from store.statements import Database, fetch_one, statement

log = logging.getLogger(__name__)

_OUTCOME_BY_STATUS = {
    Status.QUEUED: CancellationOutcome.CANCELED_WHILE_QUEUED,
    Status.CANCELED: CancellationOutcome.ALREADY_CANCELED,
    Status.REJECTED: CancellationOutcome.ALREADY_ENDED,
    Status.STOPPED: CancellationOutcome.ALREADY_ENDED,
    Status.FAILED: CancellationOutcome.ALREADY_ENDED,
    # Delivering, Completed, OutcomeUnknown: delivery was authorized.
    Status.DELIVERING: CancellationOutcome.TOO_LATE,
    Status.COMPLETED: CancellationOutcome.TOO_LATE,
    Status.OUTCOME_UNKNOWN: CancellationOutcome.TOO_LATE,
}


def decide_cancellation(row: JobRow) -> CancellationOutcome:
    """What a cancellation request means for a row as found under its lock."""
    if row.status is Status.RUNNING:
        if row.stop_request_id is None:
            return CancellationOutcome.STOP_REQUESTED
        return CancellationOutcome.STOP_ALREADY_REQUESTED
    return _OUTCOME_BY_STATUS[row.status]



class _Keys(TypedDict):
    """What names the request in each statement of a cancellation."""

    job_id: UUID
    tenant_id: UUID
    request_id: UUID

async def record(
    db: Database,
    lock_timeout_ms: int,
    *,
    tenant_id: UUID,
    job_id: UUID,
    request_id: UUID,
    requested_by: str,
    reason: str | None,
) -> CancellationResult:
    """JobStore.request_cancellation: the transaction this module describes, on the application role's Database."""
    try:
        async with db.transaction() as conn:
            return await _decide_and_record(db, conn, lock_timeout_ms, tenant_id, job_id, request_id,
                                            requested_by, reason)
    except errors.CancellationRequestExists:
        # The same (tenant, request ID) committed first under another job's lock; this transaction has rolled
        # back. Answer from that record, with the same job and operator check.
        async with db.connection() as conn:
            recorded = await _recorded(conn, tenant_id, job_id, request_id, requested_by)
        if recorded is not None:
            return recorded
        raise
    except Exception as exc:
        if errors.is_lock_timeout(exc):
            return CancellationResult(request_id=request_id, outcome=CancellationOutcome.BUSY, job_id=job_id)
        raise


async def _recorded(
    conn: AsyncConnection, tenant_id: UUID, job_id: UUID, request_id: UUID, requested_by: str
) -> CancellationResult | None:
    earlier = await fetch_one(conn, "cancel_find_request", tenant_id=tenant_id, request_id=request_id)
    if earlier is None:
        return None
    if earlier["job_id"] != job_id or earlier["requested_by"] != requested_by:
        # A client error; it says nothing about the other request.
        return CancellationResult(request_id=request_id, outcome=CancellationOutcome.REQUEST_ID_REUSED)
    return CancellationResult(
        request_id=request_id,
        outcome=CancellationOutcome(earlier["outcome"]),
        job_id=job_id,
        found_status=Status(earlier["found_status"]),
        found_attempt_id=earlier["found_attempt_id"],
        found_attempt_count=earlier["found_attempt_count"],
    )


async def _decide_and_record(
    db: Database,
    conn: AsyncConnection,
    lock_timeout_ms: int,
    tenant_id: UUID,
    job_id: UUID,
    request_id: UUID,
    requested_by: str,
    reason: str | None,
) -> CancellationResult:
    # Bounds each lock wait of this transaction only; it never releases a lock someone else holds.
    await conn.exec_driver_sql(f"SET LOCAL lock_timeout = {int(lock_timeout_ms)}")
    locked = await fetch_one(conn, "cancel_lock_job", job_id=job_id, tenant_id=tenant_id)
    if locked is None:
        # Another tenant's job looks exactly like a missing one, and nothing is recorded against any job.
        return CancellationResult(request_id=request_id, outcome=CancellationOutcome.NOT_FOUND)
    found = JobRow.model_validate(locked)

    # Checked under the lock, so two submissions of one click are serialized here. A retry with another reason
    # is still the same request; the first reason stands.
    earlier = await _recorded(conn, tenant_id, job_id, request_id, requested_by)
    if earlier is not None:
        return earlier

    outcome = decide_cancellation(found)
    keys = _Keys(job_id=job_id, tenant_id=tenant_id, request_id=request_id)
    if outcome is CancellationOutcome.CANCELED_WHILE_QUEUED:
        changed = (await db.write("cancel_queued", conn=conn, **keys)).count
    elif outcome is CancellationOutcome.STOP_REQUESTED:
        changed = (await db.write("request_stop", conn=conn, **keys)).count
    else:
        changed = 1  # these outcomes change nothing on the job
    if changed != 1:
        # Impossible while the row is locked; if it happens, the outcome is not true, so record nothing.
        log.critical("export %s changed under its row lock; outcome %s not recorded", job_id, outcome)
        raise errors.StoreError(f"export {job_id} changed under its row lock")

    recorded = (
        await db.write(
            "cancel_record_request",
            conn=conn,
            **keys,
            requested_by=requested_by,
            reason=reason,
            outcome=outcome.value,
            found_status=found.status.value,
            found_attempt_id=found.attempt_id,
            found_attempt_count=found.attempt_count,
            found_delivery_authorized_at=found.delivery_authorized_at,
        )
    ).count
    if recorded != 1:
        raise errors.StoreError(f"cancellation request {request_id} was not recorded")
    if outcome is CancellationOutcome.STOP_REQUESTED:
        # Delivered at commit, to a building attempt that listens (the watcher is for speed; cutoff 2 decides).
        await conn.execute(statement("notify_stop"), {"job_id": str(job_id)})
    return CancellationResult(
        request_id=request_id,
        outcome=outcome,
        job_id=job_id,
        found_status=found.status,
        found_attempt_id=found.attempt_id,
        found_attempt_count=found.attempt_count,
    )
