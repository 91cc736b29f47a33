"""The export's activities. Built once per worker with its dependencies; each changes a job only through store/.

The steps on the shared task queue (creation, policy and the claim, cancellation requests) are here; the build
side of an attempt is in activities/build_activities.py, its delivery side in activities/delivery_activities.py.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import unicodedata
from datetime import timedelta
from typing import Any
from uuid import UUID

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities import checkpoints, error_types
from activities.build_activities import BuildActivities
from activities.capacity import ClaimStep
from activities.contracts import (
    MAX_NAME,
    MAX_REASON,
    TEMPORAL_CANCEL_OPERATOR,
    Admission,
    AdmitInput,
    CancelBatch,
    CancelBatchOutput,
    CancelOutput,
    CancelRequest,
    ClaimInput,
    ClaimOutput,
    CreateExport,
    Evaluation,
)
from activities.delivery_activities import DeliveryActivities
from activities.destination import InvalidDestination, validate_destination
from activities.export_base import activity_methods, hand_over_window
from activities.lease import heartbeating
from activities.process import metrics
from store import errors
from store.models import CancellationOutcome, CancellationResult, ClaimResult, JobRow, Status
from workflows.identity import EXPORT_WORKFLOW_PREFIX

log = logging.getLogger(__name__)

# The claim step running in this task, if any: its attempt's build slot replaces it in the worker's count.
_CLAIM_STEP: contextvars.ContextVar[ClaimStep | None] = contextvars.ContextVar("claim_step", default=None)
# How long a claim waits in its step for its destination's share (LD4): below the claim's start-to-close timeout
# (workflows/export.py), so that it ends, and is scheduled again, before Temporal gives up on it.
_DESTINATION_WAIT = 90.0
# How often a claim waiting there heartbeats: well within its heartbeat timeout (workflows/export.py).
_DESTINATION_HEARTBEAT = 10.0
# The states whose attempt's own terminal write settles the row, perhaps from a step Temporal gave up.
_ATTEMPT_UNDER_WAY = frozenset({Status.RUNNING, Status.DELIVERING})
# How many attempts a run's read marks as waited on, when each it finds under way has been replaced by the next
# meanwhile; past that the run waits with only its idle recheck.
_WAIT_MARK_TRIES = 3


class ExportActivities(BuildActivities, DeliveryActivities):
    """Every activity of an export, registered under its method's name (the activity type that histories record)."""

    def all(self) -> list[Any]:
        return activity_methods(self)

    # --- shared task queue ------------------------------------------------------------------------------------

    @activity.defn
    async def create_export(self, request: CreateExport) -> None:
        """The creation statement, for a platform team that starts the workflow directly. Idempotent: a retry
        that finds its own job already created succeeds."""
        try:
            await self.store.create_job(
                job_id=request.job_id,
                tenant_id=request.tenant_id,
                destination_id=request.destination_id,
                delivery_key=request.delivery_key,
                created_by=request.created_by,
            )
        except errors.JobAlreadyExists:
            existing = await self.store.read_job(request.job_id, tenant_id=request.tenant_id)
            if existing is None or existing.delivery_key != request.delivery_key:
                raise ApplicationError("an export with this ID already exists", type=error_types.EXPORT_ID_TAKEN,
                                       non_retryable=True) from None
        except errors.ConstraintViolation as exc:
            # Without its cause: the run reports the innermost error, which would be the driver's text.
            raise error_types.store_refusal(exc, str(exc)) from None

    @activity.defn
    async def evaluate_policy(self, job_id: str) -> Evaluation:
        """Runs of the workflow that began before `claim_if_allowed` existed evaluate and claim in two steps."""
        return await self._evaluate(_uuid(job_id))

    @activity.defn
    async def claim(self, request: ClaimInput) -> ClaimOutput:
        return await self._claim(request.job_id, request.checked_version, request.attempt_id)

    @activity.defn
    async def claim_if_allowed(self, request: AdmitInput) -> Admission:
        """Read the row, evaluate policy (its only write is the conditional rejection) and, if allowed, claim at the
        version read (cutoff 1): two documented statements, one step. A retry whose first try's claim committed
        finds its attempt in the row; one whose attempt ID a requeue has spent since is Lost.

        With `given_up` (the run's read right after it gave a cutoff 2 up, on the shared queue, where any worker
        takes it: the mark must not wait for a build slot), it reads and marks only, and never claims: a claim
        there would take a slot that no admission poll's ticket counted, and a late try of it could claim an
        attempt the run no longer drives. A row it could claim is answered allowed and unclaimed, with a wake-up
        (the run waits for one, as 0.2.0's does after such an answer, and then claims on the admission queue)."""
        if request.given_up is not None:
            evaluation = await self._evaluate(request.job_id, given_up=request.given_up)
            if evaluation.allowed:
                await self.store.wake_run(request.job_id)
            return Admission(evaluation=evaluation, idle_recheck_seconds=self.settings.idle_recheck_seconds)
        step = self.capacity.builds.claim_started()
        if step is None:
            raise ApplicationError("this worker's build slots are taken; the claim is scheduled again",
                                   type=error_types.WORKER_BUSY, next_retry_delay=timedelta(seconds=1))
        token = _CLAIM_STEP.set(step)
        try:
            return await self._admit(request)
        finally:
            _CLAIM_STEP.reset(token)
            self.capacity.builds.claim_ended(step)

    async def _admit(self, request: AdmitInput) -> Admission:
        evaluation = await self._evaluate(request.job_id, own_attempt=request.attempt_id)
        row = evaluation.row
        if row is not None and row.status is Status.RUNNING and row.attempt_id == request.attempt_id:
            found = self._claim_output(ClaimResult.CLAIMED, row.id, request.attempt_id,
                                       keep=row.claimed_by == self.worker_id)
            # Its first try's place was given up with that try: it counts in its destination's share again (LD4).
            self.capacity.shares.adopt(row.destination_id, (row.id, request.attempt_id))
            return Admission(evaluation=evaluation, claim=found, attempt=row.attempt_count,
                             idle_recheck_seconds=self.settings.idle_recheck_seconds)
        if row is None or not evaluation.allowed:
            return Admission(evaluation=evaluation, idle_recheck_seconds=self.settings.idle_recheck_seconds)
        key = (row.id, request.attempt_id)
        claim: ClaimOutput | None = None
        try:
            if not self.capacity.shares.reserve(row.destination_id, key):
                # Its destination holds its share of this worker (LD4): wait here, then read the row again.
                await self._room_at(row.destination_id, key)
                evaluation = await self._evaluate(request.job_id, own_attempt=request.attempt_id)
                row = evaluation.row
                if row is None or not evaluation.allowed:
                    return Admission(evaluation=evaluation, idle_recheck_seconds=self.settings.idle_recheck_seconds)
            claim = await self._claim(row.id, row.version, request.attempt_id)
        finally:
            # A place reserved and not claimed with (refused, lost, failed) is given up.
            self.capacity.shares.settle(key, claimed=claim is not None and claim.result is ClaimResult.CLAIMED)
        return Admission(evaluation=evaluation, claim=claim, attempt=row.attempt_count + 1,
                         idle_recheck_seconds=self.settings.idle_recheck_seconds)

    async def _room_at(self, destination_id: UUID, key: tuple[UUID, UUID]) -> None:
        """Wait for a place in the destination's share of this worker, the poll's build ticket parked meanwhile so
        that the worker goes on claiming for other destinations; it counts again before the claim.
        Bounded below the step's timeout: past it, or when the worker begins shutting down, nothing is claimed and
        Temporal schedules the claim again, on any worker."""
        parked = self.capacity.builds.park()
        metrics.slot_wait("destination")
        log.info("export %s waits for a place among the %d attempts to its destination this worker holds at once",
                 key[0], self.capacity.shares.limit)
        waiting = asyncio.ensure_future(self.capacity.shares.wait_for_room(destination_id, key, _DESTINATION_WAIT))
        shutdown = asyncio.ensure_future(activity.wait_for_worker_shutdown() if activity.in_activity()
                                         else asyncio.Event().wait())
        got = False
        try:
            # Its heartbeats keep the claim's short heartbeat timeout from firing while it waits; a claim whose
            # worker is paused or gone still comes back within that timeout, not the step's longer one.
            async with heartbeating(_DESTINATION_HEARTBEAT,
                                    lambda: {"waiting": "for a place among its destination's attempts here"}):
                await asyncio.wait({waiting, shutdown}, return_when=asyncio.FIRST_COMPLETED)
            got = waiting.done() and not waiting.cancelled() and waiting.exception() is None and waiting.result()
        finally:
            shutdown.cancel()
            waiting.cancel()
            await asyncio.gather(waiting, shutdown, return_exceptions=True)
            await self.capacity.builds.unpark(ticket=parked, wait=got)
        if not got:
            raise ApplicationError(
                f"export {key[0]}: its destination holds its share of this worker "
                f"({self.capacity.shares.limit} at once); the claim is scheduled again",
                type=error_types.DESTINATION_BUSY, next_retry_delay=timedelta(seconds=1))

    async def _evaluate(self, job_id: UUID, *, own_attempt: UUID | None = None,
                        given_up: UUID | None = None) -> Evaluation:
        """Reads and decides; its writes are the conditional rejection and the mark of a run that waits on another
        attempt than `own_attempt` (the claim's own, found by its retry, is the run's to carry on: no wake-up), with
        `given_up` (the attempt whose cutoff 2 the run gave up) marked if it is that attempt, so a repeated wake-up
        is harmless."""
        row, destination = await self.store.read_job_and_destination(job_id)
        if row is not None and row.status in _ATTEMPT_UNDER_WAY and row.attempt_id != own_attempt:
            return Evaluation(row=await self._waiting_on_attempt(row, given_up))
        if row is None or row.status is not Status.QUEUED:
            return Evaluation(row=row)
        if destination is None:
            reason = "the destination does not exist for this tenant"
        elif not destination["enabled"]:
            reason = f"destination {destination['name']!r} is disabled"
        else:
            # A contract the delivery could not act on (a known_hosts line for a host key, say) would fail only
            # at the connect after cutoff 2: refuse it now, before anything is claimed.
            try:
                validate_destination(destination)
            except InvalidDestination as exc:
                reason = f"destination {destination['name']!r} is not valid: {exc}"
            else:
                return Evaluation(row=row, allowed=True)
        if await self.store.reject(row.id, row.version, reason[:MAX_REASON]):
            log.info("export %s rejected at version %s: %s", row.id, row.version, reason)
        return Evaluation(row=await self.store.read_job(row.id), reason=reason)

    async def _waiting_on_attempt(self, row: JobRow, given_up: UUID | None) -> JobRow | None:
        """The run may wait for a wake-up on a `Running` or `Delivering` row: its attempt's terminal write is to
        write one, which a step Temporal gave up cannot always know to do (its heartbeats went nowhere). A row that
        moved on meanwhile is returned as it is now, or marked again if another attempt holds it by then."""
        for _ in range(_WAIT_MARK_TRIES):
            assert row.attempt_id is not None  # a Running or Delivering row names its attempt
            if await self.store.run_waits_on_attempt(row.id, row.attempt_id, given_up):
                return row
            again = await self.store.read_job(row.id)
            if again is None or again.status not in _ATTEMPT_UNDER_WAY or again.attempt_id == row.attempt_id:
                return again
            row = again
        return row

    async def _claim(self, job_id: UUID, checked_version: int, attempt_id: UUID) -> ClaimOutput:
        await self.checkpoints.reached(checkpoints.CLAIM, job_id)
        sent_at = asyncio.get_running_loop().time()  # the claim sets the lease, at the server, after this
        result = await self.store.claim(job_id, checked_version, attempt_id, self.worker_id)
        if result is ClaimResult.CLAIMED:
            self._keep_claimed(job_id, attempt_id, sent_at)  # from the commit on, until the build comes
        await self.checkpoints.reached(checkpoints.AFTER_CLAIM, job_id)
        return self._claim_output(result, job_id, attempt_id)

    def _claim_output(self, result: ClaimResult, job_id: UUID, attempt_id: UUID, *, keep: bool = False) -> ClaimOutput:
        """`keep`: the claim committed in an earlier try, and the row names this worker as its holder, so this
        worker's keeper renews the claim's lease (`_claim` starts it for a claim it made)."""
        if result is ClaimResult.CLAIMED:
            if keep and (job_id, attempt_id) not in self.keepers:
                self._keep_claimed(job_id, attempt_id, None)
            # The ticket this claim's poll held becomes the attempt's build slot here, where its build is scheduled
            # once the run's next workflow task has run; freed if the build does not come within as long as that may
            # take (hand_over_window, activities/export_base.py; activities/capacity.py).
            self.capacity.builds.hold((job_id, attempt_id), claim=_CLAIM_STEP.get(),
                                      adopt_within=hand_over_window(self.settings.lease_seconds,
                                                                    self.settings.renew_every_seconds,
                                                                    self.settings.sticky_queue_timeout_seconds))
        return ClaimOutput(result=result, worker_task_queue=self.worker_task_queue,
                           lease_seconds=self.settings.lease_seconds)

    @activity.defn
    async def record_cancellation(self, request: CancelRequest) -> CancelOutput:
        # Only an export's run schedules it (a standalone activity would have no workflow ID: not an export's).
        job_id = _uuid((activity.info().workflow_id or "").removeprefix(EXPORT_WORKFLOW_PREFIX))
        requested_by = request.requested_by
        if requested_by == TEMPORAL_CANCEL_OPERATOR:
            requested_by = await self._temporal_cancel_operator()
        result = await self.store.request_cancellation(
            tenant_id=request.tenant_id,
            job_id=job_id,
            request_id=request.request_id,
            requested_by=requested_by,
            reason=request.reason,
        )
        return CancelOutput(result=result)

    @activity.defn
    async def record_cancellations(self, batch: CancelBatch) -> CancelBatchOutput:
        """Requests that waited together, each recorded as `record_cancellation` records one, in order. A retry
        after a failure part way records nothing twice: the requests recorded before it answer with their outcome
        (one record per request ID). Once one finds the row locked past the lock timeout (Busy), the rest are
        answered Busy without asking: each would wait as long for the same row's lock, and a batch of them outlasted
        the step's bound, to be retried whole; Busy records nothing, and the run asks them again."""
        results: list[CancellationResult] = []
        for request in batch.requests:
            if results and results[-1].outcome is CancellationOutcome.BUSY:
                results.append(CancellationResult(request_id=request.request_id, outcome=CancellationOutcome.BUSY,
                                                  job_id=results[-1].job_id))
            else:
                results.append((await self.record_cancellation(request)).result)
        return CancelBatchOutput(results=results)

    async def _temporal_cancel_operator(self) -> str:
        """Who cancelled the workflow, as Temporal recorded it in the cancel request's history event."""
        info = activity.info()
        identity = ""
        handle = activity.client().get_workflow_handle(info.workflow_id or "", run_id=info.workflow_run_id)
        async for event in handle.fetch_history_events():
            if event.HasField("workflow_execution_cancel_requested_event_attributes"):
                identity = event.workflow_execution_cancel_requested_event_attributes.identity
                break
        identity = _shown(identity)
        return f"{TEMPORAL_CANCEL_OPERATOR}: {identity}"[:MAX_NAME] if identity.strip() else TEMPORAL_CANCEL_OPERATOR


def _shown(identity: str) -> str:
    """A client's identity as an operator name can hold it. Whatever the cancelling client said it is, its cancel
    must be recorded (the server takes one cancel of a run), so its text is mended, not refused as an operator's
    typed name is: a NUL, which PostgreSQL refuses, and any other control character, which would reach an
    operator's terminal (ESC), become U+FFFD."""
    return "".join("\ufffd" if unicodedata.category(c) == "Cc" else c for c in identity)


def _uuid(value: str) -> UUID:
    try:
        return UUID(str(value))
    except ValueError:
        raise ApplicationError(f"not an export ID: {value!r}", type=error_types.INVALID_EXPORT_INPUT,
                               non_retryable=True) from None
