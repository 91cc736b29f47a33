"""Replacement creation and terms edits: the writers that create or re-open queued work, run by JobStore
(create_replacement, edit_terms) on the application role's Database."""

from __future__ import annotations

from uuid import UUID

from store import errors
from store.statements import Database, fetch_one


async def replace(
    db: Database,
    *,
    tenant_id: UUID,
    original_job_id: UUID,
    job_id: UUID,
    created_by: str,
    replacement_reason: str,
    overwrite_agreement_ref: str | None = None,
) -> UUID:
    """A new job carrying the original's delivery key; the original itself never runs again.

    A request naming a replacement resolves to the original it replaced. Raises NotReplaceable when the statement
    inserts nothing, and ReplacementSlotTaken when another replacement holds the original's slot. Returns the
    original's ID.
    """
    async with db.transaction() as conn:
        named = await fetch_one(conn, "resolve_original", tenant_id=tenant_id, job_id=original_job_id)
        if named is None:
            raise errors.NotReplaceable(f"export {original_job_id} not found for this tenant")
        original = named["original_job_id"]
        written = await db.write(
            "create_replacement",
            conn=conn,
            tenant_id=tenant_id,
            original_job_id=original,
            job_id=job_id,
            created_by=created_by,
            replacement_reason=replacement_reason,
            overwrite_agreement_ref=overwrite_agreement_ref,
        )
    if not written.changed:
        raise errors.NotReplaceable(
            f"export {original} may not be replaced: only an OutcomeUnknown original, or one that Failed with "
            "BuildFailed, AttemptsExhausted or NotDelivered, may be"
        )
    return original


async def edit(
    db: Database, *, tenant_id: UUID, job_id: UUID, expected_version: int, destination_id: UUID
) -> bool:
    """Change a queued export's destination. False when it started, ended, or was edited since it was read."""
    written = await db.write(
        "edit_terms",
        tenant_id=tenant_id,
        job_id=job_id,
        expected_version=expected_version,
        destination_id=destination_id,
    )
    return written.changed


# Kept for the callers that still pass an engine (tests outside the store's own); JobStore.create_replacement and
# JobStore.edit_terms are the way in.

