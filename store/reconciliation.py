"""Reconciliation and correction of recorded outcomes (reference design, Recovery: Reconciliation).

Reconciliation settles an OutcomeUnknown attempt once; a correction changes a recorded Completed or Failed once,
by a named reconciliation operator, and only under the reconciliation role.
"""

from __future__ import annotations

from uuid import UUID

from sqlalchemy import bindparam, select

from store.models import FailureCode, Status
from store.schema import export_jobs
from store.statements import RoleStore

_TENANTS_JOB = select(export_jobs.c.id).where(export_jobs.c.id == bindparam("job_id"),
                                              export_jobs.c.tenant_id == bindparam("tenant_id"))


class Reconciliation(RoleStore):
    """The reconciliation role (EXPORTS_RECONCILIATION_DATABASE_URL): operators' reconciliations and corrections.
    Any other role's engine is refused by the database (NotPermitted)."""

    async def reconcile(
        self,
        *,
        tenant_id: UUID,
        job_id: UUID,
        attempt_id: UUID,
        resolution: Status,
        reconciled_by: str,
        evidence_summary: str,
    ) -> bool:
        """OutcomeUnknown -> Completed, or Failed/NotDelivered. False when the row is not that attempt's
        OutcomeUnknown (already reconciled, or never unknown)."""
        written = await self.db.write(
            "reconcile",
            tenant_id=tenant_id,
            job_id=job_id,
            attempt_id=attempt_id,
            resolution=resolution.value,
            reconciled_by=reconciled_by,
            evidence_summary=evidence_summary,
        )
        return written.changed

    async def correct(
        self,
        *,
        tenant_id: UUID,
        job_id: UUID,
        attempt_id: UUID,
        recorded_status: Status,
        corrected_status: Status,
        failure_reason: FailureCode | None,
        corrected_by: str,
        evidence_ref: str,
        why: str,
    ) -> bool:
        """Completed <-> Failed for this attempt, from the status the operator saw. False when the row no longer
        holds it; TransitionAlreadyRecorded for a second correction; NotPermitted for any role but reconciliation."""
        written = await self.db.write(
            "correct",
            tenant_id=tenant_id,
            job_id=job_id,
            attempt_id=attempt_id,
            recorded_status=recorded_status.value,
            corrected_status=corrected_status.value,
            failure_reason=failure_reason.value if failure_reason else None,
            corrected_by=corrected_by,
            evidence_ref=evidence_ref,
            why=why,
        )
        return written.changed

    async def is_tenants(self, tenant_id: UUID, job_id: UUID) -> bool:
        """Whether the export exists for this tenant: a write that matched nothing says which it was, not found or
        not in the state named."""
        return await self.db.row(_TENANTS_JOB, job_id=job_id, tenant_id=tenant_id) is not None
