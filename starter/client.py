"""The client library: what platform teams and operators call, and what the `exports` command wraps.

Inputs are validated before anything is written; a refusal is an `InputError` with one clear sentence.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from exports_client.client import ExportsWorkflowClient
from pydantic import BaseModel, Field, ValidationError
from sqlalchemy import event
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.pool import ConnectionPoolEntry
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode

from activities.contracts import CancelRequest, CreateExport, ExportResult, Name, Text
from activities.process.temporal import CONNECT_TIMEOUT_SECONDS, Unreachable
from store import errors
from store.db import make_engine
from store.follow_up import FollowUp
from store.jobs import JobStore
from store.models import CancellationResult, FailureCode, JobRow, Status
from store.reconciliation import Reconciliation
from store.settings import Settings
from store.statements import RoleStore
from workflows.identity import (
    DELIVERY_KEY,
    EXPORT_ATTEMPTS,
    EXPORT_STATUS,
    EXPORT_TENANT,
    export_workflow_id,
    job_id_of,
)

# What PostgreSQL's integer columns store (export_jobs.version).
INT4_MAX = 2**31 - 1


class CancellationText(BaseModel):
    requested_by: Name
    reason: Text | None = None


class ReplaceRequest(BaseModel):
    tenant_id: uuid.UUID
    original_job_id: uuid.UUID
    job_id: uuid.UUID
    created_by: Name
    replacement_reason: Text
    overwrite_agreement_ref: Name | None = None


class EditRequest(BaseModel):
    tenant_id: uuid.UUID
    job_id: uuid.UUID
    expected_version: int = Field(ge=1, le=INT4_MAX)
    destination_id: uuid.UUID


class ReconcileRequest(BaseModel):
    tenant_id: uuid.UUID
    job_id: uuid.UUID
    attempt_id: uuid.UUID
    resolution: Status
    reconciled_by: Name
    evidence_summary: Text


class CorrectRequest(BaseModel):
    tenant_id: uuid.UUID
    job_id: uuid.UUID
    attempt_id: uuid.UUID
    recorded_status: Status
    corrected_status: Status
    failure_reason: FailureCode | None = None
    corrected_by: Name
    evidence_ref: Text
    why: Text


class InputError(ValueError):
    """Bad input: nothing was written."""


class SignalNotSent(Exception):
    """The cancellation is recorded (the row decides), but its workflow could not be signalled; the same request
    ID signals it again."""

    def __init__(self, result: CancellationResult, error: RPCError) -> None:
        self.result, self.error = result, error
        super().__init__(f"{result.outcome.value} recorded (request {result.request_id}), but its workflow was not "
                         f"signalled: {error.message}")


def shown(value: object, limit: int = 60) -> str:
    """A value as an error message quotes it: its repr (control characters escaped), cut short."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "...(cut)"


def parse_id(value: str | uuid.UUID, what: str) -> uuid.UUID:
    if isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(value.strip())
    except (ValueError, AttributeError):
        raise InputError(f"{what} {shown(value)} is not a UUID") from None


def _attempt_ids(tenant_id: str | uuid.UUID, job_id: str | uuid.UUID,
                 attempt_id: str | uuid.UUID) -> dict[str, uuid.UUID]:
    return {
        "tenant_id": parse_id(tenant_id, "tenant ID"),
        "job_id": parse_id(job_id, "job ID"),
        "attempt_id": parse_id(attempt_id, "attempt ID"),
    }


Model = TypeVar("Model", bound=BaseModel)


def _validated(model: type[Model], what: str, **values: Any) -> Model:
    try:
        return model(**values)
    except ValidationError as exc:
        first = exc.errors()[0]
        field_name = ".".join(str(part) for part in first["loc"]) or what
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "string_pattern_mismatch":
            message = "only letters, digits, '.', '_' and '-' are allowed, starting with a letter or digit"
        elif first["type"] == "string_unicode":
            message = "must be valid UTF-8 text"
        raise InputError(f"{what}: {field_name.replace('_', ' ')}: {message}") from None


@dataclass
class ListedExport:
    """One export as Temporal's visibility (the UI's list) shows it."""

    job_id: uuid.UUID
    tenant_id: str
    status: str
    attempts: int
    delivery_key: str


@dataclass
class ExportView:
    row: JobRow
    events: list[dict[str, Any]] = field(default_factory=list)
    cancellation_requests: list[dict[str, Any]] = field(default_factory=list)


