"""An export's attempt events as the owner reads them, and their kinds."""

from __future__ import annotations

import uuid
from typing import Any


async def events(db, job_id: uuid.UUID) -> list[dict[str, Any]]:
    """Every event of the export, oldest first, with the columns any test asserts on."""
    rows = await db.admin.fetch(
        "SELECT kind, attempt_id, worker_id, observed_by, detail, recorded_at FROM export_attempt_events "
        "WHERE job_id = $1 ORDER BY id", job_id)
    return [dict(r) for r in rows]


def kinds(found: list[dict[str, Any]], attempt_id: uuid.UUID | None = None, *,
          evidence_once: bool = False) -> list[str]:
    """The kinds of `found` in order, of one attempt's events when `attempt_id` is given. With `evidence_once`,
    consecutive DeliveryEvidence events (a receipt, then other evidence) count as one entry: how many a delivery
    appends depends on the partner, not on what the test proves."""
    out: list[str] = []
    for e in found:
        if attempt_id is not None and e["attempt_id"] != attempt_id:
            continue
        if evidence_once and e["kind"] == "DeliveryEvidence" and out[-1:] == ["DeliveryEvidence"]:
            continue
        out.append(e["kind"])
    return out


async def stop_latency(db, job_id: uuid.UUID, request_id: uuid.UUID) -> float:
    """Seconds from the committed stop request to the Stopped event, both on the database clock."""
    return await db.admin.fetchval(
        """SELECT EXTRACT(EPOCH FROM e.recorded_at - c.recorded_at)::float8
           FROM export_attempt_events e JOIN cancellation_requests c ON c.job_id = e.job_id
           WHERE e.job_id = $1 AND e.kind = 'Stopped' AND c.id = $2""", job_id, request_id)
