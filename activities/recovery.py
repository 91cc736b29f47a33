"""Recovery's and the sweeper's activities: nominate expired attempts, take each over with its own conditional
statement, resolve Delivering attempts from destination evidence, and tell the export workflow what changed."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory

from activities import evidence, outcomes
from activities.contracts import (
    Candidate,
    DestinationRef,
    FollowUpCandidate,
    FollowUpInput,
    FollowUpOutput,
    PartnerSweepOutput,
    RecoveryInput,
    SweepInput,
    TakeoverOutput,
)
from activities.destination import DestinationConfig, PartnerContract
from activities.export_base import activity_methods
from activities.outcomes import FinalLook
from activities.partner_delivery import sweep_temp_files
from activities.partner_files import follow_up_look, look_at_final
from activities.process import metrics
from store import errors
from store.follow_up import FollowUp
from store.jobs import JobStore
from store.models import JobRow, Status
from store.recovery import RESOLVED, Recovery
from store.recovery import Candidate as StoreCandidate
from workflows.identity import EXPORT_STATUS, job_id_of

log = logging.getLogger(__name__)

# A recovery run's rounds nominate one after another: its look for runs that closed early is made once.
_VIEW_CHECK_GAP_SECONDS = 1.0
# That look lists runs until it has found `limit` that are their export's latest, reading at most this many times
# `limit`: a run that a later one replaced still matches its query for the whole view window.
_VIEW_LISTED_PER_LATEST = 10
# Runs found replaced by a later one, remembered so as not to ask about them again (at most this many).
_REPLACED_KEPT = 10_000

# A step of recovery, the sweeper or the partner sweep on a worker that PostgreSQL does not answer fails within this
# bound, and its retry goes to whichever worker polls first (workflows/recovery.py): none waits on a cut-off worker.
ANSWER_WITHIN_SECONDS = 2.0
# From then on the worker leaves those steps to others at once (a retry that comes back to it costs a backoff, not
# another bound), and asks PostgreSQL again this often until it answers, for at most PROBE_FOR_SECONDS: after that
# the next step asks for itself.
PROBE_EVERY_SECONDS = 1.0
PROBE_FOR_SECONDS = 60.0
DATABASE_UNANSWERED = "DatabaseUnanswered"


class RecoveryActivities:
    def __init__(self, store: JobStore, recovery: Recovery, *, client: Client | None = None,
                 view_window_seconds: float = 86400.0) -> None:
        self.store = store
        self.recovery = recovery
        self._client = client
        self.view_window_seconds = view_window_seconds
        self._views_checked_at = -math.inf
        self._replaced_runs: dict[str, None] = {}  # run IDs a later run of their export replaced, oldest first
        self._unanswered: str | None = None  # why PostgreSQL does not answer this worker, while it does not
        self._probe: asyncio.Task[None] | None = None
        self.follow_ups = FollowUp(recovery.engine)

    def all(self) -> list[Any]:
        return activity_methods(self)

    async def _able_to_act(self) -> None:
        """Returns when PostgreSQL answers this worker; else fails the step at once, to be tried again by any
        worker. The step's last try says that its run could not act."""
        why = self._unanswered
        if why is None:
            why = await self._unanswered_why()
            if why is None:
                return
            if self._unanswered is None:  # not already found by a step alongside this one
                self._unanswered = why
                log.warning("%s: this worker leaves recovery's steps to other workers until it answers", why)
                self._probe = asyncio.create_task(self._probe_until_answered(), name="recovery-database-probe")
        info = activity.info()
        worker = (self._client or activity.client()).identity
        message = f"{info.activity_type} on worker {worker}: {why}; left to another worker"
        policy = info.retry_policy
        if policy is not None and policy.maximum_attempts and info.attempt >= policy.maximum_attempts:
            log.error("%s %s could not act: %s, at its last try (%d)", info.workflow_type, info.workflow_id,
                      message, info.attempt)
            raise ApplicationError(message, type=DATABASE_UNANSWERED)
        log.info("%s (try %d of %s)", message, info.attempt, info.workflow_id)
        # Benign: the SDK logs it at debug only, and counts no failure; the run goes on.
        raise ApplicationError(message, type=DATABASE_UNANSWERED, category=ApplicationErrorCategory.BENIGN)

    async def _unanswered_why(self) -> str | None:
        """None when PostgreSQL answers this worker within the bound; else why not, in a few words."""
        try:
            async with asyncio.timeout(ANSWER_WITHIN_SECONDS):
                await self.recovery.ping()
        except TimeoutError:
            return f"PostgreSQL did not answer within {ANSWER_WITHIN_SECONDS:g} s"
        except Exception as exc:
            return f"PostgreSQL could not be reached: {errors.describe(exc)}"
        return None

    async def _probe_until_answered(self) -> None:
        deadline = time.monotonic() + PROBE_FOR_SECONDS
        try:
            while time.monotonic() < deadline:
                await asyncio.sleep(PROBE_EVERY_SECONDS)
                if await self._unanswered_why() is None:
                    log.info("PostgreSQL answers this worker again: it takes recovery's steps again")
                    return
        finally:
            self._unanswered = None  # answered, or past the probe's bound: the next step asks for itself

    @activity.defn
    async def nominate_expired(self, request: RecoveryInput) -> list[Candidate]:
        await self._able_to_act()
        found = await self.recovery.nominate(request.limit)
        await self._wake_runs_closed_early(limit=request.limit)
        return [Candidate(job_id=c.job_id, attempt_id=c.attempt_id, status=c.status,
                          stop_request_id=c.stop_request_id, attempt_count=c.attempt_count,
                          handed_back_count=c.handed_back_count) for c in found]

    async def _wake_runs_closed_early(self, *, limit: int) -> None:
        """Exports whose latest run closed showing a state the row has not settled in (Queued, Running,
        Delivering, or none yet): terminated, say, with the row settled since by its upload or left Queued with
        nothing to drive it, or a second start that failed (it shows nothing) over a settled export. Each gets one
        wake-up through the outbox; the run it starts reads the row, so the result and the search attributes
        follow the row, and a queued export is claimed, within one recovery interval. Best effort: visibility
        that cannot be read is logged, and expired attempts are still nominated."""
        if time.monotonic() - self._views_checked_at < _VIEW_CHECK_GAP_SECONDS:
            return  # the rounds of one run nominate again at once: one look per run suffices
        self._views_checked_at = time.monotonic()
        since = datetime.now(UTC) - timedelta(seconds=self.view_window_seconds)
        # A run that continued as new always has a later one; a terminated one that recovery had replaced still
        # matches for the whole window: `limit` counts the latest runs found, not the runs listed (a batch of
        # replaced runs hid the rest for up to a day).
        query = (f"WorkflowType = 'ExportWorkflow' AND ExecutionStatus != 'Running' AND "
                 f"ExecutionStatus != 'ContinuedAsNew' AND "
                 f"({EXPORT_STATUS.name} IN ('Queued', 'Running', 'Delivering') OR {EXPORT_STATUS.name} IS NULL) AND "
                 f"CloseTime > '{since.strftime('%Y-%m-%dT%H:%M:%SZ')}'")
        woken = latest_found = 0
        try:
            client = self._client or activity.client()
            async for found in client.list_workflows(query, limit=limit * _VIEW_LISTED_PER_LATEST,
                                                     page_size=min(limit * 2, 1000)):
                job_id = job_id_of(found.id)
                if job_id is None or found.run_id in self._replaced_runs:
                    continue
                latest = await client.get_workflow_handle(found.id).describe()
                if latest.run_id != found.run_id:
                    self._remember_replaced(found.run_id)
                    continue  # a later run tells
                latest_found += 1
                if await self.recovery.wake_behind_run(uuid.UUID(job_id)):
                    woken += 1
                    log.info("export %s: its last run (%s) closed showing %s; woken to read its row", job_id,
                             found.status.name if found.status else "?",
                             found.typed_search_attributes.get(EXPORT_STATUS))
                if latest_found >= limit:
                    break
        except Exception as exc:
            log.warning("recovery could not look for exports whose last run closed early: %s",
                        errors.describe(exc))
        metrics.VIEWS_BEHIND.inc(woken)

    def _remember_replaced(self, run_id: str) -> None:
        self._replaced_runs[run_id] = None
        if len(self._replaced_runs) > _REPLACED_KEPT:
            del self._replaced_runs[next(iter(self._replaced_runs))]

    @activity.defn
    async def take_over(self, candidate: Candidate) -> TakeoverOutput:
        # Started by RecoveryWorkflow only, so it always has the run's ID (None is for a standalone activity).
        run_id = cast(str, activity.info().workflow_run_id)
        await self._able_to_act()
        try:
            nominated = StoreCandidate(**candidate.model_dump())
            if candidate.status is Status.RUNNING:
                recorded, detail = await self.recovery.take_over_running(nominated, run_id), ""
            else:
                # An attempt that never passed its rename fence never renamed and now never will: round again.
                recorded, detail = await self.recovery.take_back_before_rename(nominated, run_id), \
                    "(its rename fence was still open)"
                if recorded is None:
                    recorded, detail = await self._resolve_delivering(candidate, run_id)
        except Exception as exc:
            if errors.is_transient(exc):
                raise  # retried by the run: the database is away for every candidate alike
            # One export's fault (a bug, a row no statement expected) fails neither the run nor the others'
            # takeovers; the next run nominates it again.
            log.error("recovery %s: takeover of %s attempt %s failed, left to the next run: %s", run_id,
                      candidate.job_id, candidate.attempt_id, errors.describe(exc))
            metrics.takeover("Failed")
            return TakeoverOutput(job_id=candidate.job_id, recorded=None,
                                  detail=f"takeover failed: {errors.describe(exc)}"[:500])
        metrics.takeover(recorded)
        if recorded is not None:
            # The statement also wrote an outbox row: the dispatcher wakes the export's workflow, or starts a run
            # if it has closed, so its result and search attributes follow the row.
            log.info("recovery %s: %s for %s attempt %s %s", run_id, recorded, candidate.job_id,
                     candidate.attempt_id, detail)
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
        judged_by = evidence.attempt_evidence(events, row.attempt_id)
        for line in judged_by.skipped:
            log.warning("recovery %s: export %s: %s", run_id, row.id, line)
            metrics.EVIDENCE_SKIPPED.labels(why="malformed").inc()
        resolution, summary, confirmed_by = evidence.judge(row, judged_by.records, look, contract)
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

    @activity.defn
    async def list_follow_ups(self, request: FollowUpInput) -> list[FollowUpCandidate]:
        await self._able_to_act()
        found = await self.follow_ups.pending(window_seconds=request.window_seconds, limit=request.limit)
        return [FollowUpCandidate(job_id=p.job_id, attempt_id=p.attempt_id, looks=p.looks) for p in found]

    @activity.defn
    async def follow_up(self, candidate: FollowUpCandidate) -> FollowUpOutput:
        """One look at an OutcomeUnknown export's partner: settled Completed by proof of content, or the finding
        noted for operators and the next run. A partner that cannot be reached is a finding too."""
        run_id = activity.info().workflow_run_id or "standalone"
        row = await self.store.read_job(candidate.job_id)
        if row is None or row.status is not Status.OUTCOME_UNKNOWN or row.attempt_id != candidate.attempt_id:
            return FollowUpOutput(job_id=candidate.job_id, concluded="Skipped", finding="moved on since the listing")
        destination = await self.store.read_destination(row.tenant_id, row.destination_id)
        if destination is None or row.expected_file_name is None:
            return await self._not_settled(row, "Unreachable", "no destination or no final name to look at")
        try:
            look = await follow_up_look(DestinationConfig.from_row(destination), row.expected_file_name)
        except Exception as exc:
            return await self._not_settled(row, "Unreachable", f"the partner could not be looked at: "
                                                               f"{outcomes.describe(exc)}")
        expected = row.expected_file_sha256.hex() if row.expected_file_sha256 else None
        verdict = outcomes.follow_up_verdict(look, final_name=row.expected_file_name, expected_sha256=expected)
        if verdict.confirmed_by not in ("sha256", "acknowledgment"):
            return await self._not_settled(row, "OutcomeUnknown", verdict.summary)
        observed = look.sha256 if verdict.confirmed_by == "sha256" else look.acknowledged_sha256
        await self.follow_ups.noted(row.id, row.attempt_id, verdict.summary)
        if not await self.follow_ups.confirm(row.id, row.attempt_id, final_name=row.expected_file_name,
                                             observed_sha256=cast(str, observed), proof=verdict.confirmed_by,
                                             detail=verdict.summary, run_id=run_id):
            return FollowUpOutput(job_id=row.id, concluded="Skipped", finding="moved on before it was settled")
        metrics.FOLLOW_UP_LOOKS.labels(concluded="Completed").inc()
        log.info("follow-up %s: export %s attempt %s settled Completed: %s", run_id, row.id, row.attempt_id,
                 verdict.summary)
        return FollowUpOutput(job_id=row.id, concluded="Completed", finding=verdict.summary)

    async def _not_settled(self, row: JobRow, concluded: str, finding: str) -> FollowUpOutput:
        await self.follow_ups.noted(row.id, cast(uuid.UUID, row.attempt_id), finding)
        metrics.FOLLOW_UP_LOOKS.labels(concluded=concluded).inc()
        return FollowUpOutput(job_id=row.id, concluded="OutcomeUnknown", finding=finding)

    @activity.defn
    async def sweep(self, request: SweepInput) -> int:
        await self._able_to_act()
        return metrics.swept("queued", await self.recovery.sweep_all(
            threshold_seconds=request.threshold_seconds, batch=request.batch))

    @activity.defn
    async def list_destinations(self) -> list[DestinationRef]:
        await self._able_to_act()
        return [DestinationRef(tenant_id=d["tenant_id"], destination_id=d["id"])
                for d in await self.store.read_destinations()]

    @activity.defn
    async def sweep_partner_temp_files(self, ref: DestinationRef) -> PartnerSweepOutput:
        """Our temporary files at one partner that are older than its contract allows, of attempts no longer
        Delivering: removed. A partner that cannot be reached is reported, and swept at the next run."""
        await self._able_to_act()
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
