"""A typed client of the export workflows: start an export, wait for its result, cancel it, read its row.

It talks to Temporal only (the worker does the rest), so it needs only `temporalio` and `pydantic`. Every input
is validated before anything is sent: a refusal is an `InvalidRequest` with one sentence, and nothing is sent.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError
from temporalio.client import Client, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from exports_client.contracts import (
    CancellationOutcome,
    CancellationResult,
    CancelRequest,
    CreateExport,
    ExportInput,
    ExportResult,
    JobRow,
    validation_problems,
)
from exports_client.identity import DELIVERY_KEY, EXPORT_TENANT, export_workflow_id, tenant_priority

WORKFLOW_TYPE = "ExportWorkflow"
DEFAULT_TASK_QUEUE = "exports"
# The run's answer to a cancel Update it does not take yet (a release that only understands it): the signal
# carries the same request instead.
UPDATE_NOT_ACCEPTED = "CancelUpdateNotAccepted"
# The run's refusal of a cancel Update for another tenant: answered as the row answers it, NotFound.
UPDATE_EXPORT_NOT_FOUND = "CancelExportNotFound"


# The `row` query's answer: the SDK's type hint takes a class, the converter any type pydantic can validate.
_ROW_OR_NONE: Any = JobRow | None


class InvalidRequest(ValueError):
    """An input that does not validate; nothing was sent."""


async def _kept_run_is_this_export(handle: WorkflowHandle[Any, Any], create: CreateExport) -> None:
    """A start that found its workflow ID's run open kept that run: the same request sent again, or another
    tenant's (or another delivery key's) export under the same ID, which must not look started. What the open run
    shows says which: the tenant it was started for (its fairness key) and, once it read its row, its tenant and
    delivery key. A run that shows neither (started by hand, without a key) is taken as this request's."""
    # The start's own answer says whether it made the run (the SDK keeps it on the handle, not in its API); only a
    # run it did not make costs a look.
    response = getattr(handle, "_start_workflow_response", None)
    if response is not None and response.started:
        return
    kept = await handle.describe()
    shown = {kept.raw_description.workflow_execution_info.priority.fairness_key,
             kept.typed_search_attributes.get(EXPORT_TENANT)} - {"", None}
    key = kept.typed_search_attributes.get(DELIVERY_KEY)
    if shown - {str(create.tenant_id)} or (key is not None and key != create.delivery_key):
        raise InvalidRequest(f"export {create.job_id} is another export (another tenant's, or another delivery "
                             "key's), whose run is open: nothing started")


class ExportNotRunning(Exception):
    """The export has no open workflow run to take the request (it ended, or was never started)."""


