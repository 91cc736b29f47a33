"""What crosses the boundary between a client and an export's workflow: the start's input, the result, the `cancel`
request and its answer, and the export's row as the workflow shows it.

Pure pydantic: the worker's workflow code imports this module too. A field added later has a default, so that
a payload written by an older client (or an older run's history) still validates. `schemas/` holds each model
as JSON Schema (`python -m exports_client.schemas`), for clients in other languages.
"""

from __future__ import annotations

import unicodedata
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any
from uuid import UUID

from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    WithJsonSchema,
)

# Keep in step with the text columns they end up in: a longer text is refused before anything is written.
MAX_NAME = 200
MAX_REASON = 2000


def _storable(text: str) -> str:
    """Text that a text column can hold and a terminal can show: no NUL (PostgreSQL refuses it), no other control
    character but tab and newline (ESC would reach an operator's terminal), and valid UTF-8."""
    if "\x00" in text:
        raise ValueError("must not contain a NUL byte")
    if any(unicodedata.category(c) == "Cc" and c not in "\t\n" for c in text):
        raise ValueError("must not contain control characters such as ESC")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid UTF-8 text") from None
    return text


def _not_blank(text: str) -> str:
    if not text.strip():
        raise ValueError("must not be blank")
    return text


# Text a person typed that ends up in a text column: storable, and bounded by the column's agreed length. A name
# says who (never blank); a reason may be left out; a text (evidence, why) is given and not blank.
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME), AfterValidator(_storable), AfterValidator(_not_blank)]
Reason = Annotated[str, Field(max_length=MAX_REASON), AfterValidator(_storable)]
Text = Annotated[str, Field(min_length=1, max_length=MAX_REASON), AfterValidator(_storable),
                 AfterValidator(_not_blank)]


def validation_problems(exc: ValidationError, whole: str = "value") -> str:
    """Every problem of a payload that did not validate, on one line: `field: message; ...` (`whole` names the
    payload itself). The client's refusals and the workflow's (a start, a cancel) say it the same way."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or whole}: {e['msg']}" for e in exc.errors())


def _bytes_from_hex(value: Any) -> Any:
    return bytes.fromhex(value) if isinstance(value, str) else value


# A SHA-256 digest: bytes in Python and in the database, hex in JSON (workflow histories, `exports show --json`).
Digest = Annotated[bytes, BeforeValidator(_bytes_from_hex), PlainSerializer(bytes.hex, when_used="json"),
                   WithJsonSchema({"type": "string", "pattern": "^[0-9a-f]{64}$"})]


class Status(StrEnum):
    QUEUED = "Queued"
    RUNNING = "Running"
    DELIVERING = "Delivering"
    CANCELED = "Canceled"
    REJECTED = "Rejected"
    STOPPED = "Stopped"
    FAILED = "Failed"
    COMPLETED = "Completed"
    OUTCOME_UNKNOWN = "OutcomeUnknown"

    @property
    def is_settled(self) -> bool:
        """A state that needs no attempt: the export workflow returns it."""
        return self not in (Status.QUEUED, Status.RUNNING, Status.DELIVERING)


class FailureCode(StrEnum):
    BUILD_FAILED = "BuildFailed"
    ATTEMPTS_EXHAUSTED = "AttemptsExhausted"
    NOT_DELIVERED = "NotDelivered"
    FINAL_NAME_OCCUPIED = "FinalNameOccupied"
    ORIGINAL_DELIVERED = "OriginalDelivered"


class CancellationOutcome(StrEnum):
    CANCELED_WHILE_QUEUED = "CanceledWhileQueued"
    STOP_REQUESTED = "StopRequested"
    STOP_ALREADY_REQUESTED = "StopAlreadyRequested"
    ALREADY_CANCELED = "AlreadyCanceled"
    ALREADY_ENDED = "AlreadyEnded"
    TOO_LATE = "TooLate"
    # Answers that record nothing.
    NOT_FOUND = "NotFound"
    REQUEST_ID_REUSED = "RequestIdReused"
    BUSY = "Busy"


class CreateExport(BaseModel):
    """What a platform team supplies to create an export; the workflow's first activity runs the creation."""

    job_id: UUID
    tenant_id: UUID
    destination_id: UUID
    created_by: Name
    delivery_key: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class ExportInput(BaseModel):
    """The export workflow's input. With `create`, the run creates the export first (a retry creates nothing
    twice); `create.job_id` must be `job_id`, and the workflow ID `export-<job_id>`."""

    job_id: UUID
    create: CreateExport | None = None


