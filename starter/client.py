"""The client library: what platform teams and operators call, and what the `exports` command wraps.

Inputs are validated before anything is written; a refusal is an `InputError` with one clear sentence.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode

from activities.contracts import CancelRequest, CreateExport, ExportInput, ExportResult
from starter.temporal import workflow_id
from store import errors
from store.db import make_engine
from store.jobs import JobStore
from store.models import CancellationOutcome, CancellationResult, JobRow
from store.settings import Settings


class InputError(ValueError):
    """Bad input: nothing was written."""


def parse_id(value: str | uuid.UUID, what: str) -> uuid.UUID:
    if isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(value.strip())
    except (ValueError, AttributeError):
        raise InputError(f"{what} {value!r} is not a UUID") from None


def _validated(model: type, what: str, **values: Any):
    try:
        return model(**values)
    except ValidationError as exc:
        first = exc.errors()[0]
        field_name = ".".join(str(part) for part in first["loc"]) or what
        message = first["msg"]
        if first["type"] == "string_pattern_mismatch":
            message = "only letters, digits, '.', '_' and '-' are allowed, starting with a letter or digit"
        raise InputError(f"{what}: {field_name.replace('_', ' ')}: {message}") from None


@dataclass
class ExportView:
    row: JobRow
    events: list[dict[str, Any]] = field(default_factory=list)
    cancellation_requests: list[dict[str, Any]] = field(default_factory=list)


class ExportsClient:
    def __init__(self, store: JobStore, temporal: Client | None, *, task_queue: str = "exports") -> None:
        self.store = store
        self.temporal = temporal
        self.task_queue = task_queue

    @classmethod
    def from_settings(cls, settings: Settings, temporal: Client | None) -> ExportsClient:
        store = JobStore(
            make_engine(settings.database_url, pool_size=2),
            lease_seconds=settings.lease_seconds,
            lock_timeout_ms=settings.lock_timeout_ms,
            reread_timeout_seconds=settings.reread_timeout_seconds,
        )
        return cls(store, temporal, task_queue=settings.task_queue)

    async def close(self) -> None:
        await self.store.engine.dispose()

    async def create(
        self,
        *,
        tenant_id: str | uuid.UUID,
        destination_id: str | uuid.UUID,
        created_by: str,
        delivery_key: str | None = None,
        job_id: str | uuid.UUID | None = None,
    ) -> uuid.UUID:
        """Creates the export row with its wake-up; the dispatcher starts its workflow."""
        request = self._creation(tenant_id, destination_id, created_by, delivery_key, job_id)
        try:
            await self.store.create_job(**request.model_dump())
        except errors.ConstraintViolation as exc:
            raise InputError(str(exc)) from None
        return request.job_id

    async def start(
        self,
        *,
        tenant_id: str | uuid.UUID,
        destination_id: str | uuid.UUID,
        created_by: str,
        delivery_key: str | None = None,
        job_id: str | uuid.UUID | None = None,
    ) -> WorkflowHandle[Any, ExportResult]:
        """What a platform team does with a plain Temporal client: start the workflow, which creates the row."""
        request = self._creation(tenant_id, destination_id, created_by, delivery_key, job_id)
        return await self._temporal().start_workflow(
            "ExportWorkflow",
            ExportInput(job_id=request.job_id, create=request),
            id=workflow_id(request.job_id),
            task_queue=self.task_queue,
            result_type=ExportResult,
        )

    def _creation(self, tenant_id, destination_id, created_by, delivery_key, job_id) -> CreateExport:
        job = parse_id(job_id, "job ID") if job_id is not None else uuid.uuid4()
        return _validated(
            CreateExport,
            "export",
            job_id=job,
            tenant_id=parse_id(tenant_id, "tenant ID"),
            destination_id=parse_id(destination_id, "destination ID"),
            created_by=created_by,
            delivery_key=delivery_key if delivery_key is not None else uuid.uuid4().hex,
        )

    async def cancel(
        self,
        *,
        tenant_id: str | uuid.UUID,
        job_id: str | uuid.UUID,
        requested_by: str,
        reason: str | None = None,
        request_id: str | uuid.UUID | None = None,
    ) -> CancellationResult:
        """The row write under the row lock, then the `cancel` signal so a building attempt stops at once.
        Retry a Busy answer with the same request ID."""
        job = parse_id(job_id, "job ID")
        request = _validated(
            CancelRequest,
            "cancellation",
            request_id=parse_id(request_id, "request ID") if request_id is not None else uuid.uuid4(),
            tenant_id=parse_id(tenant_id, "tenant ID"),
            requested_by=requested_by,
            reason=reason,
        )
        result = await self.store.request_cancellation(job_id=job, **request.model_dump())
        if result.recorded and self.temporal is not None and result.outcome in (
            CancellationOutcome.STOP_REQUESTED,
            CancellationOutcome.CANCELED_WHILE_QUEUED,
        ):
            try:
                await self.temporal.get_workflow_handle(workflow_id(job)).signal("cancel", request)
            except RPCError as exc:
                # The row is the authority: a workflow that is not running finds the outcome when it next reads.
                if exc.status is not RPCStatusCode.NOT_FOUND:
                    raise
        return result

    async def show(self, job_id: str | uuid.UUID, *, tenant_id: str | uuid.UUID | None = None) -> ExportView:
        job = parse_id(job_id, "job ID")
        tenant = parse_id(tenant_id, "tenant ID") if tenant_id is not None else None
        row = await self.store.read_job(job, tenant_id=tenant)
        if row is None:
            raise InputError(f"export {job} not found" + (f" for tenant {tenant}" if tenant else ""))
        events, requests = await self.store.history(job)
        return ExportView(row=row, events=events, cancellation_requests=requests)

    def _temporal(self) -> Client:
        if self.temporal is None:
            raise RuntimeError("this call needs a Temporal client")
        return self.temporal
