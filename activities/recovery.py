"""Recovery's and the sweeper's activities: nominate expired attempts, take each over with its own conditional
statement, resolve Delivering attempts from destination evidence, and tell the export workflow what changed."""

from __future__ import annotations

import dataclasses
import logging
import uuid
from typing import Any, cast

from temporalio import activity
from temporalio.client import Client

from activities import evidence
from activities.contracts import (
    Candidate,
    DestinationRef,
    PartnerSweepOutput,
    RecoveryInput,
    SweepInput,
    TakeoverOutput,
    Wake,
)
from activities.destination import DestinationConfig, PartnerContract
from activities.export_base import activity_methods
from activities.outcomes import FinalLook
from activities.partner_delivery import sweep_temp_files
from activities.partner_files import look_at_final
from activities.process import metrics
from store.jobs import JobStore
from store.models import JobRow, Status
from store.recovery import RESOLVED, Recovery
from store.recovery import Candidate as StoreCandidate
from workflows.identity import export_workflow_id

log = logging.getLogger(__name__)


class RecoveryActivities:
    def __init__(self, store: JobStore, recovery: Recovery, *, client: Client | None = None) -> None:
        self.store = store
        self.recovery = recovery
        self._client = client

    def all(self) -> list[Any]:
        return activity_methods(self)

    @activity.defn
    async def nominate_expired(self, request: RecoveryInput) -> list[Candidate]:
        found = await self.recovery.nominate(request.limit)
        return [Candidate(job_id=c.job_id, attempt_id=c.attempt_id, status=c.status,
                          stop_request_id=c.stop_request_id, attempt_count=c.attempt_count) for c in found]

    @activity.defn
    async def take_over(self, candidate: Candidate) -> TakeoverOutput:
        # Started by RecoveryWorkflow only, so it always has the run's ID (None is for a standalone activity).
        run_id = cast(str, activity.info().workflow_run_id)
        if candidate.status is Status.RUNNING:
            recorded = await self.recovery.take_over_running(StoreCandidate(**candidate.model_dump()), run_id)
            detail = ""
        else:
            recorded, detail = await self._resolve_delivering(candidate, run_id)
        metrics.takeover(recorded)
        if recorded is not None:
            log.info("recovery %s: %s for %s attempt %s %s", run_id, recorded, candidate.job_id,
                     candidate.attempt_id, detail)
            await self._wake(candidate.job_id)
        return TakeoverOutput(job_id=candidate.job_id, recorded=recorded, detail=detail)

    async def _resolve_delivering(self, candidate: Candidate, run_id: str) -> tuple[str | None, str]:
        row = await self.store.read_job(candidate.job_id)
        if row is None or row.status is not Status.DELIVERING or row.attempt_id != candidate.attempt_id:
            return None, "moved on since the scan"
        events, _ = await self.store.history(row.id)
        destination = await self.store.read_destination(row.tenant_id, row.destination_id)
        config = DestinationConfig.from_row(destination) if destination is not None else None
        look = await self._look(row, config)
        contract = config.contract if config is not None else PartnerContract()
        resolution, summary, confirmed_by = evidence.judge(row, evidence.attempt_evidence(events, row.attempt_id),
                                                           look, contract)
        # Recovery's own look at the destination is evidence too; reconciliation reads it later.
        await self.store.append_evidence(row.id, row.attempt_id, f"recovery/{run_id}", {
            "step": "recovery_look", "final": dataclasses.asdict(look) if look else None,
            "resolution": resolution.value, "summary": summary})
        changed = await self.recovery.resolve(row.id, row.attempt_id, resolution, summary, run_id,
                                              confirmed_by=confirmed_by)
        return (RESOLVED if changed else None), summary

    async def _look(self, row: JobRow, config: DestinationConfig | None) -> FinalLook | None:
        if config is None or row.expected_file_name is None:
            return None
        try:
            return await look_at_final(config, row.expected_file_name)
        except Exception as exc:
            log.warning("recovery could not look at %s for %s: %s", row.expected_file_name, row.id, exc)
            return None

    async def _wake(self, job_id: uuid.UUID) -> None:
        """Tell the export's workflow to read its row again; the row, not this message, says what happened."""
        try:
            client = self._client or activity.client()
            await client.get_workflow_handle(export_workflow_id(job_id)).signal("wake", Wake(message_id=uuid.uuid4()))
        except Exception as exc:  # no running workflow: it will read the row when it next runs
            log.info("could not wake the workflow of %s: %s", job_id, exc)

    @activity.defn
    async def sweep(self, request: SweepInput) -> int:
        return metrics.swept("queued", await self.recovery.sweep_all(
            threshold_seconds=request.threshold_seconds, batch=request.batch))

    @activity.defn
    async def list_destinations(self) -> list[DestinationRef]:
        return [DestinationRef(tenant_id=d["tenant_id"], destination_id=d["id"])
                for d in await self.store.read_destinations()]

    @activity.defn
    async def sweep_partner_temp_files(self, ref: DestinationRef) -> PartnerSweepOutput:
        """Our temporary files at one partner that are older than its contract allows, of attempts no longer
        Delivering: removed. A partner that cannot be reached is reported, and swept at the next run."""
        row = await self.store.read_destination(ref.tenant_id, ref.destination_id)
        if row is None:
            return PartnerSweepOutput(destination_id=ref.destination_id, error="no such destination")
        try:
            found = await sweep_temp_files(
                DestinationConfig.from_row(row), is_live=self.store.attempt_delivering,
                is_ours=lambda name: self.store.final_name_in_use(ref.destination_id, name))
        except Exception as exc:
            log.warning("could not sweep the temporary files of destination %s: %s", ref.destination_id, exc)
            return PartnerSweepOutput(destination_id=ref.destination_id, error=f"{type(exc).__name__}: {exc}"[:300])
        metrics.swept("partner_temp_files", len(found["removed"]))
        for name in found["removed"]:
            log.info("removed %s from destination %s: older than its contract allows, its attempt ended",
                     name, ref.destination_id)
        for failure in found["failed"]:
            log.warning("could not remove a temporary file at destination %s: %s", ref.destination_id, failure)
        return PartnerSweepOutput(destination_id=ref.destination_id, **found)
