"""The export's activities. Built once per worker with its dependencies; each changes a job only through store/.

The steps on the shared task queue (creation, policy and the claim, cancellation requests) are here; the build
side of an attempt is in activities/build_activities.py, its delivery side in activities/delivery_activities.py.
"""

from __future__ import annotations

import logging
from typing import Any
from uuid import UUID

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities import checkpoints, error_types
from activities.build_activities import BuildActivities
from activities.contracts import (
    MAX_NAME,
    MAX_REASON,
    TEMPORAL_CANCEL_OPERATOR,
    Admission,
    AdmitInput,
    CancelOutput,
    CancelRequest,
    ClaimInput,
    ClaimOutput,
    CreateExport,
    Evaluation,
)
from activities.delivery_activities import DeliveryActivities
from activities.destination import InvalidDestination, validate_destination
from activities.export_base import activity_methods
from store import errors
from store.models import ClaimResult, Status
from workflows.identity import EXPORT_WORKFLOW_PREFIX

log = logging.getLogger(__name__)


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
        finds its attempt in the row; one whose attempt ID a requeue has spent since is Lost."""
        evaluation = await self._evaluate(request.job_id)
        row = evaluation.row
        if row is not None and row.status is Status.RUNNING and row.attempt_id == request.attempt_id:
            return Admission(evaluation=evaluation,
                             claim=self._claim_output(ClaimResult.CLAIMED, row.id, request.attempt_id),
                             attempt=row.attempt_count, idle_recheck_seconds=self.settings.idle_recheck_seconds)
        if row is None or not evaluation.allowed:
            return Admission(evaluation=evaluation, idle_recheck_seconds=self.settings.idle_recheck_seconds)
        claim = await self._claim(row.id, row.version, request.attempt_id)
        return Admission(evaluation=evaluation, claim=claim, attempt=row.attempt_count + 1,
                         idle_recheck_seconds=self.settings.idle_recheck_seconds)

    async def _evaluate(self, job_id: UUID) -> Evaluation:
        """Reads and decides; its only write is the conditional rejection, so a repeated wake-up is harmless."""
        row = await self.store.read_job(job_id)
        if row is None or row.status is not Status.QUEUED:
            return Evaluation(row=row)
        destination = await self.store.read_destination(row.tenant_id, row.destination_id)
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

    async def _claim(self, job_id: UUID, checked_version: int, attempt_id: UUID) -> ClaimOutput:
        await self.checkpoints.reached(checkpoints.CLAIM, job_id)
        result = await self.store.claim(job_id, checked_version, attempt_id, self.worker_id)
        await self.checkpoints.reached(checkpoints.AFTER_CLAIM, job_id)
        return self._claim_output(result, job_id, attempt_id)

    def _claim_output(self, result: ClaimResult, job_id: UUID, attempt_id: UUID) -> ClaimOutput:
        if result is ClaimResult.CLAIMED:
            # The ticket this claim's poll held becomes the attempt's build slot here, where its build is scheduled
            # (with a schedule-to-start bound of one lease); freed if the build does not come (activities/capacity.py).
            self.capacity.builds.hold((job_id, attempt_id),
                                      adopt_within=self.settings.lease_seconds + self.settings.renew_every_seconds)
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

    async def _temporal_cancel_operator(self) -> str:
        """Who cancelled the workflow, as Temporal recorded it in the cancel request's history event."""
        info = activity.info()
        identity = ""
        handle = activity.client().get_workflow_handle(info.workflow_id or "", run_id=info.workflow_run_id)
        async for event in handle.fetch_history_events():
            if event.HasField("workflow_execution_cancel_requested_event_attributes"):
                identity = event.workflow_execution_cancel_requested_event_attributes.identity
                break
        return f"{TEMPORAL_CANCEL_OPERATOR}: {identity}"[:MAX_NAME] if identity else TEMPORAL_CANCEL_OPERATOR


def _uuid(value: str) -> UUID:
    try:
        return UUID(str(value))
    except ValueError:
        raise ApplicationError(f"not an export ID: {value!r}", type=error_types.INVALID_EXPORT_INPUT,
                               non_retryable=True) from None
