"""ExportWorkflow: one per export (ID `export-<job id>`), the Temporal form of the reference design's runner.

It reads the row, evaluates policy and claims (cutoff 1) in one step, builds, authorizes (cutoff 2) and delivers,
each an activity that commits the documented conditional statement. It decides only from the row, never from Temporal's
own state, and returns the row's state once it needs no attempt.
"""

from __future__ import annotations

import asyncio
import builtins
import uuid
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutError, TimeoutType
from temporalio.workflow import ActivityCancellationType

with workflow.unsafe.imports_passed_through():
    from pydantic import ValidationError

    from activities.contracts import (
        TEMPORAL_CANCEL_OPERATOR,
        Admission,
        AdmitInput,
        AttemptInput,
        AuthorizeInput,
        AuthorizeOutput,
        BuildOutput,
        CancelOutput,
        CancelRequest,
        ClaimInput,
        ClaimOutput,
        DeliverInput,
        DeliverOutput,
        Evaluation,
        ExportInput,
        ExportResult,
        Wake,
    )
    from activities.error_types import EXPORT_NOT_CREATED, EXPORT_NOT_FOUND, INVALID_EXPORT_INPUT
    from activities.exports import ExportActivities
    from store.models import AuthorizationResult, CancellationOutcome, ClaimResult, JobRow, Status
    from workflows import patches
    from workflows.identity import (
        DELIVERY_KEY,
        EXPORT_ATTEMPTS,
        EXPORT_CONFIRMED_BY,
        EXPORT_STATUS,
        EXPORT_TENANT,
        export_workflow_id,
    )

# Short steps on the shared queue: each is a conditional statement, safe to retry, but never without bound (about
# four minutes of retries ride out a database restart); a definite refusal is not retried at all (the worker's
# ClassifyStoreErrors interceptor makes it non-retryable).
_SHORT: dict[str, Any] = {
    "start_to_close_timeout": timedelta(seconds=30),
    "retry_policy": RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=30),
                                maximum_attempts=10),
}
# Without a wake-up, the workflow still looks at the row this often (EXPORTS_IDLE_RECHECK_SECONDS, as the last
# claim step reported it; this until one has).
_IDLE_RECHECK = timedelta(minutes=5)
_UNCONFIRMED_CLAIM_RETRY = timedelta(seconds=5)
# A build whose worker is lost resumes elsewhere this many times, each only while its lease renewal matches.
_BUILD_RESUMPTIONS = 3
_STOP_OUTCOMES = (CancellationOutcome.STOP_REQUESTED, CancellationOutcome.STOP_ALREADY_REQUESTED)
# A cancellation that found its row locked (Busy) is asked again this many times, this far apart.
_BUSY_RETRIES = 5
_BUSY_RETRY_INTERVAL = timedelta(seconds=2)
# Temporal's cancel of a run becomes one stop request, the same one however often the cancel is repeated.
_TEMPORAL_CANCEL = uuid.UUID("5d0c7f3e-5e1b-4c52-9a4b-7d2f3c1e0a11")


