"""The evidence follow-up's reads and writes (LV2): OutcomeUnknown exports looked at again for a bounded time,
settled Completed only by proof of content (migration 0009). Runs as the application role, on the worker's engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal
from uuid import UUID

from store.statements import RoleStore, storable

Proof = Literal["sha256", "acknowledgment"]
OBSERVED_BY = "follow-up"  # the event's observer: who settled it, beside the run that did


@dataclass(frozen=True)
class Pending:
    """An export to look at again: a hint, since each look reads the row for itself."""

    job_id: UUID
    attempt_id: UUID
    looks: int


class FollowUp(RoleStore):
    async def pending(self, *, window_seconds: float, limit: int) -> list[Pending]:
        """OutcomeUnknown exports that became so within the window, the least recently looked at first."""
        rows = await self.db.rows("follow_up_pending", window_seconds=window_seconds, limit=limit)
        return [Pending(job_id=r["job_id"], attempt_id=r["attempt_id"], looks=r["looks"]) for r in rows]

    async def noted(self, job_id: UUID, attempt_id: UUID, finding: str) -> bool:
        """Counts one look and keeps its finding; False when the export is no longer that attempt's OutcomeUnknown."""
        return (await self.db.write("follow_up_noted", job_id=job_id, attempt_id=attempt_id,
                                    finding=storable(finding)[:1000])).changed

    async def confirm(self, job_id: UUID, attempt_id: UUID, *, final_name: str, observed_sha256: str,
                      proof: Proof, detail: str, run_id: str) -> bool:
        """OutcomeUnknown -> Completed with ConfirmedByFollowUp, only where `observed_sha256` is the expected
        file's (the statement checks it). False when the row does not match: moved on, or not that file."""
        return (await self.db.write(
            "follow_up_confirm", job_id=job_id, attempt_id=attempt_id, final_name=final_name,
            observed_sha256=observed_sha256, confirmed_by=proof, detail=storable(detail)[:1000],
            observed_by=f"{OBSERVED_BY}/{run_id}")).changed

    async def overview(self, *, window_seconds: float, tenant_id: UUID | None = None,
                       limit: int = 100) -> list[dict[str, Any]]:
        """For operators: pending, left for a person (past the window), and confirmed within the window."""
        return await self.db.rows("follow_up_overview", window_seconds=window_seconds,
                                  tenant_id=str(tenant_id) if tenant_id else None, limit=limit)
