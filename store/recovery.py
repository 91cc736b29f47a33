"""Recovery of expired attempts (reference design, Recovery).

The scan only nominates. Each takeover is one conditional statement that repeats every condition the scan relied
on, the expired lease included, and records its event in the same statement; so a renewal that commits after the
scan makes the takeover match nothing, and a late cutoff 2 and a requeue cannot both commit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from sqlalchemy.ext.asyncio import AsyncEngine

from store import sweeper
from store.jobs import check_confirmation
from store.models import Status
from store.statements import RoleStore, Written, storable

log = logging.getLogger(__name__)

# The event each takeover records; take_over_running and take_back_before_rename return the one that committed.
REQUEUED = "RequeuedByRecovery"
STOPPED = "StoppedByRecovery"
RESOLVED = "ResolvedByRecovery"
EXHAUSTED = "AttemptsExhausted"
# How recovery_take_back.sql says an attempt it took back was lost (its event's detail), besides `lost alone` and
# `lost with its worker`.
LOST_AMID_OTHERS = "lost amid other workers' losses"
HANDED_BACK = "handed back by its worker"

_RESOLUTIONS = (Status.COMPLETED, Status.OUTCOME_UNKNOWN)


@dataclass(frozen=True)
class Candidate:
    """A nominated attempt, as the scan read it. A hint only: the takeover re-checks all of it."""

    job_id: UUID
    attempt_id: UUID
    status: Status
    stop_request_id: UUID | None
    attempt_count: int
    handed_back_count: int = 0


@dataclass(frozen=True)
class Loss:
    """How an expired attempt was lost (recovery_loss.sql)."""

    holder: str | None  # the worker that held it (its worker ID)
    with_its_worker: bool  # another attempt of that worker was lost with it: the worker was lost, not the export
    amid_others: bool = False  # a worker that never held the export was lost meanwhile: workers are being lost


class Recovery(RoleStore):
    """The scheduled backstops: recovery's takeovers and the sweeper. They run as the application role
    (EXPORTS_DATABASE_URL), on the worker's engine."""

    def __init__(self, engine: AsyncEngine, *, max_attempts: int, max_hand_backs: int = 10,
                 max_shared_losses: int = 10, max_losses_amid_others: int = 30, renew_seconds: float = 20.0,
                 together_seconds: float = 90.0,
                 on_ended: Callable[[Status], None] = lambda status: None) -> None:
        """`on_ended` hears every settled state a takeover wrote, as JobStore's does for the attempts' own.
        `max_attempts` caps the attempts lost alone, `max_shared_losses` those lost with their worker (the worker
        lost several attempts at once: recovery_loss.sql, with the workers' renewal interval `renew_seconds`, and
        `together_seconds`, how long after one loss of a worker another still counts as lost with it: a lease and
        a recovery interval), `max_losses_amid_others` those lost while a worker that never held the export was
        lost too (in the same window), `max_hand_backs` those handed back by their own worker."""
        if min(max_attempts, max_hand_backs, max_shared_losses, max_losses_amid_others) < 1:
            raise ValueError("max_attempts, max_hand_backs, max_shared_losses and max_losses_amid_others must be at "
                             "least 1")
        super().__init__(engine)
        self.max_attempts = max_attempts
        self.max_hand_backs = max_hand_backs
        self.max_shared_losses = max_shared_losses
        self.max_losses_amid_others = max_losses_amid_others
        self.renew_seconds = renew_seconds
        self.together_seconds = together_seconds
        self.on_ended = on_ended

    async def nominate(self, limit: int) -> list[Candidate]:
        """Running and Delivering attempts whose lease has expired, oldest lease first."""
        rows = await self.db.rows("recovery_nominate", limit=limit)
        return [
            Candidate(
                job_id=row["id"],
                attempt_id=row["attempt_id"],
                status=Status(row["status"]),
                stop_request_id=row["stop_request_id"],
                attempt_count=row["attempt_count"],
                handed_back_count=row["handed_back_count"],
            )
            for row in rows
        ]

    async def loss(self, job_id: UUID, attempt_id: UUID) -> Loss:
        """How the expired attempt was lost (recovery_loss.sql): with its worker or alone, amid other workers'
        losses or not, and by whom."""
        row = await self.db.row("recovery_loss", job_id=job_id, attempt_id=attempt_id,
                                renew_seconds=self.renew_seconds, together_seconds=self.together_seconds)
        if row is None:  # moved on since the scan, or never claimed: the takeover will match nothing
            return Loss(None, False)
        return Loss(row["holder"], row["with_its_worker"], row["amid_others"])

    async def take_back(self, job_id: UUID, attempt_id: UUID, recovery_run_id: str | UUID,
                        loss: Loss | None = None) -> str | None:
        """Running (or Delivering, its rename fence open) -> Queued with RequeuedByRecovery and a new outbox row, or
        at a cap -> Failed/AttemptsExhausted with its event (recovery_take_back.sql, which counts the caps): the
        event kind it recorded, None if it matched nothing. `loss` as `loss()` read it (read now if not given)."""
        loss = loss or await self.loss(job_id, attempt_id)
        row = await self.db.write_row(
            "recovery_take_back", job_id=job_id, expired_attempt_id=attempt_id, recovery_run_id=str(recovery_run_id),
            max_attempts=self.max_attempts, max_hand_backs=self.max_hand_backs,
            max_shared_losses=self.max_shared_losses, max_losses_amid_others=self.max_losses_amid_others,
            with_its_worker=loss.with_its_worker, amid_others=loss.amid_others, lost_by=loss.holder)
        if row is None:
            return None
        if row["kind"] == EXHAUSTED:
            self.on_ended(Status.FAILED)
        return str(row["kind"])

    async def stop(self, job_id: UUID, attempt_id: UUID, recovery_run_id: str | UUID) -> bool:
        """Running with a recorded stop request -> Stopped, with StoppedByRecovery."""
        return await self._takeover(
            "recovery_stop", Status.STOPPED,
            job_id=job_id,
            expired_attempt_id=attempt_id,
            recovery_run_id=str(recovery_run_id),
        )

    async def resolve(
        self,
        job_id: UUID,
        attempt_id: UUID,
        resolution: Status,
        evidence_summary: str,
        recovery_run_id: str | UUID,
        *,
        confirmed_by: str | None = None,
    ) -> bool:
        """Delivering -> Completed or OutcomeUnknown, with ResolvedByRecovery. The caller weighs the evidence;
        Completed only when it matches the expected file, saying what confirmed it (sha256, acknowledgment,
        size)."""
        if resolution not in _RESOLUTIONS:
            # The statement refuses it too; failing here says why instead of matching nothing.
            raise ValueError(f"recovery resolves only to Completed or OutcomeUnknown, not {resolution}")
        check_confirmation(resolution, confirmed_by)
        return await self._takeover(
            "recovery_resolve", resolution,
            job_id=job_id,
            expired_attempt_id=attempt_id,
            resolution=resolution.value,
            evidence_summary=storable(evidence_summary),
            recovery_run_id=str(recovery_run_id),
            confirmed_by=confirmed_by,
        )

    async def take_over_running(self, candidate: Candidate, recovery_run_id: str | UUID) -> str | None:
        """The takeover a Running candidate calls for; the event kind it recorded, or None if it matched
        nothing (renewed, finished, stopped or authorized since the scan). The choice is made from the scan, but
        each statement re-checks its own conditions, so a stale choice only matches nothing and the next run
        decides again."""
        if candidate.status is not Status.RUNNING:
            raise ValueError(f"export {candidate.job_id} was nominated {candidate.status}, not Running")
        return await self._take_back(candidate, recovery_run_id)

    async def take_back_before_rename(self, candidate: Candidate, recovery_run_id: str | UUID) -> str | None:
        """A Delivering candidate taken back as a Running one is (requeued, or exhausted at the cap) if its rename
        fence is still open (migration 0010): the event kind it recorded, or None if it matched nothing (the fence
        passed, renewed or finished since the scan), and the caller resolves it from evidence."""
        if candidate.status is not Status.DELIVERING:
            raise ValueError(f"export {candidate.job_id} was nominated {candidate.status}, not Delivering")
        return await self._take_back(candidate, recovery_run_id)

    async def _take_back(self, candidate: Candidate, recovery_run_id: str | UUID) -> str | None:
        if candidate.stop_request_id is not None:
            stopped = await self.stop(candidate.job_id, candidate.attempt_id, recovery_run_id)
            kind = STOPPED if stopped else None
        else:
            kind = await self.take_back(candidate.job_id, candidate.attempt_id, recovery_run_id)
        if kind is None:
            log.info("takeover of export %s attempt %s matched nothing", candidate.job_id, candidate.attempt_id)
            return None
        log.info("recovery %s took over export %s attempt %s: %s", recovery_run_id, candidate.job_id,
                 candidate.attempt_id, kind)
        return kind

    async def _takeover(self, name: str, settles: Status | None, **params: Any) -> bool:
        """One takeover statement; `settles` is the state it writes when that state ends the export."""
        written: Written[int] = await self.db.write(name, **params)  # no re-read: its count is always known
        changed = written.count
        if changed > 1:
            # Impossible: each statement names one job by its primary key.
            raise RuntimeError(f"{name} changed {changed} rows")
        if changed == 1 and settles is not None:
            self.on_ended(settles)
        return changed == 1

    async def wake_behind_run(self, job_id: UUID) -> bool:
        """An outbox row for an export whose last run closed before its row settled; False when one was already
        on its way (or there is no such export)."""
        return await self._takeover("wake_behind_run", None, job_id=job_id)

    # --- the sweeper -------------------------------------------------------------------------------------------

    async def sweep(self, *, threshold_seconds: float, batch: int) -> int:
        """One batch of fresh wake-ups for jobs Queued past the threshold; how many (store/sweeper.py)."""
        return await sweeper.sweep_batch(self.db, threshold_seconds=threshold_seconds, batch=batch)

    async def sweep_all(self, *, threshold_seconds: float, batch: int, max_batches: int = 1000) -> int:
        """Batches until one comes back short, at most max_batches; how many jobs were woken."""
        return await sweeper.sweep_batches(self.db, threshold_seconds=threshold_seconds, batch=batch,
                                           max_batches=max_batches)
