"""RecoveryWorkflow, SweeperWorkflow, PartnerSweepWorkflow and EvidenceFollowUpWorkflow, each started by a Temporal
Schedule that never runs two at once.

Recovery nominates expired attempts and takes each over with its own activity (one conditional statement per
case), so the UI shows what it did to which export. The sweeper republishes queued jobs whose wake-up is old.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any, TypedDict, TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from exports_client.contracts import validation_problems
    from pydantic import BaseModel, ValidationError

    from activities.contracts import (
        Candidate,
        DestinationRef,
        FollowUpCandidate,
        FollowUpInput,
        FollowUpOutput,
        FollowUpReport,
        PartnerSweepOutput,
        RecoveryInput,
        RecoveryReport,
        SweepInput,
        TakeoverOutput,
    )
    from activities.error_types import INVALID_SCHEDULED_INPUT
    from activities.recovery import RecoveryActivities
    from store.models import Status
    from workflows import patches


_Input = TypeVar("_Input", bound=BaseModel)


def _validated(model: type[_Input], payload: Any) -> _Input:
    """A scheduled workflow's input, typed loosely and validated here: one that does not decode (a start by hand,
    from the UI or the CLI) would otherwise fail the workflow task again and again, and the run never end. It fails
    the run at once instead, having done nothing. A schedule's own input always validates: no command changes."""
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise ApplicationError(f"invalid {model.__name__}, nothing done: {validation_problems(exc, 'input')}",
                               type=INVALID_SCHEDULED_INPUT, non_retryable=True) from None


class _StepOptions(TypedDict):
    start_to_close_timeout: timedelta
    retry_policy: RetryPolicy


class _BoundedStepOptions(_StepOptions):
    schedule_to_close_timeout: timedelta


# Recovery's, the sweeper's and the partner sweep's steps may be taken by any worker on the shared queue, one cut
# off from PostgreSQL too: there a step fails within 2 s, and at once while PostgreSQL stays silent to that worker
# (activities/recovery.py), and is tried again by whichever worker polls first, about a second later (Temporal fires
# retries on a one-second tick). A cut-off worker that also runs the recovery workflow gets each step's first try
# too (eager dispatch): it took some 70 % of the tries in tests/workflows/test_recovery_partitions.py. All twenty-five
# tries land on it about once in 7,000 even so (once in 30 million at half), and they take some 25 s: inside one
# recovery interval (30 s), so a run that could not act has failed, saying so, before the next is due. Bounded in
# total: twenty-five tries, and schedule-to-close.
_ELSEWHERE_SOON = RetryPolicy(initial_interval=timedelta(seconds=0.5), backoff_coefficient=1.0, maximum_attempts=25)
# On PostgreSQL alone: a few bounded statements (docs/database.md), or a sweep's batches of them.
_DB_STEP = _BoundedStepOptions(
    start_to_close_timeout=timedelta(seconds=30),
    schedule_to_close_timeout=timedelta(seconds=120),
    retry_policy=_ELSEWHERE_SOON,
)
# At a partner too (a Delivering attempt's final name, a temporary directory): its own bounds
# (activities/partner_files.py) and a little more.
_PARTNER_STEP = _BoundedStepOptions(
    start_to_close_timeout=timedelta(seconds=60),
    schedule_to_close_timeout=timedelta(seconds=300),
    retry_policy=_ELSEWHERE_SOON,
)


# A look reads the partner's file back whole: its own bound (activities/partner_files.py) and a little more.
_LOOK = _StepOptions(
    start_to_close_timeout=timedelta(seconds=180),
    retry_policy=RetryPolicy(maximum_attempts=2, initial_interval=timedelta(seconds=1)),
)
# Looks at once: each is a session at a partner, and partners cap their sessions.
_LOOKS_AT_ONCE = 4

# Takeovers of one batch in flight at once: each is its own conditional statement on its own row.
_TAKEOVERS_AT_ONCE = 10


