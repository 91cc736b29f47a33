"""Domain values shared by the store, the activities, the workflows and the starter.

Pure pydantic: workflow code imports this module, so it must not import a database or network library.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any
from uuid import UUID

from pydantic import BaseModel, BeforeValidator, ConfigDict, PlainSerializer


def _bytes_from_hex(value: Any) -> Any:
    return bytes.fromhex(value) if isinstance(value, str) else value


# A SHA-256 digest: bytes in Python and in the database, hex in JSON (workflow histories, `exports show --json`).
Digest = Annotated[bytes, BeforeValidator(_bytes_from_hex), PlainSerializer(bytes.hex, when_used="json")]


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


class ClaimResult(StrEnum):
    CLAIMED = "Claimed"
    LOST = "Lost"
    UNKNOWN = "Unknown"


class AuthorizationResult(StrEnum):
    AUTHORIZED = "Authorized"
    STOP_RECORDED = "StopRecorded"
    LEASE_LAPSED = "LeaseLapsed"
    NOT_OWNER = "NotOwner"
    ORIGINAL_COMPLETED = "OriginalCompleted"
    UNKNOWN = "Unknown"


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


class JobRow(BaseModel):
    """The export_jobs row as read; the workflow's query returns the last one it read."""

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


class CancellationResult(BaseModel):
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


class BuiltFile(BaseModel):
    """A local file built for one attempt: what cutoff 2 records as the expected file."""

    path: str
    final_name: str
    size: int
    sha256_hex: str
    # The build that made it (the row's claimed_by while it holds the attempt): cutoff 2 authorizes only its file.
    holder: str | None = None
