"""The ApplicationError types that the export's activities and workflows raise, each named once: what a client, a
test or an operator reading a history matches a failure on. Imports only temporalio, so a workflow imports it as
it is, in the sandbox too. A type is what a failure says, never what a workflow decides on: adding one leaves the
commands of recorded runs as they were."""

from __future__ import annotations

from temporalio.exceptions import ApplicationError

# The start's input does not validate, its workflow ID is not `export-<job id>`, or `create.job_id` differs from
# `job_id`: the run fails at once, before anything is written.
INVALID_EXPORT_INPUT = "InvalidExportInput"
# A scheduled workflow (recovery, the sweeper, the evidence follow-up) started, by hand, with an input that does
# not validate: the run fails at once, having done nothing.
INVALID_SCHEDULED_INPUT = "InvalidScheduledInput"
# The creation step found the export ID taken by another export (another tenant's, or another delivery key).
EXPORT_ID_TAKEN = "ExportIdTaken"
# The run's creation step failed: this run created no export.
EXPORT_NOT_CREATED = "ExportNotCreated"
# The run read no row for its job ID.
EXPORT_NOT_FOUND = "ExportNotFound"
# A claim that waited its bound for its destination's share of the worker (LD4), or whose worker began shutting
# down meanwhile: nothing was claimed, and Temporal schedules the claim again, on any worker.
DESTINATION_BUSY = "DestinationBusy"
# A claim that found this worker's build slots taken (by a claim that waited for its destination and went ahead
# of this one's poll): nothing was claimed, and Temporal schedules the claim again, on any worker.
WORKER_BUSY = "WorkerBusy"


def store_refusal(exc: BaseException, message: str) -> ApplicationError:
    """A definite refusal from the store (a constraint, invalid text, a privilege), typed by the refusal's class name
    (`ConstraintViolation`, `NotPermitted`, or the driver's own), and not retried: no retry could change it."""
    return ApplicationError(message, type=type(exc).__name__, non_retryable=True)