@workflow.defn
class RecoveryWorkflow:
    @workflow.run
    async def run(self, payload: Any) -> RecoveryReport:
        request = _validated(RecoveryInput, payload)
        if not workflow.patched(patches.RECOVERY_ROUNDS):
            return await self._one_batch(request)
        # A batch at a time, nominating again after each, until one comes back short or changes nothing (what it
        # nominated moved on, or cannot be taken over now): a backlog clears in one run, and the run is bounded.
        nominated, taken = 0, []
        for _ in range(request.rounds):
            candidates = await self._nominate(request)
            nominated += len(candidates)
            batch: list[TakeoverOutput] = []
            for at in range(0, len(candidates), _TAKEOVERS_AT_ONCE):
                batch += await asyncio.gather(*(self._take_over(c) for c in candidates[at:at + _TAKEOVERS_AT_ONCE]))
            taken += batch
            if len(candidates) < request.limit or not any(t.recorded for t in batch):
                break
        return RecoveryReport(nominated=nominated, taken_over=taken)

    async def _one_batch(self, request: RecoveryInput) -> RecoveryReport:
        candidates = await self._nominate(request)
        taken = [await self._take_over(candidate) for candidate in candidates]
        return RecoveryReport(nominated=len(candidates), taken_over=taken)

    async def _nominate(self, request: RecoveryInput) -> list[Candidate]:
        return await workflow.execute_activity_method(
            RecoveryActivities.nominate_expired, request, summary="nominate expired leases", **_DB_STEP
        )

    async def _take_over(self, candidate: Candidate) -> TakeoverOutput:
        return await workflow.execute_activity_method(
            RecoveryActivities.take_over,
            candidate,
            summary=f"take over export {candidate.job_id}, {candidate.status.value}, "
                    f"attempt {candidate.attempt_count}",
            **(_PARTNER_STEP if candidate.status is Status.DELIVERING else _DB_STEP),
        )


@workflow.defn
class SweeperWorkflow:
    @workflow.run
    async def run(self, payload: Any) -> int:
        return await workflow.execute_activity_method(
            RecoveryActivities.sweep, _validated(SweepInput, payload),
            summary="republish queued jobs with old wake-ups", **_DB_STEP,
        )


@workflow.defn
class PartnerSweepWorkflow:
    """Each destination's temporary directory, one activity each, so one unreachable partner delays no other."""

    @workflow.run
    async def run(self) -> list[PartnerSweepOutput]:
        refs: list[DestinationRef] = await workflow.execute_activity_method(
            RecoveryActivities.list_destinations, summary="list destinations", **_DB_STEP
        )
        swept = []
        for ref in refs:
            swept.append(await workflow.execute_activity_method(
                RecoveryActivities.sweep_partner_temp_files, ref,
                summary=f"sweep temporary files at destination {ref.destination_id}", **_PARTNER_STEP,
            ))
        return swept


@workflow.defn
class EvidenceFollowUpWorkflow:
    """OutcomeUnknown exports looked at again, for a bounded time after they became so, each by its own activity:
    settled Completed only by proof of content, otherwise the finding is noted for operators (LV2)."""

    @workflow.run
    async def run(self, payload: Any) -> FollowUpReport:
        request = _validated(FollowUpInput, payload)
        candidates: list[FollowUpCandidate] = await workflow.execute_activity_method(
            RecoveryActivities.list_follow_ups, request, summary="list OutcomeUnknown exports to look at again",
            **_DB_STEP,
        )
        outputs: list[FollowUpOutput] = []
        for at in range(0, len(candidates), _LOOKS_AT_ONCE):
            outputs += await asyncio.gather(*(self._look(c) for c in candidates[at:at + _LOOKS_AT_ONCE]))
        return FollowUpReport(looked=len(outputs), confirmed=sum(o.concluded == "Completed" for o in outputs),
                              outputs=outputs)

    async def _look(self, candidate: FollowUpCandidate) -> FollowUpOutput:
        try:
            return await workflow.execute_activity_method(
                RecoveryActivities.follow_up, candidate,
                summary=f"look again at export {candidate.job_id} (look {candidate.looks + 1})", **_LOOK,
            )
        except ActivityError as exc:
            # One export's failed look (the database away past the retries) fails neither the run nor the
            # others' looks; the next run looks again.
            cause = str(exc.cause) if exc.cause is not None else exc.message
            return FollowUpOutput(job_id=candidate.job_id, concluded="Failed", finding=f"look failed: {cause}"[:500])