class CancelRefused(Exception):
    """The run refused the cancellation request and recorded nothing; `reason` is its error type (for example
    `CancelRequestsWaiting`: send the same request again shortly)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class CancelAnswer:
    """What became of a cancellation request. Sent as an Update, `result` is the recorded outcome; sent as the
    signal (a run that takes no Update, or an Update the server refused or gave up), the run records it shortly
    and `result` is None: `describe` then shows the row's state, and the Temporal UI the request's answer."""

    request_id: uuid.UUID
    sent_as: Literal["update", "signal"]
    result: CancellationResult | None


def _uuid(value: str | uuid.UUID, what: str) -> uuid.UUID:
    if isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(str(value).strip())
    except ValueError:
        raise InvalidRequest(f"{what} is not a UUID: {str(value)[:60]!r}") from None


def _pydantic_client(client: Client) -> Client:
    """The same connection, with the data converter the contracts need (a client made with Temporal's default
    converter would hand back dicts, not models)."""
    if client.data_converter is pydantic_data_converter:
        return client
    config = client.config()
    config["data_converter"] = pydantic_data_converter
    return Client(**config)


class ExportsWorkflowClient:
    """Start, await, cancel and describe exports through their workflows (`export-<job id>`)."""

    def __init__(self, client: Client, *, task_queue: str = DEFAULT_TASK_QUEUE) -> None:
        self.client = _pydantic_client(client)
        self.task_queue = task_queue

    @classmethod
    async def connect(cls, target_host: str, *, namespace: str = "default", task_queue: str = DEFAULT_TASK_QUEUE,
                      **connect_options: Any) -> ExportsWorkflowClient:
        """`Client.connect` with the contracts' data converter; other options (tls, api_key, ...) pass through."""
        client = await Client.connect(target_host, namespace=namespace, data_converter=pydantic_data_converter,
                                      **connect_options)
        return cls(client, task_queue=task_queue)

    def handle(self, job_id: str | uuid.UUID) -> WorkflowHandle[Any, ExportResult]:
        """The export's workflow, its latest run."""
        return self.client.get_workflow_handle(export_workflow_id(_uuid(job_id, "job ID")), result_type=ExportResult)

    async def start(self, *, tenant_id: str | uuid.UUID, destination_id: str | uuid.UUID, created_by: str,
                    delivery_key: str | None = None, job_id: str | uuid.UUID | None = None) -> uuid.UUID:
        """Starts the export's workflow, whose first step creates the export; its ID. Sent again with the same job
        ID while the run is open, it starts nothing twice (the open run is kept). Without a delivery key, a new
        one: the partner-facing name is then new too."""
        try:
            create = CreateExport(
                job_id=_uuid(job_id, "job ID") if job_id is not None else uuid.uuid4(),
                tenant_id=_uuid(tenant_id, "tenant ID"),
                destination_id=_uuid(destination_id, "destination ID"),
                created_by=created_by,
                delivery_key=delivery_key if delivery_key is not None else uuid.uuid4().hex,
            )
        except ValidationError as exc:
            raise InvalidRequest(f"export refused, nothing sent: {validation_problems(exc)}") from None
        handle = await self.client.start_workflow(
            WORKFLOW_TYPE,
            ExportInput(job_id=create.job_id, create=create),
            id=export_workflow_id(create.job_id),
            task_queue=self.task_queue,
            result_type=ExportResult,
            priority=tenant_priority(create.tenant_id),
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        )
        await _kept_run_is_this_export(handle, create)
        return create.job_id

    async def result(self, job_id: str | uuid.UUID) -> ExportResult:
        """Waits for the export to settle (across the workflow's continued runs) and returns its state."""
        return await self.handle(job_id).result()

    async def describe(self, job_id: str | uuid.UUID) -> JobRow | None:
        """The export's row as its workflow last read it (None before the run's first read)."""
        try:
            row = await self.handle(job_id).query("row", result_type=_ROW_OR_NONE)
        except RPCError as exc:
            if exc.status is RPCStatusCode.NOT_FOUND:
                raise ExportNotRunning(f"export {job_id} has no workflow") from None
            raise
        return row if isinstance(row, JobRow) else None

    def _cancel_request(self, tenant_id: str | uuid.UUID, requested_by: str, reason: str | None,
                        request_id: str | uuid.UUID | None) -> CancelRequest:
        try:
            return CancelRequest(
                request_id=_uuid(request_id, "request ID") if request_id is not None else uuid.uuid4(),
                tenant_id=_uuid(tenant_id, "tenant ID"),
                requested_by=requested_by,
                reason=reason,
            )
        except ValidationError as exc:
            raise InvalidRequest(f"cancellation refused, nothing sent: {validation_problems(exc)}") from None

    async def cancel(self, job_id: str | uuid.UUID, *, tenant_id: str | uuid.UUID, requested_by: str,
                     reason: str | None = None, request_id: str | uuid.UUID | None = None) -> CancelAnswer:
        """Asks the export to stop: the `cancel` Update, answered with the recorded outcome; where the run does
        not take the Update yet, or the Update goes unanswered (refused by the server, as a flood of junk Updates
        can make it, or given up), the `cancel` signal with the same request, unanswered (`describe` reads the
        row). To retry, pass the same request ID: it is one request however often it arrives."""
        handle = self.handle(job_id)
        request = self._cancel_request(tenant_id, requested_by, reason, request_id)
        try:
            result = await handle.execute_update("cancel", request, result_type=CancellationResult)
        except WorkflowUpdateFailedError as exc:
            cause = exc.cause
            if isinstance(cause, ApplicationError) and cause.type == UPDATE_NOT_ACCEPTED:
                return await self._signal(handle, request)
            if isinstance(cause, ApplicationError) and cause.type == UPDATE_EXPORT_NOT_FOUND:
                return CancelAnswer(request_id=request.request_id, sent_as="update", result=CancellationResult(
                    request_id=request.request_id, outcome=CancellationOutcome.NOT_FOUND))
            if isinstance(cause, ApplicationError):
                raise CancelRefused(cause.type or "CancelRefused", cause.message) from None
            raise
        except RPCError as exc:
            if exc.status is RPCStatusCode.NOT_FOUND:
                raise ExportNotRunning(f"export {job_id} has no open workflow run to cancel") from None
            # The Update went unanswered: the server refused it (its cap on a run's Updates in flight, which junk
            # Updates can hold full; or on a run's Updates in all) or gave it up. Signals are not counted there,
            # and the run records one request ID once, whether it came by the Update, the signal or both.
            return await self._signal(handle, request)
        return CancelAnswer(request_id=request.request_id, sent_as="update", result=result)

    async def cancel_by_signal(self, job_id: str | uuid.UUID, *, tenant_id: str | uuid.UUID, requested_by: str,
                               reason: str | None = None, request_id: str | uuid.UUID | None = None) -> CancelAnswer:
        """The `cancel` signal alone (what the Temporal UI sends): recorded by the run shortly, unanswered."""
        return await self._signal(self.handle(job_id), self._cancel_request(tenant_id, requested_by, reason,
                                                                            request_id))

    async def _signal(self, handle: WorkflowHandle[Any, ExportResult], request: CancelRequest) -> CancelAnswer:
        try:
            await handle.signal("cancel", request)
        except RPCError as exc:
            if exc.status is RPCStatusCode.NOT_FOUND:
                raise ExportNotRunning(f"export {handle.id} has no open workflow run to cancel") from None
            raise
        return CancelAnswer(request_id=request.request_id, sent_as="signal", result=None)