class ExportsClient:
    def __init__(
        self,
        store: JobStore,
        temporal: Client | None,
        *,
        task_queue: str = "exports",
        reconciliation_url: str = "",
    ) -> None:
        self.store = store
        self.temporal = temporal
        self.task_queue = task_queue
        self.reconciliation_url = reconciliation_url

    @classmethod
    def from_settings(cls, settings: Settings, temporal: Client | None) -> ExportsClient:
        """Every connection to PostgreSQL is bounded by CONNECT_TIMEOUT_SECONDS; a missing or unusable URL is
        `Unreachable`."""
        store = JobStore(
            database_engine(settings.database_url, "EXPORTS_DATABASE_URL", pool_size=2),
            lease_seconds=settings.lease_seconds,
            lock_timeout_ms=settings.lock_timeout_ms,
            reread_timeout_seconds=settings.reread_timeout_seconds,
        )
        return cls(
            store, temporal, task_queue=settings.task_queue, reconciliation_url=settings.reconciliation_database_url
        )

    async def close(self) -> None:
        await self.store.aclose()

    async def check_database(self) -> None:
        """One connection and `SELECT 1`: `Unreachable` if PostgreSQL cannot be reached; nothing is written."""
        await check_database(self.store, "EXPORTS_DATABASE_URL")

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
        """What a platform team does with a plain Temporal client (the client package's start): the workflow
        creates the row."""
        request = self._creation(tenant_id, destination_id, created_by, delivery_key, job_id)
        workflows = ExportsWorkflowClient(self._temporal(), task_queue=self.task_queue)
        await workflows.start(**request.model_dump())
        return workflows.handle(request.job_id)

    def _creation(self, tenant_id: str | uuid.UUID, destination_id: str | uuid.UUID, created_by: str,
                  delivery_key: str | None, job_id: str | uuid.UUID | None) -> CreateExport:
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
        _validated(CancellationText, "cancellation", requested_by=requested_by, reason=reason)
        request = _validated(
            CancelRequest,
            "cancellation",
            request_id=parse_id(request_id, "request ID") if request_id is not None else uuid.uuid4(),
            tenant_id=parse_id(tenant_id, "tenant ID"),
            requested_by=requested_by,
            reason=reason,
        )
        result = await self.store.request_cancellation(job_id=job, **request.model_dump())
        if result.recorded and self.temporal is not None:
            await self.signal_cancellation(job, request, result)
        return result

    async def signal_cancellation(self, job_id: uuid.UUID, request: CancelRequest,
                                  result: CancellationResult) -> None:
        """The `cancel` signal for a recorded request, whatever its answer: the workflow records the same request
        (one record per request ID), stops a build at once, and shows who asked, why and the answer. Best effort:
        the row, already written, decides."""
        if self.temporal is None:
            return
        try:
            await self.temporal.get_workflow_handle(export_workflow_id(job_id)).signal("cancel", request)
        except RPCError as exc:
            # A workflow that is not running finds the outcome when it next reads the row.
            if exc.status is not RPCStatusCode.NOT_FOUND:
                raise SignalNotSent(result, exc) from exc

    async def show(self, job_id: str | uuid.UUID, *, tenant_id: str | uuid.UUID | None = None) -> ExportView:
        """One export by its ID, or by a prefix of it that only one export has (as `make run` and tables show)."""
        tenant = parse_id(tenant_id, "tenant ID") if tenant_id is not None else None
        job = await self._resolve_prefix(job_id, tenant)
        row = await self.store.read_job(job, tenant_id=tenant)
        if row is None:
            raise InputError(f"export {job} not found" + (f" for tenant {tenant}" if tenant else ""))
        events, requests = await self.store.history(job)
        return ExportView(row=row, events=events, cancellation_requests=requests)

    async def _resolve_prefix(self, value: str | uuid.UUID, tenant: uuid.UUID | None) -> uuid.UUID:
        """The export an ID or an ID's prefix names, among `tenant`'s exports when given: another tenant's export
        looks like none at all."""
        if isinstance(value, uuid.UUID):
            return value
        digits = value.strip().replace("-", "").lower()
        if len(digits) == 32 or not (4 <= len(digits) < 32 and all(c in "0123456789abcdef" for c in digits)):
            return parse_id(value, "job ID")
        # A range on the primary key, so that a prefix costs an index lookup, not a scan.
        low, high = (uuid.UUID(digits + pad * (32 - len(digits))) for pad in "0f")
        found = await self.store.job_ids_between(low, high, limit=2, tenant_id=tenant)
        if not found:
            raise InputError(f"no export ID starts with {shown(value)}")
        if len(found) > 1:
            raise InputError(f"more than one export ID starts with {shown(value)}: give more of it")
        return found[0]

    async def replace(
        self,
        *,
        tenant_id: str | uuid.UUID,
        original_job_id: str | uuid.UUID,
        created_by: str,
        reason: str,
        overwrite_agreement_ref: str | None = None,
    ) -> uuid.UUID:
        """A replacement export for an original that did not deliver (or whose outcome is unknown): a new job
        carrying the original's delivery key. Naming a replacement resolves to its original."""
        request = _validated(
            ReplaceRequest,
            "replacement",
            tenant_id=parse_id(tenant_id, "tenant ID"),
            original_job_id=parse_id(original_job_id, "job ID"),
            job_id=uuid.uuid4(),
            created_by=created_by,
            replacement_reason=reason,
            overwrite_agreement_ref=overwrite_agreement_ref,
        )
        try:
            await self.store.create_replacement(**request.model_dump())
        except (errors.NotReplaceable, errors.ConstraintViolation) as exc:
            raise InputError(str(exc)) from None
        return request.job_id

    async def edit(
        self,
        *,
        tenant_id: str | uuid.UUID,
        job_id: str | uuid.UUID,
        expected_version: int,
        destination_id: str | uuid.UUID,
    ) -> bool:
        """Change a queued export's destination at the version the caller read. False: it started, ended, or
        was edited meanwhile; read it again."""
        request = _validated(
            EditRequest,
            "edit",
            tenant_id=parse_id(tenant_id, "tenant ID"),
            job_id=parse_id(job_id, "job ID"),
            expected_version=expected_version,
            destination_id=parse_id(destination_id, "destination ID"),
        )
        if await self.store.read_job(request.job_id, tenant_id=request.tenant_id) is None:
            raise InputError(f"export {request.job_id} not found for tenant {request.tenant_id}")
        try:
            return await self.store.edit_terms(**request.model_dump())
        except errors.ConstraintViolation as exc:
            raise InputError(str(exc)) from None

    async def reconcile(
        self,
        *,
        tenant_id: str | uuid.UUID,
        job_id: str | uuid.UUID,
        attempt_id: str | uuid.UUID,
        outcome: str,
        reconciled_by: str,
        evidence: str,
    ) -> bool:
        """Settle an OutcomeUnknown attempt once, as Completed or Failed (NotDelivered), from evidence."""
        if outcome not in (Status.COMPLETED, Status.FAILED):
            raise InputError(f"outcome {outcome!r} must be Completed or Failed")
        request = _validated(
            ReconcileRequest,
            "reconciliation",
            **_attempt_ids(tenant_id, job_id, attempt_id),
            resolution=outcome,
            reconciled_by=reconciled_by,
            evidence_summary=evidence,
        )
        async with self._reconciler() as reconciliation:
            return await self._done_or_not_found(reconciliation, request.tenant_id, request.job_id,
                                                 reconciliation.reconcile(**request.model_dump()))

    async def correct(
        self,
        *,
        tenant_id: str | uuid.UUID,
        job_id: str | uuid.UUID,
        attempt_id: str | uuid.UUID,
        recorded: str,
        corrected: str,
        failure_reason: str | None,
        corrected_by: str,
        evidence_ref: str,
        why: str,
    ) -> bool:
        """Change a recorded Completed or Failed once, under the reconciliation role, with who and why."""
        for status in (recorded, corrected):
            if status not in (Status.COMPLETED, Status.FAILED):
                raise InputError(f"status {status!r} must be Completed or Failed")
        if recorded == corrected:
            raise InputError(f"--from and --to are both {recorded}: a correction changes the recorded status")
        if (corrected == Status.FAILED) != (failure_reason is not None):
            raise InputError("a correction to Failed needs a failure reason, and only that one")
        if failure_reason is not None and failure_reason not in FailureCode.__members__.values():
            raise InputError(f"failure reason {failure_reason!r} is not one of {', '.join(FailureCode)}")
        request = _validated(
            CorrectRequest,
            "correction",
            **_attempt_ids(tenant_id, job_id, attempt_id),
            recorded_status=recorded,
            corrected_status=corrected,
            failure_reason=failure_reason,
            corrected_by=corrected_by,
            evidence_ref=evidence_ref,
            why=why,
        )
        async with self._reconciler() as reconciliation:
            try:
                return await self._done_or_not_found(reconciliation, request.tenant_id, request.job_id,
                                                     reconciliation.correct(**request.model_dump()))
            except errors.TransitionAlreadyRecorded:
                raise InputError("this attempt's outcome was already corrected once") from None

    @staticmethod
    async def _done_or_not_found(reconciliation: Reconciliation, tenant_id: uuid.UUID, job_id: uuid.UUID,
                                 write: Awaitable[bool]) -> bool:
        """A reconciliation's or correction's answer; InputError where the export is not the tenant's, which the
        write alone cannot tell from a row in another state."""
        if await write:
            return True
        if not await reconciliation.is_tenants(tenant_id, job_id):
            raise InputError(f"export {job_id} not found for tenant {tenant_id}")
        return False

    @asynccontextmanager
    async def _reconciler(self) -> AsyncIterator[Reconciliation]:
        setting = "EXPORTS_RECONCILIATION_DATABASE_URL"
        if not self.reconciliation_url:
            raise Unreachable("PostgreSQL", setting, "", "no URL for the reconciliation role configured")
        reconciliation = Reconciliation(database_engine(self.reconciliation_url, setting, pool_size=1))
        try:
            await check_database(reconciliation, setting)
            yield reconciliation
        finally:
            await reconciliation.aclose()

    async def follow_ups(self, *, window_seconds: float, tenant_id: str | uuid.UUID | None = None,
                         limit: int = 100) -> list[dict[str, Any]]:
        """The evidence follow-up's exports: pending, left for a person past the window, confirmed within it."""
        tenant = parse_id(tenant_id, "tenant ID") if tenant_id is not None else None
        return await FollowUp(self.store.engine).overview(window_seconds=window_seconds, tenant_id=tenant,
                                                          limit=limit)

    async def list(
        self, *, status: str | None = None, tenant_id: str | uuid.UUID | None = None, limit: int = 50
    ) -> list[tuple[ListedExport, JobRow | None]]:
        """Export workflows by their search attributes, newest first, each with its row as it stands."""
        clauses = ["WorkflowType = 'ExportWorkflow'"]
        if status is not None:
            if status not in Status.__members__.values():
                raise InputError(f"status {status!r} is not one of {', '.join(Status)}")
            clauses.append(f"ExportStatus = '{status}'")
        if tenant_id is not None:
            clauses.append(f"ExportTenant = '{parse_id(tenant_id, 'tenant ID')}'")
        found: dict[uuid.UUID, ListedExport] = {}
        async for execution in self._temporal().list_workflows(" AND ".join(clauses), limit=limit * 2):
            attributes = execution.typed_search_attributes
            listed_id = job_id_of(execution.id)
            if listed_id is None:  # another workflow that set the attributes: not an export
                continue
            job_id = uuid.UUID(listed_id)
            if job_id in found:  # an earlier run of the same export; the newest comes first
                continue
            found[job_id] = ListedExport(
                job_id=job_id,
                tenant_id=attributes.get(EXPORT_TENANT) or "",
                status=attributes.get(EXPORT_STATUS) or "",
                attempts=attributes.get(EXPORT_ATTEMPTS) or 0,
                delivery_key=attributes.get(DELIVERY_KEY) or "",
            )
            if len(found) == limit:
                break
        rows = await self.store.read_jobs(list(found))
        return [(listed, rows.get(job_id)) for job_id, listed in found.items()]

    def _temporal(self) -> Client:
        if self.temporal is None:
            raise RuntimeError("this call needs a Temporal client")
        return self.temporal


