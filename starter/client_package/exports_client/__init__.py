"""The client of partner exports on Temporal: its contracts and a typed client of the export workflows."""

from exports_client.client import (
    CancelAnswer,
    CancelRefused,
    ExportNotRunning,
    ExportsWorkflowClient,
    InvalidRequest,
)
from exports_client.contracts import (
    CancellationOutcome,
    CancellationResult,
    CancelRequest,
    CreateExport,
    ExportInput,
    ExportResult,
    FailureCode,
    JobRow,
    Status,
)
from exports_client.identity import SEARCH_ATTRIBUTES, export_workflow_id

__all__ = [
    "SEARCH_ATTRIBUTES",
    "CancelAnswer",
    "CancelRefused",
    "CancelRequest",
    "CancellationOutcome",
    "CancellationResult",
    "CreateExport",
    "ExportInput",
    "ExportNotRunning",
    "ExportResult",
    "ExportsWorkflowClient",
    "FailureCode",
    "InvalidRequest",
    "JobRow",
    "Status",
    "export_workflow_id",
]
