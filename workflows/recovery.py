"""RecoveryWorkflow, SweeperWorkflow and PartnerSweepWorkflow, each started by a Temporal Schedule that never runs
two at once.

Recovery nominates expired attempts and takes each over with its own activity (one conditional statement per
case), so the UI shows what it did to which export. The sweeper republishes queued jobs whose wake-up is old.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import TypedDict

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from activities.contracts import (
        Candidate,
        DestinationRef,
        PartnerSweepOutput,
        RecoveryInput,
        RecoveryReport,
        SweepInput,
        TakeoverOutput,
    )
    from activities.recovery import RecoveryActivities
    from workflows import patches


class _StepOptions(TypedDict):
    start_to_close_timeout: timedelta
    retry_policy: RetryPolicy


_STEP = _StepOptions(
    start_to_close_timeout=timedelta(seconds=60),
    retry_policy=RetryPolicy(maximum_attempts=3, initial_interval=timedelta(seconds=1)),
)


# Takeovers of one batch in flight at once: each is its own conditional statement on its own row.
_TAKEOVERS_AT_ONCE = 10


@workflow.defn
class RecoveryWorkflow:
    @workflow.run
    async def run(self, request: RecoveryInput) -> RecoveryReport:
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
            RecoveryActivities.nominate_expired, request, summary="nominate expired leases", **_STEP
        )

    async def _take_over(self, candidate: Candidate) -> TakeoverOutput:
        return await workflow.execute_activity_method(
            RecoveryActivities.take_over,
            candidate,
            summary=f"take over export {candidate.job_id}, {candidate.status.value}, "
                    f"attempt {candidate.attempt_count}",
            **_STEP,
        )


@workflow.defn
class SweeperWorkflow:
    @workflow.run
    async def run(self, request: SweepInput) -> int:
        return await workflow.execute_activity_method(
            RecoveryActivities.sweep, request, summary="republish queued jobs with old wake-ups", **_STEP
        )


@workflow.defn
class PartnerSweepWorkflow:
    """Each destination's temporary directory, one activity each, so one unreachable partner delays no other."""

    @workflow.run
    async def run(self) -> list[PartnerSweepOutput]:
        refs: list[DestinationRef] = await workflow.execute_activity_method(
            RecoveryActivities.list_destinations, summary="list destinations", **_STEP
        )
        swept = []
        for ref in refs:
            swept.append(await workflow.execute_activity_method(
                RecoveryActivities.sweep_partner_temp_files, ref,
                summary=f"sweep temporary files at destination {ref.destination_id}", **_STEP,
            ))
        return swept
