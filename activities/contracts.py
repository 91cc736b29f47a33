"""Inputs and outputs of the export workflow, its signals and its activities: one model in, one model out.

Pure pydantic, because workflow code imports this module.
"""

from __future__ import annotations

from uuid import UUID

# The contracts a client sends and receives are the client package's; the worker imports them from there.
from exports_client.contracts import (
    MAX_NAME as MAX_NAME,
)
from exports_client.contracts import (
    MAX_REASON as MAX_REASON,
)
from exports_client.contracts import (
    CancelRequest as CancelRequest,
)
from exports_client.contracts import (
    CreateExport as CreateExport,
)
from exports_client.contracts import (
    ExportInput as ExportInput,
)
from exports_client.contracts import (
    ExportResult as ExportResult,
)
from exports_client.contracts import (
    Name as Name,
)
from exports_client.contracts import (
    Reason as Reason,
)
from exports_client.contracts import (
    Text as Text,
)
from exports_client.contracts import (
    Wake as Wake,
)
from pydantic import BaseModel, Field

from store.models import (
    AuthorizationResult,
    BuiltFile,
    CancellationResult,
    ClaimResult,
    FailureCode,
    JobRow,
    Status,
)

# The operator of a stop request made by Temporal's own cancel of an export workflow; the recording activity
# adds the identity Temporal recorded for the cancel.
TEMPORAL_CANCEL_OPERATOR = "temporal-cancel"


class Evaluation(BaseModel):
    """The row as read, and for a queued row the policy decision (a refused one is already written)."""

    row: JobRow | None
    allowed: bool = False
    reason: str = ""


class ClaimInput(BaseModel):
    job_id: UUID
    checked_version: int
    attempt_id: UUID


class ClaimOutput(BaseModel):
    result: ClaimResult
    # The claiming worker's own task queue: the build, cutoff 2 and the delivery of this attempt run there.
    worker_task_queue: str
    lease_seconds: float


class AdmitInput(BaseModel):
    job_id: UUID
    attempt_id: UUID  # the claim's, if the row is Queued and policy allows it
    # The attempt whose cutoff 2 the run gave up (Temporal's timeout), if it did: the read marks it, and cutoff 2
    # refuses it (run_waits_on_attempt.sql). Added in 0.3.0; a worker of 0.2.0 ignores it.
    given_up: UUID | None = None


class Admission(BaseModel):
    """Policy and the claim in one step: the row as read and the policy decision, then the claim if one was made."""

    evaluation: Evaluation
    claim: ClaimOutput | None = None
    attempt: int = 0  # the claimed attempt's number
    # How long the run waits for a wake-up before it reads the row again anyway (the worker's setting).
    idle_recheck_seconds: float = 300.0


class AttemptInput(BaseModel):
    job: JobRow
    attempt_id: UUID
    # How many times the attempt's build was resumed after its worker went quiet (0: the first build).
    resumption: int = 0


class BuildOutput(BaseModel):
    file: BuiltFile | None = None
    # The worker that holds the file: cutoff 2 and the delivery run on its task queue.
    worker_task_queue: str | None = None
    # Why there is no file, when there is none: Stopped, BuildFailed, LostOwnership, HandedBack (a worker
    # shutting down gave it back; the workflow resumes it elsewhere), StartedLate (a task Temporal had already
    # timed out, which changed nothing), or LeaseLapsing (no renewal answered: stopped before the lease lapsed,
    # for recovery to take the attempt over).
    ended: str | None = None


class AuthorizeInput(BaseModel):
    job: JobRow
    attempt_id: UUID
    file: BuiltFile


class AuthorizeOutput(BaseModel):
    result: AuthorizationResult


class DeliverInput(BaseModel):
    job: JobRow
    attempt_id: UUID
    file: BuiltFile


class DeliverOutput(BaseModel):
    # None when nothing was uploaded because the attempt could not confirm its lease first.
    outcome: Status | None = None
    failure_reason: FailureCode | None = None
    summary: str
    written: bool
    # The row as the terminal write left it, read back at once, so the workflow needs no step to re-read it; None
    # when nothing was written or the read failed (the workflow then reads the row itself).
    row: JobRow | None = None


class CancelOutput(BaseModel):
    result: CancellationResult


class CancelBatch(BaseModel):
    """Cancellation requests that waited together, recorded by one step (runs that accept the cancel Update)."""

    requests: list[CancelRequest] = Field(min_length=1, max_length=100)


class CancelBatchOutput(BaseModel):
    results: list[CancellationResult]  # one per request, in the batch's order


class RecoveryInput(BaseModel):
    limit: int = Field(default=100, ge=1)  # candidates per batch
    rounds: int = Field(default=10, ge=1, le=100)  # batches per run at most: 1,000 takeovers by default


class Candidate(BaseModel):
    """An attempt nominated by recovery's scan: a hint that each takeover re-checks."""

    job_id: UUID
    attempt_id: UUID
    status: Status
    stop_request_id: UUID | None = None
    attempt_count: int
    # Added in 0.3.0 (migration 0013): a candidate scheduled by an earlier release's run has none.
    handed_back_count: int = 0


class TakeoverOutput(BaseModel):
    job_id: UUID
    # The event recovery recorded (RequeuedByRecovery, StoppedByRecovery, AttemptsExhausted, ResolvedByRecovery),
    # or None when the takeover matched nothing (the attempt renewed, or moved on).
    recorded: str | None = None
    detail: str = ""


class RecoveryReport(BaseModel):
    nominated: int
    taken_over: list[TakeoverOutput]


class DestinationRef(BaseModel):
    tenant_id: UUID
    destination_id: UUID


class PartnerSweepOutput(BaseModel):
    """What a sweep of one partner's temporary directory did; `error` when it could not look."""

    destination_id: UUID
    removed: list[str] = []
    kept: list[str] = []
    failed: list[str] = []
    error: str | None = None


class SweepInput(BaseModel):
    threshold_seconds: float = Field(gt=0)
    batch: int = Field(default=500, ge=1)


class FollowUpInput(BaseModel):
    """One run of the evidence follow-up (LV2). Fields added later need defaults: schedules hold this input."""

    limit: int = Field(default=50, ge=1, le=1000)  # exports looked at per run
    window_seconds: float = Field(default=86400.0, gt=0)  # how long after becoming OutcomeUnknown one is looked at


class FollowUpCandidate(BaseModel):
    """An OutcomeUnknown export to look at again; the look reads its row for the rest."""

    job_id: UUID
    attempt_id: UUID
    looks: int = 0  # looks before this one


class FollowUpOutput(BaseModel):
    job_id: UUID
    # Completed (settled by proof), OutcomeUnknown (looked, not settled), Skipped (moved on), Failed (no look)
    concluded: str
    finding: str = ""


class FollowUpReport(BaseModel):
    looked: int
    confirmed: int
    outputs: list[FollowUpOutput]