def database_engine(url: str, setting: str, *, pool_size: int) -> AsyncEngine:
    """An engine whose every connection attempt is bounded by CONNECT_TIMEOUT_SECONDS (asyncpg waits 60 s by
    default). A missing or unusable URL is `Unreachable`, naming its setting."""
    if not url.strip():
        raise Unreachable("PostgreSQL", setting, "", "no URL configured (or start `exports dev`)")
    if not url.startswith("postgresql+asyncpg://"):
        raise Unreachable("PostgreSQL", setting, "", "not a usable URL: it must start with postgresql+asyncpg://")
    try:
        engine = make_engine(url, pool_size=pool_size)
    except Exception as exc:  # a malformed URL, or one without the asyncpg driver
        raise Unreachable("PostgreSQL", setting, "", f"not a usable URL: {str(exc).splitlines()[0]}") from None

    @event.listens_for(engine.sync_engine, "do_connect")
    def _bounded(dialect: Dialect, connection_record: ConnectionPoolEntry, cargs: list[Any],
                 cparams: dict[str, Any]) -> None:
        cparams.setdefault("timeout", CONNECT_TIMEOUT_SECONDS)

    return engine


async def check_database(store: RoleStore, setting: str) -> None:
    """One connection and `SELECT 1`, bounded: `Unreachable` when PostgreSQL refuses the connection, does not
    answer, does not know the role or the database, or is not accepting connections."""
    where = store.address
    try:
        async with asyncio.timeout(CONNECT_TIMEOUT_SECONDS + 1):
            await store.ping()
    except TimeoutError:
        raise Unreachable("PostgreSQL", setting, where, f"no answer within {CONNECT_TIMEOUT_SECONDS:g} s") from None
    except Exception as exc:
        server = errors.postgres_error(exc)
        reason = str(server) if server is not None else _connection_reason(exc)
        raise Unreachable("PostgreSQL", setting, where, reason) from None


def _connection_reason(exc: BaseException) -> str:
    current: BaseException | None = exc
    while current is not None:
        if isinstance(current, ConnectionRefusedError) or "Connect call failed" in str(current):
            return "connection refused"
        if isinstance(current, OSError) and current.strerror:
            return current.strerror.lower()
        current = getattr(current, "orig", None) or current.__cause__
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text