class ExportResult(BaseModel):
    """What the export workflow returns: the row's settled state."""

    job_id: UUID
    status: Status
    failure_reason: FailureCode | None = None


class Wake(BaseModel):
    """The `wake` signal: one outbox row, published by the dispatcher. Retries of a row reuse its message ID."""

    message_id: UUID


class CancelRequest(BaseModel):
    """The `cancel` signal's and Update's payload, from a client or typed by hand in the Temporal UI or CLI, e.g.
    {"request_id": "…", "tenant": "…", "operator": "ann@example.com", "reason": "wrong list"}. The same request ID
    sent again is one request; a new request needs a new ID."""

    request_id: UUID
    tenant_id: UUID = Field(validation_alias=AliasChoices("tenant_id", "tenant"))
    requested_by: Name = Field(validation_alias=AliasChoices("requested_by", "operator"))
    reason: Reason | None = None


class CancellationResult(BaseModel):
    """A cancellation request's recorded answer (the `cancel` Update returns it)."""

    request_id: UUID
    outcome: CancellationOutcome
    job_id: UUID | None = None
    found_status: Status | None = None
    found_attempt_id: UUID | None = None
    found_attempt_count: int | None = None

    @property
    def recorded(self) -> bool:
        return self.outcome not in (
            CancellationOutcome.NOT_FOUND,
            CancellationOutcome.REQUEST_ID_REUSED,
            CancellationOutcome.BUSY,
        )


class JobRow(BaseModel):
    """The export_jobs row as read; the workflow's `row` query returns the last one it read."""

    model_config = ConfigDict(frozen=True)

    id: UUID
    tenant_id: UUID
    status: Status
    version: int
    destination_id: UUID
    attempt_id: UUID | None = None
    attempt_count: int = 0
    claimed_by: str | None = None
    lease_expires_at: datetime | None = None
    stop_request_id: UUID | None = None
    cancellation_request_id: UUID | None = None
    expected_file_name: str | None = None
    expected_file_bytes: int | None = None
    expected_file_sha256: Digest | None = None
    delivery_authorized_at: datetime | None = None
    woken_at: datetime
    failure_reason: FailureCode | None = None
    delivery_key: str
    replaces_job_id: UUID | None = None
    created_by: str
    replacement_reason: str | None = None
    overwrite_agreement_ref: str | None = None
    sweep_count: int = 0
    # How a Completed was confirmed: sha256, acknowledgment, size, reconciliation or correction.
    confirmed_by: str | None = None
    # Why policy refused it (Rejected only).
    rejection_reason: str | None = None
    # The partner-facing name, written at creation (with the tenant in it) and copied by replacements. None only in a
    # row that a run of 0.1.0 recorded, before the column existed: the build then reads the row's own.
    final_name: str | None = None
    # The attempt's rename fence (migration 0010): open from cutoff 2, passed right before its rename; None before
    # cutoff 2, after a take-back, and for an attempt authorized by 0.2.0 or recorded before the column existed.
    rename_fence: str | None = None
    # How many of its attempts their own worker handed back before the rename (migration 0013): they are not counted
    # toward the attempt cap, and have a cap of their own. 0 in a row recorded before the column existed.
    handed_back_count: int = 0
    # The attempt whose upload a run found unsettled and waits on (migration 0017): its terminal write wakes the run.
    run_waits_for: UUID | None = None
    # The last attempt whose hand-back was counted (migration 0018): recovery counts it under the hand-back cap only.
    handed_back_attempt: UUID | None = None
    # The attempt whose cutoff 2 its run gave up (migration 0022): cutoff 2 refuses it. Added in 0.3.0.
    cutoff_2_given_up: UUID | None = None
