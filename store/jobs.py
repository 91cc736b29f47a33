"""One async method per domain operation on a job. Every write is the documented conditional statement."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any
from uuid import UUID

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from store import errors
from store.models import (
    AuthorizationResult,
    BuiltFile,
    CancellationOutcome,
    CancellationResult,
    ClaimResult,
    FailureCode,
    JobRow,
    Status,
)
from store.schema import cancellation_requests, destinations, export_attempt_events, export_jobs
from store.statements import statement

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


class JobStore:
    def __init__(
        self,
        engine: AsyncEngine,
        *,
        lease_seconds: float,
        lock_timeout_ms: int = 2000,
        reread_timeout_seconds: float = 5.0,
    ) -> None:
        self.engine = engine
        self.lease_seconds = lease_seconds
        self.lock_timeout_ms = lock_timeout_ms
        self.reread_timeout_seconds = reread_timeout_seconds

    async def _write(self, name: str, **params: Any) -> int:
        """Run one statement in its own transaction; the row count of its last (outer) command."""
        try:
            async with self.engine.begin() as conn:
                result = await conn.execute(statement(name), params)
                return result.rowcount
        except Exception as exc:
            translated = errors.translate(exc)
            if translated is exc:
                raise
            raise translated from exc

    # --- reads -------------------------------------------------------------------------------------------------

    async def read_job(self, job_id: UUID, *, tenant_id: UUID | None = None) -> JobRow | None:
        query = select(export_jobs).where(export_jobs.c.id == job_id)
        if tenant_id is not None:
            query = query.where(export_jobs.c.tenant_id == tenant_id)
        async with self.engine.connect() as conn:
            row = (await conn.execute(query)).mappings().first()
        return JobRow.model_validate(dict(row)) if row is not None else None

    async def read_destination(self, tenant_id: UUID, destination_id: UUID) -> dict[str, Any] | None:
        query = select(destinations).where(
            destinations.c.tenant_id == tenant_id, destinations.c.id == destination_id
        )
        async with self.engine.connect() as conn:
            row = (await conn.execute(query)).mappings().first()
        return dict(row) if row is not None else None

    async def history(self, job_id: UUID) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The job's attempt events and cancellation requests, oldest first."""
        async with self.engine.connect() as conn:
            events = (
                await conn.execute(
                    select(export_attempt_events)
                    .where(export_attempt_events.c.job_id == job_id)
                    .order_by(export_attempt_events.c.id)
                )
            ).mappings().all()
            requests = (
                await conn.execute(
                    select(cancellation_requests)
                    .where(cancellation_requests.c.job_id == job_id)
                    .order_by(cancellation_requests.c.recorded_at)
                )
            ).mappings().all()
        return [dict(e) for e in events], [dict(r) for r in requests]

    async def _bounded_reread(self, name: str, **params: Any) -> dict[str, Any] | None:
        """Bounded, so an attempt never hangs here with the database unreachable. Raises on failure."""
        async with asyncio.timeout(self.reread_timeout_seconds):
            async with self.engine.connect() as conn:
                row = (await conn.execute(statement(name), params)).mappings().first()
        return dict(row) if row is not None else None

    # --- creation and policy -----------------------------------------------------------------------------------

    async def create_job(
        self, *, job_id: UUID, tenant_id: UUID, destination_id: UUID, delivery_key: str, created_by: str
    ) -> None:
        inserted = await self._write(
            "create_job",
            job_id=job_id,
            tenant_id=tenant_id,
            destination_id=destination_id,
            delivery_key=delivery_key,
            created_by=created_by,
        )
        if inserted != 1:
            raise errors.StoreError(f"creation of export {job_id} inserted {inserted} outbox rows")

    async def reject(self, job_id: UUID, checked_version: int) -> bool:
        return await self._write("reject", job_id=job_id, checked_version=checked_version) == 1

    # --- the attempt --------------------------------------------------------------------------------------------

    async def claim(self, job_id: UUID, checked_version: int, attempt_id: UUID, worker_id: str) -> ClaimResult:
        try:
            inserted = await self._write(
                "claim",
                job_id=job_id,
                checked_version=checked_version,
                attempt_id=attempt_id,
                worker_id=worker_id,
                lease_seconds=self.lease_seconds,
            )
            if inserted == 1:
                return ClaimResult.CLAIMED
        except Exception as exc:
            if not errors.is_uncertain(exc):
                raise
            log.warning("claim of %s for attempt %s is uncertain: %s", job_id, attempt_id, exc)
        try:
            row = await self._bounded_reread("authorize_delivery_reread", job_id=job_id)
        except Exception as exc:
            if not (errors.is_uncertain(exc) or isinstance(exc, TimeoutError)):
                raise
            return ClaimResult.UNKNOWN
        # State and ownership together: Running with this attempt's ID, and nothing else, means claimed.
        if row is not None and row["status"] == Status.RUNNING and row["attempt_id"] == attempt_id:
            return ClaimResult.CLAIMED
        return ClaimResult.LOST

    async def renew_lease(self, job_id: UUID, attempt_id: UUID) -> bool:
        return (
            await self._write(
                "renew_lease", job_id=job_id, attempt_id=attempt_id, lease_seconds=self.lease_seconds
            )
            == 1
        )

    async def authorize_delivery(self, job: JobRow, attempt_id: UUID, file: BuiltFile) -> AuthorizationResult:
        try:
            inserted = await self._write(
                "authorize_delivery",
                job_id=job.id,
                tenant_id=job.tenant_id,
                attempt_id=attempt_id,
                replaces_job_id=job.replaces_job_id,
                final_name=file.final_name,
                length=file.size,
                sha256=bytes.fromhex(file.sha256_hex),
            )
            if inserted == 1:
                return AuthorizationResult.AUTHORIZED
        except Exception as exc:
            if not errors.is_uncertain(exc):
                raise
            log.warning("cutoff 2 of %s for attempt %s is uncertain: %s", job.id, attempt_id, exc)
        try:
            row = await self._bounded_reread("authorize_delivery_reread", job_id=job.id)
        except Exception as exc:
            if not (errors.is_uncertain(exc) or isinstance(exc, TimeoutError)):
                raise
            return AuthorizationResult.UNKNOWN
        if row is None or row["attempt_id"] != attempt_id:
            return AuthorizationResult.NOT_OWNER
        if row["status"] == Status.DELIVERING:
            return AuthorizationResult.AUTHORIZED
        if row["status"] != Status.RUNNING:
            return AuthorizationResult.NOT_OWNER
        if row["stop_recorded"]:
            return AuthorizationResult.STOP_RECORDED
        if row["original_status"] == Status.COMPLETED:
            return AuthorizationResult.ORIGINAL_COMPLETED
        # Expired, or renewed between the refusal and this read: either way, renew and retry once.
        return AuthorizationResult.LEASE_LAPSED

    async def finish_stopped(self, job_id: UUID, attempt_id: UUID, stop_point: str) -> bool:
        return (
            await self._write("finish_stopped", job_id=job_id, attempt_id=attempt_id, stop_point=stop_point)
            == 1
        )

    async def finish_failed(
        self, job_id: UUID, attempt_id: UUID, code: FailureCode, cause: str | None = None
    ) -> bool:
        written = await self._write(
            "finish_failed", job_id=job_id, attempt_id=attempt_id, failure_reason=code.value, cause=cause
        )
        return written == 1

    async def finish_delivery(
        self,
        job_id: UUID,
        attempt_id: UUID,
        outcome: Status,
        failure_reason: FailureCode | None,
        summary: str,
    ) -> bool:
        written = await self._write(
            "finish_delivery",
            job_id=job_id,
            attempt_id=attempt_id,
            outcome=outcome.value,
            failure_reason=failure_reason.value if failure_reason else None,
            summary=summary,
        )
        return written == 1

    async def append_evidence(
        self, job_id: UUID, attempt_id: UUID, observed_by: str, detail: dict[str, Any]
    ) -> None:
        await self._write(
            "append_evidence",
            job_id=job_id,
            attempt_id=attempt_id,
            observed_by=observed_by,
            detail=json.dumps(detail, sort_keys=True, default=str),
        )

    # --- cancellation ------------------------------------------------------------------------------------------

    async def request_cancellation(
        self, *, tenant_id: UUID, job_id: UUID, request_id: UUID, requested_by: str, reason: str | None
    ) -> CancellationResult:
        """Decide and record one cancellation request under the job's row lock (Recording Cancellation
        Requests). Busy records nothing; the client retries with the same request ID."""
        try:
            async with self.engine.begin() as conn:
                return await self._decide_and_record(conn, tenant_id, job_id, request_id, requested_by, reason)
        except Exception as exc:
            if errors.is_lock_timeout(exc):
                return CancellationResult(request_id=request_id, outcome=CancellationOutcome.BUSY, job_id=job_id)
            if isinstance(errors.translate(exc), errors.CancellationRequestExists):
                # The same request committed first under another transaction; answer from its record.
                async with self.engine.connect() as conn:
                    recorded = await self._recorded(conn, tenant_id, job_id, request_id, requested_by)
                if recorded is not None:
                    return recorded
            raise

    async def _recorded(
        self, conn: AsyncConnection, tenant_id: UUID, job_id: UUID, request_id: UUID, requested_by: str
    ) -> CancellationResult | None:
        earlier = (
            (await conn.execute(statement("cancel_find_request"), {"tenant_id": tenant_id, "request_id": request_id}))
            .mappings()
            .first()
        )
        if earlier is None:
            return None
        if earlier["job_id"] != job_id or earlier["requested_by"] != requested_by:
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
        self,
        conn: AsyncConnection,
        tenant_id: UUID,
        job_id: UUID,
        request_id: UUID,
        requested_by: str,
        reason: str | None,
    ) -> CancellationResult:
        # Bounds each lock wait of this transaction only.
        await conn.exec_driver_sql(f"SET LOCAL lock_timeout = {int(self.lock_timeout_ms)}")
        locked = (
            (await conn.execute(statement("cancel_lock_job"), {"job_id": job_id, "tenant_id": tenant_id}))
            .mappings()
            .first()
        )
        if locked is None:
            # Another tenant's job looks exactly like a missing one.
            return CancellationResult(request_id=request_id, outcome=CancellationOutcome.NOT_FOUND)
        found = JobRow.model_validate(dict(locked))

        earlier = await self._recorded(conn, tenant_id, job_id, request_id, requested_by)
        if earlier is not None:
            return earlier

        outcome = decide_cancellation(found)
        keys = {"job_id": job_id, "tenant_id": tenant_id, "request_id": request_id}
        if outcome is CancellationOutcome.CANCELED_WHILE_QUEUED:
            changed = (await conn.execute(statement("cancel_queued"), keys)).rowcount
        elif outcome is CancellationOutcome.STOP_REQUESTED:
            changed = (await conn.execute(statement("request_stop"), keys)).rowcount
        else:
            changed = 1  # these outcomes change nothing on the job
        if changed != 1:
            # Impossible while the row is locked; if it happens, the outcome is not true, so record nothing.
            log.critical("export %s changed under its row lock; outcome %s not recorded", job_id, outcome)
            raise errors.StoreError(f"export {job_id} changed under its row lock")

        recorded = (
            await conn.execute(
                statement("cancel_record_request"),
                {
                    **keys,
                    "requested_by": requested_by,
                    "reason": reason,
                    "outcome": outcome.value,
                    "found_status": found.status.value,
                    "found_attempt_id": found.attempt_id,
                    "found_attempt_count": found.attempt_count,
                    "found_delivery_authorized_at": found.delivery_authorized_at,
                },
            )
        ).rowcount
        if recorded != 1:
            raise errors.StoreError(f"cancellation request {request_id} was not recorded")
        if outcome is CancellationOutcome.STOP_REQUESTED:
            # Delivered at commit; a building attempt listening for it stops at once (the watcher is for speed).
            await conn.execute(statement("notify_stop"), {"job_id": str(job_id)})
        return CancellationResult(
            request_id=request_id,
            outcome=outcome,
            job_id=job_id,
            found_status=found.status,
            found_attempt_id=found.attempt_id,
            found_attempt_count=found.attempt_count,
        )
