"""The application role's store: one async method per domain operation on a job, its cancellation, its terms and
replacement, and the destinations it reads. Every write is the documented conditional statement, run through
store/statements.py's Database."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any, NamedTuple
from uuid import UUID, uuid4

from sqlalchemy import and_, bindparam, select
from sqlalchemy.ext.asyncio import AsyncEngine

from store import cancellation, errors
from store.models import (
    AuthorizationResult,
    BuiltFile,
    CancellationResult,
    ClaimResult,
    FailureCode,
    JobRow,
    Status,
)
from store.schema import cancellation_requests, destinations, export_attempt_events, export_jobs
from store.statements import Reread, RoleStore, Written, evidence_json, fetch_one, statement, storable

log = logging.getLogger(__name__)


def build_holder(worker_id: str, generation: int) -> str:
    """The holder a build records on its row, unique to it: its worker, then its generation (the run's count of
    the attempt's resumptions: 0 for the first build) and a token. build_start.sql reads the generation back from
    the row's holder, so that no build takes the slot from one the run scheduled after it."""
    return f"{worker_id}/b{generation}.{uuid4().hex[:12]}"


def check_confirmation(outcome: Status, confirmed_by: str | None) -> None:
    """A Completed says what confirmed it, and only a Completed does (ck_export_jobs_confirmed): said here, so that
    a write that would match nothing still fails loudly for a caller that forgot it."""
    if (outcome is Status.COMPLETED) != (confirmed_by is not None):
        raise ValueError("a Completed says what confirmed it, and only a Completed does")


# read_job_and_destination's labels for the destination's columns, apart from the job's of the same names.
_DESTINATION = "destination__"
# Built once: it is read at every policy evaluation, and making it (its 44 labelled columns, its cache key) cost
# about 0.15 ms each time. So are the row's and the destination's own reads, each made several times per export
# (making the query cost about 0.1 ms a time).
_JOB_AND_DESTINATION = select(
    *export_jobs.c, *(column.label(_DESTINATION + column.name) for column in destinations.c),
).select_from(export_jobs.outerjoin(destinations, and_(
    destinations.c.tenant_id == export_jobs.c.tenant_id, destinations.c.id == export_jobs.c.destination_id,
))).where(export_jobs.c.id == bindparam("job_id"))
_JOB = select(export_jobs).where(export_jobs.c.id == bindparam("job_id"))
_TENANTS_JOB = _JOB.where(export_jobs.c.tenant_id == bindparam("tenant_id"))
_DESTINATION_ROW = select(destinations).where(
    destinations.c.tenant_id == bindparam("tenant_id"), destinations.c.id == bindparam("destination_id"))


# A waiter for a partner session asks about every second: one silent for this long (paused, or gone) holds no later
# waiter back, and one silent for the second bound loses its place (take_partner_session.sql).
SESSION_WAITER_SECONDS = 5.0
SESSION_WAITER_FORGOTTEN_SECONDS = 600.0


class PartnerSession(NamedTuple):
    """take_partner_session.sql's answer: the destination's session limit now (None: none) and the attempt's slot
    under it (None while every slot is held)."""

    limit: int | None
    slot: int | None


class JobStore(RoleStore):
    """The application role (EXPORTS_DATABASE_URL): the activities and the starter."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        lease_seconds: float,
        lock_timeout_ms: int = 2000,
        reread_timeout_seconds: float = 5.0,
        on_ended: Callable[[Status], None] = lambda status: None,
    ) -> None:
        super().__init__(engine, reread_timeout_seconds=reread_timeout_seconds)
        self.lease_seconds = lease_seconds
        self.lock_timeout_ms = lock_timeout_ms
        self.reread_timeout_seconds = reread_timeout_seconds
        # Told of each settled state this store recorded (a rejection, an attempt's terminal write): the worker's
        # metrics count them here, once, whichever step wrote them.
        self.on_ended = on_ended

    async def _write(self, name: str, **params: Any) -> int:
        """A conditional write whose row count is the whole answer (an uncertain one is raised)."""
        written: Written[int] = await self.db.write(name, **params)  # no re-read: its count is always known
        return written.count

    # --- reads -------------------------------------------------------------------------------------------------

    async def read_job(self, job_id: UUID, *, tenant_id: UUID | None = None) -> JobRow | None:
        if tenant_id is None:
            row = await self.db.row(_JOB, job_id=job_id)
        else:
            row = await self.db.row(_TENANTS_JOB, job_id=job_id, tenant_id=tenant_id)
        return JobRow.model_validate(row) if row is not None else None

    async def read_job_and_destination(self, job_id: UUID) -> tuple[JobRow | None, dict[str, Any] | None]:
        """The row and its destination (None where the tenant has none by that ID) in one round trip, as
        read_job and read_destination would each answer them: what deciding an export's policy needs."""
        found = await self.db.row(_JOB_AND_DESTINATION, job_id=job_id)
        if found is None:
            return None, None
        destination = {key.removeprefix(_DESTINATION): value for key, value in found.items()
                       if key.startswith(_DESTINATION)}
        job = JobRow.model_validate({key: value for key, value in found.items() if not key.startswith(_DESTINATION)})
        return job, destination if destination["id"] is not None else None

    async def read_jobs(self, job_ids: list[UUID]) -> dict[UUID, JobRow]:
        """Several rows in one query, by ID; missing ones are absent from the result."""
        if not job_ids:
            return {}
        rows = await self.db.rows(select(export_jobs).where(export_jobs.c.id.in_(job_ids)))
        return {row["id"]: JobRow.model_validate(row) for row in rows}

    async def read_destination(self, tenant_id: UUID, destination_id: UUID) -> dict[str, Any] | None:
        return await self.db.row(_DESTINATION_ROW, tenant_id=tenant_id, destination_id=destination_id)

    async def job_ids_between(self, low: UUID, high: UUID, *, limit: int, tenant_id: UUID | None = None) -> list[UUID]:
        """Export IDs in [low, high], at most `limit` (an operator's ID prefix, as a range on the primary key), of
        one tenant's exports only when `tenant_id` is given."""
        query = (select(export_jobs.c.id).where(export_jobs.c.id.between(low, high))
                 .order_by(export_jobs.c.id).limit(limit))
        if tenant_id is not None:
            query = query.where(export_jobs.c.tenant_id == tenant_id)
        return [row["id"] for row in await self.db.rows(query)]

    async def read_destinations(self, tenant_id: UUID | None = None,
                                destination_id: UUID | None = None) -> list[dict[str, Any]]:
        """Destinations, all of them or one tenant's (or one), by tenant, name and ID."""
        query = select(destinations).order_by(destinations.c.tenant_id, destinations.c.name, destinations.c.id)
        if tenant_id is not None:
            query = query.where(destinations.c.tenant_id == tenant_id)
        if destination_id is not None:
            query = query.where(destinations.c.id == destination_id)
        return await self.db.rows(query)

    async def attempt_delivering(self, attempt_id: UUID) -> bool:
        """Whether this attempt still holds a row in Delivering: its upload may still run."""
        return await self._exists(export_jobs.c.attempt_id == attempt_id,
                                  export_jobs.c.status == Status.DELIVERING.value)

    async def final_name_in_use(self, destination_id: UUID, final_name: str) -> bool:
        """Whether an export to this destination has this final name (names carry the tenant: migration 0007)."""
        return await self._exists(export_jobs.c.destination_id == destination_id,
                                  export_jobs.c.final_name == final_name)

    async def _exists(self, *conditions: Any) -> bool:
        return await self.db.row(select(export_jobs.c.id).where(*conditions).limit(1)) is not None

    async def request_cancellation(
        self, *, tenant_id: UUID, job_id: UUID, request_id: UUID, requested_by: str, reason: str | None
    ) -> CancellationResult:
        return await cancellation.record(
            self.db,
            self.lock_timeout_ms,
            tenant_id=tenant_id,
            job_id=job_id,
            request_id=request_id,
            requested_by=requested_by,
            reason=reason,
        )

    async def history(self, job_id: UUID) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The job's attempt events and cancellation requests, oldest first."""
        async with self.db.connection() as conn:
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

    # --- operators' writes on queued work --------------------------------------------------------------------

    async def create_replacement(
        self,
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
        async with self.db.transaction() as conn:
            named = await fetch_one(conn, "resolve_original", tenant_id=tenant_id, job_id=original_job_id)
            if named is None:
                raise errors.NotReplaceable(f"export {original_job_id} not found for this tenant")
            original: UUID = named["original_job_id"]
            written = await self.db.write(
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

    async def edit_terms(
        self, *, tenant_id: UUID, job_id: UUID, expected_version: int, destination_id: UUID
    ) -> bool:
        """Change a queued export's destination. False when it started, ended, or was edited since it was read."""
        written = await self.db.write("edit_terms", tenant_id=tenant_id, job_id=job_id,
                                      expected_version=expected_version, destination_id=destination_id)
        return written.changed

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

    async def reject(self, job_id: UUID, checked_version: int, reason: str) -> bool:
        if await self._write("reject", job_id=job_id, checked_version=checked_version, reason=reason) != 1:
            return False
        self.on_ended(Status.REJECTED)
        return True

    # --- the attempt --------------------------------------------------------------------------------------------

    async def claim(self, job_id: UUID, checked_version: int, attempt_id: UUID, worker_id: str) -> ClaimResult:
        try:
            written = await self.db.write(
                "claim",
                reread=Reread("ownership_reread", {"job_id": job_id}),
                job_id=job_id,
                checked_version=checked_version,
                attempt_id=attempt_id,
                worker_id=worker_id,
                lease_seconds=self.lease_seconds,
            )
        except errors.TransitionAlreadyRecorded:
            # This attempt ID already claimed the job once (a retry after recovery requeued it): the ID is spent.
            log.warning("claim of %s: attempt %s was already used; lost", job_id, attempt_id)
            return ClaimResult.LOST
        if written.changed:
            return ClaimResult.CLAIMED
        if written.unanswered is not None:
            return ClaimResult.UNKNOWN
        # State and ownership together: Running with this attempt's ID, and nothing else, means claimed.
        row = written.row
        if row is not None and row["status"] == Status.RUNNING and row["attempt_id"] == attempt_id:
            return ClaimResult.CLAIMED
        if (written.uncertain and row is not None and row["status"] == Status.QUEUED
                and row["version"] == checked_version):
            # The row is as this claim checked it: nobody else took or changed it. Lost would settle the wake-up
            # with the job still Queued, waiting for one that may never come; unconfirmed, it is read again soon.
            # Should the lost statement still commit after this read, its attempt holds a lease that nobody
            # renews, and recovery takes it over: the job still runs once.
            return ClaimResult.UNKNOWN
        return ClaimResult.LOST

    async def start_build(self, job_id: UUID, attempt_id: UUID, holder: str, detail: str,
                          generation: int = -1) -> bool:
        """A build takes its attempt's build slot (build_start.sql), fencing any earlier build of the attempt.
        False when the attempt no longer holds the row, or a build the run scheduled after this one (a greater
        `generation`, see build_holder) holds the slot; on an uncertain answer the row is asked."""
        written = await self.db.write(
            "build_start", reread=Reread("ownership_reread", {"job_id": job_id}, when_unchanged=False),
            job_id=job_id, attempt_id=attempt_id, holder=holder, lease_seconds=self.lease_seconds, detail=detail,
            generation=generation,
        )
        if not written.uncertain:
            return written.changed
        if written.unanswered is not None:
            raise written.unanswered
        row = written.row
        return (row is not None and row["status"] == Status.RUNNING and row["attempt_id"] == attempt_id
                and row["claimed_by"] == holder)

    async def renew_lease(self, job_id: UUID, attempt_id: UUID, holder: str | None = None) -> bool:
        return (
            await self._write(
                "renew_lease", job_id=job_id, attempt_id=attempt_id, holder=holder,
                lease_seconds=self.lease_seconds,
            )
            == 1
        )

    async def take_partner_session(self, destination_id: UUID, job_id: UUID, attempt_id: UUID) -> PartnerSession:
        """A slot of the destination's session limit for the attempt (take_partner_session.sql): the one it holds,
        or a free one that no waiter ahead of it is owed, with the limit as it is now. Each ask keeps the attempt's
        place among the waiters. Safe to repeat: a lost answer is asked again."""
        async with self.db.transaction() as conn:
            found = (await conn.execute(statement("take_partner_session"), {
                "destination_id": destination_id, "job_id": job_id, "attempt_id": attempt_id,
                "waiter_seconds": SESSION_WAITER_SECONDS,
                "forget_seconds": SESSION_WAITER_FORGOTTEN_SECONDS})).first()
        if found is None:  # no such destination: nothing to wait for (the upload finds it gone)
            return PartnerSession(limit=None, slot=None)
        return PartnerSession(limit=found[0], slot=found[1])

    async def keep_partner_session(self, job_id: UUID, attempt_id: UUID) -> bool:
        """The attempt's upload keeps its session a lease from now, whatever its row says meanwhile
        (keep_partner_session.sql); False if it holds none."""
        return await self._write("keep_partner_session", job_id=job_id, attempt_id=attempt_id,
                                 lease_seconds=self.lease_seconds) == 1

    async def release_partner_session(self, job_id: UUID, attempt_id: UUID) -> None:
        await self._write("release_partner_session", job_id=job_id, attempt_id=attempt_id)

    async def wake_run(self, job_id: UUID) -> bool:
        """A wake-up for the export's run (wake_run.sql); False when there is no such export."""
        return await self._write("wake_run", job_id=job_id) == 1

    async def run_waits_on_attempt(self, job_id: UUID, attempt_id: UUID, given_up: UUID | None = None) -> bool:
        """A run found the row `Running` or `Delivering` under `attempt_id` and waits: the attempt's terminal write
        wakes it (run_waits_on_attempt.sql). `given_up`: the attempt whose cutoff 2 the run gave up, which cutoff 2
        then refuses. False when the row no longer reads so."""
        return await self._write("run_waits_on_attempt", job_id=job_id, attempt_id=attempt_id,
                                 given_up=given_up) == 1

    async def release_lease(self, job_id: UUID, attempt_id: UUID, holder: str) -> bool:
        return await self._write("release_lease", job_id=job_id, attempt_id=attempt_id, holder=holder) == 1

    async def pass_rename_fence(self, job_id: UUID, attempt_id: UUID, holder: str, observed_by: str,
                                detail: dict[str, Any]) -> bool:
        """The upload's last write before its rename (pass_rename_fence.sql), with `detail` as its evidence: True
        when the attempt may send the rename, False when it may not (recovery took the attempt back, or the row
        moved on). A lost answer is settled by re-reading the row; one that cannot be re-read either is raised, as
        the database's error, for the caller to try again."""
        written = await self.db.write(
            "pass_rename_fence",
            reread=Reread("ownership_reread", {"job_id": job_id}, when_unchanged=False),
            job_id=job_id, attempt_id=attempt_id, holder=holder, observed_by=observed_by,
            detail=evidence_json(detail),
        )
        if not written.uncertain:
            return written.changed
        if written.unanswered is not None:
            raise written.unanswered
        row = written.row
        if row is None or row["status"] != Status.DELIVERING.value or row["attempt_id"] != attempt_id or (
                row["claimed_by"] != holder):
            return False  # the row moved on: taken back (or finished) meanwhile
        if row["rename_fence"] == "passed":
            return True
        # Still this attempt's, the fence still open: the lost write never committed. Not a refusal: try it again.
        raise ConnectionError(f"the rename fence of {job_id} attempt {attempt_id} was not written (its answer was "
                              "lost before it committed)")

    async def authorize_delivery(self, job: JobRow, attempt_id: UUID, file: BuiltFile, *,
                                 not_after: datetime | None = None) -> AuthorizationResult:
        """Cutoff 2. `not_after`: the step's own bound, after which it authorizes nothing (it reads as a lapsed
        lease: the caller knows its bound passed)."""
        written = await self.db.write(
            "authorize_delivery",
            reread=Reread("ownership_reread", {"job_id": job.id}),
            job_id=job.id,
            tenant_id=job.tenant_id,
            attempt_id=attempt_id,
            holder=file.holder,
            replaces_job_id=job.replaces_job_id,
            final_name=file.final_name,
            length=file.size,
            sha256=bytes.fromhex(file.sha256_hex),
            lease_seconds=self.lease_seconds,
            not_after=not_after,
        )
        if written.changed:
            return AuthorizationResult.AUTHORIZED
        if written.unanswered is not None:
            return AuthorizationResult.UNKNOWN
        return _authorization_in(written.row, attempt_id, file.holder)

    async def authorization_on_record(self, job_id: UUID, attempt_id: UUID,
                                      holder: str | None) -> AuthorizationResult:
        """What the row says of an attempt's cutoff 2 whose answer and re-read were both lost (UNKNOWN), read with
        the same statement as that re-read; a read that fails is raised, for the caller to ask again."""
        return _authorization_in(await self.db.row("ownership_reread", job_id=job_id), attempt_id, holder)

    async def finish_stopped(self, job_id: UUID, attempt_id: UUID, stop_point: str, *,
                             holder: str | None = None) -> bool:
        return await self._finish(
            "finish_stopped", "Stopped", Status.STOPPED, None,
            job_id=job_id, attempt_id=attempt_id, stop_point=stop_point, holder=holder,
        )

    async def finish_failed(
        self, job_id: UUID, attempt_id: UUID, code: FailureCode, cause: str | None = None, *,
        holder: str | None = None,
    ) -> bool:
        return await self._finish(
            "finish_failed", "Failed", Status.FAILED, code,
            job_id=job_id, attempt_id=attempt_id, failure_reason=code.value, cause=cause, holder=holder,
        )

    async def finish_delivery(
        self,
        job_id: UUID,
        attempt_id: UUID,
        outcome: Status,
        failure_reason: FailureCode | None,
        summary: str,
        *,
        holder: str | None = None,
        confirmed_by: str | None = None,
        wake: bool = False,
    ) -> bool:
        """The terminal write after cutoff 2; a Completed says what confirmed it (sha256, acknowledgment, size).
        Raises when neither the write nor the re-read got an answer: the delivery waits for the database (it holds
        an outcome that only it knows), where other steps leave the attempt to recovery. `wake`: with a wake-up
        through the outbox, for a delivery whose run is gone."""
        check_confirmation(outcome, confirmed_by)
        return await self._finish(
            "finish_delivery", "Finished", outcome, failure_reason, unanswered_raises=True,
            job_id=job_id,
            attempt_id=attempt_id,
            holder=holder,
            confirmed_by=confirmed_by,
            wake=wake,
            outcome=outcome.value,
            failure_reason=failure_reason.value if failure_reason else None,
            summary=storable(summary),
        )

    async def _finish(
        self, name: str, kind: str, expected: Status, code: FailureCode | None, *, unanswered_raises: bool = False,
        **params: Any
    ) -> bool:
        """A terminal write with the claim's shape: whether this attempt's terminal state is recorded. On an
        uncertain error or no row, the row is asked; if that fails too, False, and recovery resolves the job (or,
        with `unanswered_raises`, the re-read's error)."""
        job_id, attempt_id = params["job_id"], params["attempt_id"]
        written = await self.db.write(
            name, reread=Reread("finish_reread", {"job_id": job_id, "attempt_id": attempt_id, "kind": kind}),
            **params,
        )
        if written.unanswered is not None:
            if unanswered_raises:
                raise written.unanswered
            log.warning("re-read after %s of %s for attempt %s failed, leaving it to recovery: %s",
                        name, job_id, attempt_id, errors.describe(written.unanswered))
            return False
        row = written.row
        # The expected state, code and owner together, and this attempt's own event: not recovery's resolution.
        recorded = written.changed or (
            row is not None
            and row["status"] == expected
            and row["attempt_id"] == attempt_id
            and row["failure_reason"] == (code.value if code else None)
            and row["event_recorded"]
        )
        if recorded:
            self.on_ended(expected)
        return recorded

    async def append_evidence(
        self, job_id: UUID, attempt_id: UUID, observed_by: str, detail: dict[str, Any], *, holder: str | None = None
    ) -> None:
        """Evidence of one attempt. Only the attempt's holder names itself (`holder`), and the database keeps the
        name only while that holder holds the Delivering row: recovery trusts nothing else."""
        await self._write(
            "append_evidence",
            job_id=job_id,
            attempt_id=attempt_id,
            holder=holder,
            observed_by=observed_by,
            detail=evidence_json(detail),
        )


def _authorization_in(row: dict[str, Any] | None, attempt_id: UUID, holder: str | None) -> AuthorizationResult:
    """Cutoff 2's answer as the row tells it (ownership_reread.sql), when the write changed nothing or its answer was
    lost."""
    if row is None or row["attempt_id"] != attempt_id:
        return AuthorizationResult.NOT_OWNER
    if holder is not None and row["claimed_by"] != holder:
        return AuthorizationResult.NOT_OWNER  # another build of this attempt fenced this one
    if row["status"] == Status.DELIVERING:
        return AuthorizationResult.AUTHORIZED
    if row["status"] != Status.RUNNING:
        return AuthorizationResult.NOT_OWNER
    if row["stop_recorded"]:
        return AuthorizationResult.STOP_RECORDED
    if row["original_status"] == Status.COMPLETED:
        return AuthorizationResult.ORIGINAL_COMPLETED
    if row["run_gave_up"]:
        return AuthorizationResult.NOT_OWNER  # its run gave the step up and will not deliver the attempt
    # Expired, or renewed between the refusal and this read: either way, renew and retry once.
    return AuthorizationResult.LEASE_LAPSED
