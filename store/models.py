"""Domain values shared by the store, the activities, the workflows and the starter.

Pure pydantic: workflow code imports this module, so it must not import a database or network library.
"""

from __future__ import annotations

from enum import StrEnum

# The values a client sees are the client package's: one definition, which the worker imports.
from exports_client.contracts import (
    CancellationOutcome as CancellationOutcome,
)
from exports_client.contracts import (
    CancellationResult as CancellationResult,
)
from exports_client.contracts import (
    Digest as Digest,
)
from exports_client.contracts import (
    FailureCode as FailureCode,
)
from exports_client.contracts import (
    JobRow as JobRow,
)
from exports_client.contracts import (
    Status as Status,
)
from pydantic import BaseModel


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


class BuiltFile(BaseModel):
    """A local file built for one attempt: what cutoff 2 records as the expected file."""

    path: str
    final_name: str
    size: int
    sha256_hex: str
    # The build that made it (the row's claimed_by while it holds the attempt): cutoff 2 authorizes only its file.
    holder: str | None = None
