"""Driving a job to a state through the real statements, so that arranging a test exercises them too; and the
few arrangements and reads that no statement makes (an expired lease, the outbox)."""

from __future__ import annotations

import uuid

from store.jobs import JobStore
from store.models import AuthorizationResult, BuiltFile, ClaimResult, FailureCode, Status


def built_file(final_name: str, content: bytes = b"contacts") -> BuiltFile:
    import hashlib

    return BuiltFile(path="/nonexistent", final_name=final_name, size=len(content),
                     sha256_hex=hashlib.sha256(content).hexdigest())


async def drive(store: JobStore, job_id: uuid.UUID, target: Status,
                failure: FailureCode | None = None) -> uuid.UUID:
    """Claim, then as far as `target` (Running, Delivering, or a terminal state of the delivery)."""
    row = await store.read_job(job_id)
    attempt_id = uuid.uuid4()
    assert await store.claim(job_id, row.version, attempt_id, "worker-test") is ClaimResult.CLAIMED
    if target is Status.RUNNING:
        return attempt_id
    if target is Status.FAILED and failure is FailureCode.BUILD_FAILED:
        assert await store.finish_failed(job_id, attempt_id, failure, "arranged")
        return attempt_id
    authorized = await store.authorize_delivery(row, attempt_id, built_file(row.final_name))
    assert authorized is AuthorizationResult.AUTHORIZED, authorized
    if target is Status.DELIVERING:
        return attempt_id
    confirmed = "size" if target is Status.COMPLETED else None
    assert await store.finish_delivery(job_id, attempt_id, target, failure, "arranged", confirmed_by=confirmed)
    return attempt_id


async def cancel(store: JobStore, tenant_id: uuid.UUID, job_id: uuid.UUID,
                 request_id: uuid.UUID | None = None, requested_by: str = "operator@example"):
    return await store.request_cancellation(tenant_id=tenant_id, job_id=job_id,
                                            request_id=request_id or uuid.uuid4(),
                                            requested_by=requested_by, reason="test")


async def expire(db, job_id: uuid.UUID) -> None:
    """Arranging, as the owner: the lease ran out a second ago, as if the worker had paused."""
    await db.admin.execute(
        "UPDATE export_jobs SET lease_expires_at = clock_timestamp() - interval '1 second' WHERE id = $1", job_id)


async def outbox(db, job_id: uuid.UUID) -> list[uuid.UUID]:
    """The export's outbox message IDs, oldest first."""
    rows = await db.admin.fetch("SELECT message_id FROM outbox WHERE job_id = $1 ORDER BY created_at", job_id)
    return [r["message_id"] for r in rows]