@workflow.defn
class ExportWorkflow:
    def __init__(self) -> None:
        self._row: JobRow | None = None
        self._seen_messages: set[str] = set()
        self._woken = False
        self._cancels: list[CancelRequest] = []
        self._cancel_in_flight = False
        self._rejected_signals: list[str] = []
        self._temporal_cancel = False
        self._stop_seen = False
        self._build: workflow.ActivityHandle[BuildOutput] | None = None
        self._shown: tuple[Status, int, str | None] | None = None
        # What an operator asks in the UI (the workflow's current details): who asked what, and what came of it.
        self._asked: list[str] = []
        self._busy: dict[uuid.UUID, int] = {}  # request ID -> how often its row was found locked
        self._cancel_in_flight_later = 0
        self._why: str = ""
        self._delivered_row: JobRow | None = None  # the row the delivery's terminal write left, read back at once
        self._idle_recheck = _IDLE_RECHECK

    @workflow.signal
    def wake(self, wake: Wake) -> None:
        # The dispatcher may publish one outbox row twice; each row wakes the workflow once.
        if str(wake.message_id) not in self._seen_messages:
            self._seen_messages.add(str(wake.message_id))
            self._woken = True

    @workflow.signal
    def cancel(self, payload: Any) -> None:
        """A cancellation request. Typed loosely on purpose: a payload typed by hand in the UI that does not
        validate is rejected here, visibly (log and the `rejected_signals` query), and records nothing."""
        try:
            request = CancelRequest.model_validate(payload)
        except ValidationError as exc:
            problem = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'payload'}: {e['msg']}" for e in exc.errors())
            self._rejected_signals.append(f"cancel rejected, nothing recorded: {problem}")
            workflow.logger.warning("cancel signal rejected, nothing recorded: %s", problem)
            return
        self._cancels.append(request)

    @workflow.query
    def row(self) -> JobRow | None:
        """The export's row as this workflow last read it."""
        return self._row

    @workflow.query
    def rejected_signals(self) -> list[str]:
        return list(self._rejected_signals)

    @workflow.run
    async def run(self, payload: Any = None) -> ExportResult:
        # Typed loosely and validated here, as the cancel signal is: a start that does not decode would otherwise
        # fail the workflow task again and again, and never end.
        request = _validated_start(payload)
        # Temporal's cancel must not cancel an attempt's steps (least of all a delivery): it becomes a stop
        # request, decided under the row lock like any other, and the run goes on to the row's final state.
        drive = asyncio.create_task(self._drive(request))
        while True:
            try:
                return await asyncio.shield(drive)
            except asyncio.CancelledError:
                if drive.done():
                    raise
                self._temporal_cancel = True
                self._request_stop_for_temporal_cancel()

    def _request_stop_for_temporal_cancel(self) -> None:
        if self._row is None or not self._temporal_cancel:
            return
        self._temporal_cancel = False
        info = workflow.info()
        self._cancels.append(CancelRequest(
            request_id=uuid.uuid5(_TEMPORAL_CANCEL, info.run_id),
            tenant_id=self._row.tenant_id,
            requested_by=TEMPORAL_CANCEL_OPERATOR,
            reason=f"Temporal cancel of workflow {info.workflow_id}, run {info.run_id}",
        ))

    async def _drive(self, request: ExportInput) -> ExportResult:
        if request.create is not None:
            try:
                await workflow.execute_activity_method(
                    ExportActivities.create_export, request.create,
                    summary=f"create, key {request.create.delivery_key}", **_SHORT
                )
            except ActivityError as err:
                raise ApplicationError(f"the export was not created: {_cause(err)}", type=EXPORT_NOT_CREATED,
                                       non_retryable=True) from None
        canceller = asyncio.create_task(self._serve_cancellations())
        job_id = str(request.job_id)
        while True:
            row = await self._until_settled(job_id)
            # Requests that arrived meanwhile are still recorded, one record per request ID.
            await workflow.wait_condition(
                lambda: not self._cancels and not self._cancel_in_flight and not self._cancel_in_flight_later)
            # A wake-up after the last read (a reconciliation or a correction, made while this run was still
            # recording cancellations) would otherwise be lost with this run: read the row again.
            if not (self._woken and workflow.patched(patches.WAKE_AFTER_SETTLED)):
                break
        canceller.cancel()
        return ExportResult(job_id=row.id, status=row.status, failure_reason=row.failure_reason)

    async def _until_settled(self, job_id: str) -> JobRow:
        """Attempts until the row is settled; the settled row."""
        while True:
            delivered, self._delivered_row = self._delivered_row, None
            if delivered is not None and delivered.status.is_settled and not self._woken:
                # No step needed to read what the delivery just wrote, unless a wake-up came since (a
                # reconciliation of what it wrote, say): then the row is read again.
                return self._observe(delivered)
            self._woken = False
            if workflow.patched(patches.POLICY_AND_CLAIM):
                settled = await self._admit_and_attempt(job_id)
            else:
                settled = await self._evaluate_then_attempt(job_id)
            if settled is not None:
                return settled

    async def _admit_and_attempt(self, job_id: str) -> JobRow | None:
        """Policy and the claim in one step, then the attempt. The settled row, or None to read the row again."""
        attempt_id = workflow.uuid4()
        try:
            admission: Admission = await workflow.execute_activity_method(
                ExportActivities.claim_if_allowed, AdmitInput(job_id=job_id, attempt_id=attempt_id),
                summary="read row, evaluate policy, claim", **_SHORT
            )
        except ActivityError as err:
            # Ended visibly (its failure is in the history); the row is read again at the next wake-up.
            workflow.logger.warning("reading or claiming export %s failed: %s; waiting for the row", job_id,
                                    _cause(err))
            await self._wait_for_wake()
            return None
        claim = admission.claim
        self._idle_recheck = timedelta(seconds=admission.idle_recheck_seconds)
        # A claimed row is shown as Running at once: its Queued would be one more search attribute update.
        row = self._observe(admission.evaluation.row,
                            show=claim is None or claim.result is not ClaimResult.CLAIMED)
        if row.status.is_settled:
            return row
        if claim is not None and await self._claimed(row, attempt_id, claim, admission.attempt, show_steps=True):
            return None
        # Another attempt holds the row, or the claim is unconfirmed: the next wake-up, or a timer, re-reads.
        await self._wait_for_wake()
        return None

    async def _evaluate_then_attempt(self, job_id: str) -> JobRow | None:
        try:
            evaluation: Evaluation = await workflow.execute_activity_method(
                ExportActivities.evaluate_policy, job_id, summary="read row, evaluate policy",
                **_SHORT
            )
        except ActivityError as err:
            workflow.logger.warning("reading export %s failed: %s; waiting for the row", job_id, _cause(err))
            await self._wait_for_wake()
            return None
        row = self._observe(evaluation.row)
        if row.status.is_settled:
            return row
        if evaluation.allowed and await self._attempt(row):
            return None
        await self._wait_for_wake()
        return None

    async def _wait_for_wake(self) -> None:
        try:
            await workflow.wait_condition(lambda: self._woken, timeout=self._idle_recheck)
        except builtins.TimeoutError:
            pass

    def _observe(self, row: JobRow | None, *, show: bool = True) -> JobRow:
        if row is None:
            raise ApplicationError("no export with this ID", type=EXPORT_NOT_FOUND, non_retryable=True)
        self._row = row
        self._request_stop_for_temporal_cancel()
        if show:
            self._show(row.status, row.attempt_count)
        return row

    def _describe(self, status: Status | None = None, attempts: int | None = None) -> None:
        """Who, why, what, in the UI's "current details", without opening any JSON."""
        row = self._row
        if row is None:
            return
        if status is None or attempts is None:
            status, attempts = self._shown[:2] if self._shown else (row.status, row.attempt_count)
        lines = [f"**{status.value}**, attempt {attempts}"]
        if status is Status.FAILED and row.failure_reason:
            lines[0] += f": {row.failure_reason.value}"
        if status is Status.REJECTED and row.rejection_reason:
            lines.append(f"rejected: {row.rejection_reason}")
        elif self._why:
            lines.append(self._why)
        if row.expected_file_name and status in (Status.DELIVERING, Status.COMPLETED, Status.OUTCOME_UNKNOWN):
            digest = row.expected_file_sha256.hex() if row.expected_file_sha256 else "?"
            lines.append(f"file {row.expected_file_name}, {row.expected_file_bytes} bytes, sha256 {digest}")
        if status is Status.COMPLETED and row.confirmed_by:
            lines.append(f"confirmed by {row.confirmed_by}")
        lines.extend(self._asked[-10:])
        if self._rejected_signals:
            lines.append(f"{len(self._rejected_signals)} signal(s) rejected: see the rejected_signals query")
        workflow.set_current_details("\n\n".join(lines))

    def _show(self, status: Status, attempts: int) -> None:
        """The search attributes follow every state the workflow learns of, from the row or from the step that
        just committed it (a claim, cutoff 2)."""
        self._describe(status, attempts)
        row = self._row
        assert row is not None
        confirmed_by = row.confirmed_by if status is Status.COMPLETED else None
        if self._shown == (status, attempts, confirmed_by):
            return
        self._shown = (status, attempts, confirmed_by)
        workflow.upsert_search_attributes(
            [
                EXPORT_STATUS.value_set(status.value),
                EXPORT_TENANT.value_set(str(row.tenant_id)),
                DELIVERY_KEY.value_set(row.delivery_key),
                EXPORT_ATTEMPTS.value_set(attempts),
                EXPORT_CONFIRMED_BY.value_set(confirmed_by) if confirmed_by else EXPORT_CONFIRMED_BY.value_unset(),
            ]
        )

    async def _attempt(self, row: JobRow) -> bool:
        """One attempt from the claim to its terminal write. True when the row should be re-read at once."""
        attempt_id = workflow.uuid4()
        try:
            claim: ClaimOutput = await workflow.execute_activity_method(
                ExportActivities.claim,
                ClaimInput(job_id=row.id, checked_version=row.version, attempt_id=attempt_id),
                summary=f"claim, attempt {row.attempt_count + 1}",
                **_SHORT,
            )
        except ActivityError as err:
            workflow.logger.warning("claim of %s failed: %s; the row decides", row.id, _cause(err))
            claim = ClaimOutput(result=ClaimResult.UNKNOWN, worker_task_queue="", lease_seconds=0)
        # 0.1.0's runs (before the policy-and-claim patch) showed no step's state: their commands have no upsert here.
        return await self._claimed(row, attempt_id, claim, row.attempt_count + 1, show_steps=False)

    async def _claimed(self, row: JobRow, attempt_id: uuid.UUID, claim: ClaimOutput, attempt_number: int, *,
                       show_steps: bool) -> bool:
        """The attempt after its claim answered: to its terminal write if claimed. True when the row should be
        re-read at once. With `show_steps`, the claim's Running and cutoff 2's Delivering are shown at once."""
        if claim.result is ClaimResult.UNKNOWN:
            # Like an unsettled message: it comes back later, and the row decides then.
            await workflow.sleep(_UNCONFIRMED_CLAIM_RETRY)
            return True
        if claim.result is ClaimResult.LOST:
            # Canceled, or edited: like a settled message, the job comes back only with its next wake-up (an
            # edit writes one), which may already have arrived.
            return False

        if show_steps:
            self._show(Status.RUNNING, attempt_number)
        lease = timedelta(seconds=claim.lease_seconds)
        attempt = AttemptInput(job=row, attempt_id=attempt_id)
        built = await self._build_file(attempt, claim.worker_task_queue, lease)
        if built is None or built.file is None:
            if built is not None and built.ended:
                self._why = f"build ended: {built.ended}"
            return True

        file = built.file
        # The file lives on the worker that built it; if that worker is gone, the row is left to recovery.
        on_worker: dict[str, Any] = {
            "task_queue": built.worker_task_queue,
            "schedule_to_start_timeout": lease,
            "retry_policy": RetryPolicy(maximum_attempts=1),
        }
        try:
            authorized: AuthorizeOutput = await workflow.execute_activity_method(
                ExportActivities.authorize_delivery,
                AuthorizeInput(job=row, attempt_id=attempt_id, file=file),
                start_to_close_timeout=timedelta(seconds=60),
                summary="cutoff 2: authorize delivery",
                **on_worker,
            )
        except ActivityError:
            return True  # cutoff 2 may or may not have committed: the row says which side the attempt is on
        if authorized.result is not AuthorizationResult.AUTHORIZED:
            return True
        if show_steps:
            self._show(Status.DELIVERING, attempt_number)
        try:
            delivered: DeliverOutput = await workflow.execute_activity_method(
                ExportActivities.deliver,
                DeliverInput(job=row, attempt_id=attempt_id, file=file),
                start_to_close_timeout=timedelta(hours=6),
                heartbeat_timeout=lease,
                summary=f"upload {file.final_name}, {_size(file.size)}",
                **on_worker,
            )
            self._why = f"delivery: {delivered.summary}"
            if delivered.row is not None and workflow.patched(patches.ROW_FROM_DELIVERY):
                self._delivered_row = delivered.row
        except ActivityError:
            pass  # never a second upload: the row stays Delivering and recovery resolves it
        return True

    async def _build_file(self, attempt: AttemptInput, queue: str, lease: timedelta) -> BuildOutput | None:
        """Build on the claiming worker; if that worker is lost (it never starts the build, or stops
        heartbeating), resume on any worker under the same attempt. Each build first takes the attempt's build
        slot, which fails once a takeover has committed (so a resumed build never competes with recovery) and
        fences any earlier build of the attempt (so a paused one that wakes up writes nothing).

        A build that started and then went quiet may have finished with its completion lost (Temporal was away):
        the first resumption goes back to the same worker, which delivers the finished file if it has one, and
        only if that worker does not take it within a lease does the build resume anywhere."""
        general = workflow.info().task_queue
        returned_to_worker = False
        for resumption in range(_BUILD_RESUMPTIONS + 1):
            if self._stop_seen:
                return await self._stop_without_build(attempt)
            self._build = workflow.start_activity_method(
                ExportActivities.build,
                attempt.model_copy(update={"resumption": resumption}),
                task_queue=queue,
                start_to_close_timeout=timedelta(hours=6),
                schedule_to_start_timeout=lease,
                heartbeat_timeout=lease,
                retry_policy=RetryPolicy(maximum_attempts=1),
                cancellation_type=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
                summary="build contacts CSV" if resumption == 0 else f"build contacts CSV, resumed ({resumption})",
            )
            try:
                built = await self._build
                if built.ended != "HandedBack":
                    return built
                if self._stop_seen:
                    return await self._stop_without_build(attempt)
                workflow.logger.info("build of %s handed back by a worker shutting down; resuming elsewhere",
                                     attempt.job.id)
                queue = general
            except asyncio.CancelledError:
                # Only this workflow cancels a build (Temporal's cancel of the run is shielded in `run`): a stop
                # arrived before the build could start, so no activity will record it.
                return await self._stop_without_build(attempt)
            except ActivityError as err:
                if self._stop_seen:
                    # The build ended without a result, perhaps cut off before it could record the stop: record
                    # it here (the write is conditional on this attempt, so it is a no-op if the build did).
                    return await self._stop_without_build(attempt)
                if not isinstance(err.cause, TimeoutError):
                    return None  # the build ended in a way the row records (or recovery will)
                started = err.cause.type is not TimeoutType.SCHEDULE_TO_START
                if started and queue != general and not returned_to_worker:
                    returned_to_worker = True
                    workflow.logger.warning("build of %s went quiet; resuming on the same worker first",
                                            attempt.job.id)
                else:
                    workflow.logger.warning("build of %s lost its worker; resuming elsewhere", attempt.job.id)
                    queue = general
            finally:
                self._build = None
        return None

    async def _stop_without_build(self, attempt: AttemptInput) -> None:
        """Record the stop for an attempt whose build is not running: Running -> Stopped, conditional on this
        attempt and on the recorded stop request, so a build that does run on somewhere is refused at cutoff 2."""
        try:
            await workflow.execute_activity_method(
                ExportActivities.stop_attempt, attempt, summary="stop, no build running", **_SHORT
            )
        except ActivityError as err:
            # The stop request is recorded in the row: cutoff 2 refuses the attempt, and recovery stops it.
            workflow.logger.warning("stop of %s not written: %s; left to recovery", attempt.job.id, _cause(err))
        return None

    async def _again_later(self, request: CancelRequest) -> None:
        """Counted in `_cancel_in_flight_later` by the caller, before the task starts, so that the run does not end
        while a request waits to be asked again."""
        try:
            await workflow.sleep(_BUSY_RETRY_INTERVAL)
            self._cancels.append(request)
        finally:
            self._cancel_in_flight_later -= 1

    async def _serve_cancellations(self) -> None:
        while True:
            await workflow.wait_condition(lambda: bool(self._cancels))
            request = self._cancels.pop(0)
            self._cancel_in_flight = True
            try:
                recorded: CancelOutput = await workflow.execute_activity_method(
                    ExportActivities.record_cancellation,
                    request,
                    summary=f"cancellation request by {request.requested_by}",
                    **_SHORT,
                )
            except ActivityError as err:
                # One request that cannot be recorded never blocks the next one.
                problem = f"cancel {request.request_id} not recorded: {_cause(err)}"
                self._rejected_signals.append(problem)
                workflow.logger.warning("%s", problem)
                continue
            finally:
                self._cancel_in_flight = False
            workflow.logger.info("cancellation request %s: %s", request.request_id, recorded.result.outcome)
            reason = f": \"{request.reason}\"" if request.reason else ""
            self._asked.append(f"cancel by {request.requested_by}{reason} → {recorded.result.outcome.value}")
            self._describe()
            busy = recorded.result.outcome is CancellationOutcome.BUSY
            if busy and workflow.patched(patches.BUSY_CANCEL_RETRY):
                # The row was locked longer than lock_timeout: nothing recorded. Ask again with the same request
                # ID (its answer, if an earlier try committed after all, is the one recorded), a few times.
                self._busy[request.request_id] = tries = self._busy.get(request.request_id, 0) + 1
                if tries <= _BUSY_RETRIES:
                    self._cancel_in_flight_later += 1
                    asyncio.create_task(self._again_later(request))
                    continue
                self._rejected_signals.append(f"cancel {request.request_id} not recorded: the export stayed busy "
                                              f"through {_BUSY_RETRIES} tries; send it again")
            if recorded.result.outcome in _STOP_OUTCOMES:
                self._stop_seen = True
                if self._build is not None:
                    self._build.cancel()
            self._woken = True


def _size(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size} B"


def _cause(err: ActivityError) -> str:
    """The one-line message of what made a step fail."""
    cause: BaseException = err
    while cause.__cause__ is not None:
        cause = cause.__cause__
    return str(cause) or type(cause).__name__


def _validated_start(payload: Any) -> ExportInput:
    """The start's input, or a failure of the run at once (non-retryable) before anything is written."""
    try:
        request = ExportInput.model_validate(payload)
    except ValidationError as exc:
        problem = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'input'}: {e['msg']}" for e in exc.errors())
        raise ApplicationError(f"invalid start input, nothing written: {problem}", type=INVALID_EXPORT_INPUT,
                               non_retryable=True) from None
    expected = export_workflow_id(request.job_id)
    if workflow.info().workflow_id != expected:
        raise ApplicationError(f"an export's workflow ID must be {expected!r}, not {workflow.info().workflow_id!r}; "
                               "nothing written", type=INVALID_EXPORT_INPUT, non_retryable=True)
    if request.create is not None and request.create.job_id != request.job_id:
        raise ApplicationError(f"create.job_id {request.create.job_id} differs from job_id {request.job_id}; "
                               "nothing written", type=INVALID_EXPORT_INPUT, non_retryable=True)
    return request
