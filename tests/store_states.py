"""Driving a job to a state through the real statements, so that arranging a test exercises them too."""

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
