"""ExportWorkflow: one per export (ID `export-<job id>`), the Temporal form of the reference design's runner.

The story of a run: read the row, evaluate policy and claim (cutoff 1) in one step; if claimed, attempt: build,
authorize (cutoff 2), deliver, each an activity that commits the documented conditional statement; read the row
again until it is settled, and return its state. The run decides only from the row, never from Temporal's own
state. Cancellation requests are served beside the story (workflows/export_cancel.py), what the UI shows is drawn
by workflows/export_display.py, and the run's state is one RunState (workflows/export_state.py).

Every change here is a change of the commands that open runs replay: read docs/changing-workflows.md first.
The branches that runs of earlier releases replay are at the bottom, each named with its patch.
"""

from __future__ import annotations

import asyncio
import builtins
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypedDict

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError, TimeoutError, TimeoutType
from temporalio.workflow import ActivityCancellationType

from workflows.export_cancel import Cancellations
from workflows.export_display import Display
from workflows.export_state import SHORT_STEP, RunState, cause

with workflow.unsafe.imports_passed_through():
    from exports_client.contracts import validation_problems
    from pydantic import ValidationError

    from activities.contracts import (
        Admission,
        AdmitInput,
        AttemptInput,
        AuthorizeInput,
        AuthorizeOutput,
        BuildOutput,
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
    from store.models import AuthorizationResult, CancellationResult, ClaimResult, JobRow, Status
    from workflows import patches
    from workflows.identity import admission_queue, export_workflow_id, tenant_priority

_UNCONFIRMED_CLAIM_RETRY = timedelta(seconds=5)
# The longest a claim waits for a worker with a build slot free before the run reads its row again.
_ADMISSION_WAIT = timedelta(hours=1)
# The claim's own bound: above its wait for a destination's share (activities/exports.py, _DESTINATION_WAIT).
_CLAIM_TIMEOUT = timedelta(minutes=2)
_CLAIM_HEARTBEAT_TIMEOUT = timedelta(seconds=30)
# A build whose worker is lost resumes elsewhere this many times, each only while its lease renewal matches.
_BUILD_RESUMPTIONS = 3
# How long a run that may continue as new waits first, so that a cancel that came with signals is applied (below).
_BEFORE_CONTINUING_AS_NEW = timedelta(seconds=1)


@workflow.defn
class ExportWorkflow:
    def __init__(self) -> None:
        self._state = RunState()
        self._display = Display(self._state)
        self._cancellations = Cancellations(self._state, self._display)
        self._job_id = uuid.UUID(int=0)  # set from the input as the run starts
        # Decided here, not in `run`: the SDK hands a run's first workflow task its Updates before its start, so a
        # cancel Update sent right after the start (or to a run just continued as new) met a validator that did not
        # know yet whether the run takes it, and was refused. The patch's marker is the run's first command either
        # way. The cancel Update is accepted only by runs that recorded its patch (workflows/patches.py): a release
        # that does not know it could not replay an accepted one.
        self._cancellations.updates_on = workflow.patched(patches.CANCEL_UPDATE)
        # The tenant the run's fairness key names, until the start's input is read (`run`).
        self._state.start_tenant = _key_tenant()

    # --- messages -----------------------------------------------------------------------------------------------

    # Both signals take any number of payloads and check them here: one sent by hand (the UI, `temporal workflow
    # signal`) may carry none or two, and the SDK would call a one-argument handler with them, fail the workflow
    # task, and fail it again at every retry, since each meets the same signal: the run stalled for good.

    @workflow.signal
    def wake(self, *payloads: Any) -> None:
        """A wake-up; one that is not (no payload, two, or one that is not a wake-up) is rejected visibly."""
        wake = self._cancellations.signal_payload("wake", payloads, Wake)
        # The dispatcher may publish one outbox row twice; each row wakes the workflow once.
        if wake is not None and str(wake.message_id) not in self._state.seen_messages:
            self._state.seen_messages.add(str(wake.message_id))
            self._state.woken = True

    @workflow.signal
    def cancel(self, *payloads: Any) -> None:
        """A cancellation request. A payload typed by hand in the UI that does not validate is rejected visibly (log
        and the `rejected_signals` query), and records nothing."""
        self._cancellations.accept(payloads)

    @workflow.update(name="cancel")
    async def cancel_update(self, payload: Any) -> CancellationResult:
        """A cancellation request, answered with its recorded outcome: the path a flood of signals cannot close
        (workflows/export_cancel.py). Same payload as the signal; a malformed one is refused to its sender."""
        return await self._cancellations.answer_update(payload)

    @cancel_update.validator
    def _validate_cancel_update(self, payload: Any) -> None:
        self._cancellations.validate_update(payload)

    @workflow.query
    def row(self) -> JobRow | None:
        """The export's row as this workflow last read it."""
        return self._state.row

    @workflow.query
    def rejected_signals(self) -> list[str]:
        return list(self._display.rejected)

    # --- the story ----------------------------------------------------------------------------------------------

    @workflow.run
    async def run(self, payload: Any = None) -> ExportResult:
        # Typed loosely and validated here, as the cancel signal is: a start that does not decode would otherwise
        # fail the workflow task again and again, and never end.
        request = _validated_start(payload)
        self._state.start_tenant = _start_tenant(request)
        # Temporal's cancel must not cancel an attempt's steps (least of all a delivery): it becomes a stop
        # request, decided under the row lock like any other, and the run goes on to the row's final state.
        drive = asyncio.create_task(self._drive(request))
        while True:
            try:
                return await asyncio.shield(drive)
            except asyncio.CancelledError:
                if drive.done():
                    raise
                self._state.temporal_cancel = True
                self._cancellations.stop_for_temporal_cancel()

    async def _drive(self, request: ExportInput) -> ExportResult:
        if request.create is not None:
            await self._create(request)
        canceller = asyncio.create_task(self._cancellations.serve())
        job_id = self._job_id = request.job_id
        while True:
            row = await self._until_settled(job_id)
            # Requests that arrived meanwhile are still recorded, one record per request ID.
            # (and every Update handler has answered: always true where the run accepted none).
            await workflow.wait_condition(lambda: self._cancellations.idle and workflow.all_handlers_finished())
            # A wake-up after the last read (a reconciliation or a correction, made while this run was still
            # recording cancellations) would otherwise be lost with this run: read the row again.
            if not (self._state.woken and workflow.patched(patches.WAKE_AFTER_SETTLED)):
                break
        canceller.cancel()
        return ExportResult(job_id=row.id, status=row.status, failure_reason=row.failure_reason)

    async def _until_settled(self, job_id: uuid.UUID) -> JobRow:
        """Attempts until the row is settled; the settled row."""
        while True:
            delivered, self._state.delivered_row = self._state.delivered_row, None
            if delivered is not None and delivered.status.is_settled and not self._state.woken:
                # No step needed to read what the delivery just wrote, unless a wake-up came since (a
                # reconciliation of what it wrote, say): then the row is read again.
                return self._observe(delivered)
            self._state.woken = False
            if workflow.patched(patches.POLICY_AND_CLAIM):
                settled = await self._admit_then_attempt(job_id)
            else:
                settled = await self._evaluate_then_attempt_before_0_2_0(job_id)
            if settled is not None:
                return settled

    async def _admit_then_attempt(self, job_id: uuid.UUID) -> JobRow | None:
        """Policy and the claim in one step, then the attempt if claimed. The settled row, or None to read the row
        again."""
        attempt_id = workflow.uuid4()
        # Right after a cutoff 2 given up, on the shared queue and a read only (it claims nothing): it must mark the
        # attempt before the step, if it still runs, reaches cutoff 2, and needs no build slot for that (a busy
        # fleet would hold it back). A row it could claim comes with a wake-up, and the run claims on the
        # admission queue once woken: the same commands as 0.2.0's for an unclaimed answer, so a rollback replays
        # it. A 0.2.0 worker that takes it ignores `given_up` and may claim, as 0.2.0 does.
        given_up = self._state.cutoff_2_given_up
        general = workflow.info().task_queue
        queue = general if given_up is not None else admission_queue(general)
        try:
            # On the admission queue, taken only by a worker with a build slot free: a Queued export waits here,
            # where no lease runs, never on a busy worker (LD1). Options are not replayed: unpatched. The bound
            # only keeps a run from waiting on a queue that no worker polls (a rollback to 0.2.0). TRY_CANCEL: a
            # claim given up for a Canceled row (below) can claim nothing, so the run need not wait for its step.
            # Started here, not in a task of its own: its command keeps its place among the activation's.
            claiming = workflow.start_activity_method(
                ExportActivities.claim_if_allowed,
                # Inputs are not replayed either: a run that gave a cutoff 2 up names it (0.3.0), unpatched.
                AdmitInput(job_id=job_id, attempt_id=attempt_id, given_up=given_up),
                summary="read row, evaluate policy, claim (on a worker with a build slot free)" if given_up is None
                else "read row, marking the attempt whose cutoff 2 was given up (no claim)",
                task_queue=queue,
                schedule_to_start_timeout=_ADMISSION_WAIT,
                # Keyed to the tenant (LD5): a run started without the key (by hand, or before 0.3.0) has it from
                # its row once read. Options are not replayed.
                priority=tenant_priority(self._state.row.tenant_id if self._state.row is not None else None),
                # It may wait up to 90 s for its destination's share of the worker (LD4), heartbeating, then end
                # and come again; a claim taken by a worker that is paused or gone comes back within the heartbeat
                # timeout, as it did within the 30 s start-to-close before.
                start_to_close_timeout=_CLAIM_TIMEOUT, heartbeat_timeout=_CLAIM_HEARTBEAT_TIMEOUT,
                retry_policy=SHORT_STEP["retry_policy"],
                cancellation_type=ActivityCancellationType.TRY_CANCEL,
            )
            admission = await self._claim_unless_canceled_meanwhile(claiming)
            if admission is None:
                return await self._canceled_while_claiming(job_id)
            self._state.cutoff_2_given_up = None
        except ActivityError as err:
            # Ended visibly (its failure is in the history); the row is read again at the next wake-up.
            workflow.logger.warning("reading or claiming export %s failed: %s; waiting for the row", job_id,
                                    cause(err))
            await self._wait_for_wake()
            return None
        claim = admission.claim
        self._state.idle_recheck = timedelta(seconds=admission.idle_recheck_seconds)
        # A claimed row is shown as Running at once: its Queued would be one more search attribute update.
        row = self._observe(admission.evaluation.row,
                            show=claim is None or claim.result is not ClaimResult.CLAIMED)
        if row.status.is_settled:
            return row
        if claim is not None and await self._attempt(row, attempt_id, claim, admission.attempt, show_steps=True):
            return None
        # Another attempt holds the row, or the claim is unconfirmed: the next wake-up, or a timer, re-reads.
        await self._wait_for_wake()
        return None

    async def _claim_unless_canceled_meanwhile(self, claiming: workflow.ActivityHandle[Admission]) -> Admission | None:
        """The claim's answer; or None once a cancellation the run recorded has left the row Canceled while the
        claim still waits (for a build slot, which may take as long as another export's build): the claim is given
        up, since it could claim nothing, and the run reads its row at once instead of lagging it."""
        canceled = asyncio.ensure_future(workflow.wait_condition(lambda: self._state.canceled_seen))
        try:
            await workflow.wait([claiming, canceled], return_when=asyncio.FIRST_COMPLETED)
        finally:
            canceled.cancel()
        if claiming.done() or not workflow.patched(patches.CANCELED_WHILE_CLAIMING):
            return await claiming
        claiming.cancel()
        try:
            return await claiming  # it may have answered after all
        except ActivityError as err:
            if not isinstance(err.cause, CancelledError):
                raise
            return None

    async def _canceled_while_claiming(self, job_id: uuid.UUID) -> JobRow | None:
        """The row, read on the shared queue (a read takes no build slot) after the claim was given up."""
        self._state.woken = False  # the read comes after the wake-up that the recorded cancellation set
        evaluation: Evaluation = await workflow.execute_activity_method(
            ExportActivities.evaluate_policy, str(job_id), summary="read row (the claim given up: canceled)",
            **SHORT_STEP
        )
        row = self._observe(evaluation.row)
        if row.status.is_settled:
            return row
        await self._wait_for_wake()
        return None

    async def _attempt(self, row: JobRow, attempt_id: uuid.UUID, claim: ClaimOutput, number: int, *,
                       show_steps: bool) -> bool:
        """One attempt, top to bottom: its claim's answer, the build, cutoff 2, the delivery. Each step commits its
        documented statement, and the row records how the attempt ended. True when the row should be read again
        at once. With `show_steps`, the claim's Running and cutoff 2's Delivering are shown as they commit."""
        if claim.result is ClaimResult.UNKNOWN:
            # Like an unsettled message: it comes back later, and the row decides then.
            await workflow.sleep(_UNCONFIRMED_CLAIM_RETRY)
            return True
        if claim.result is ClaimResult.LOST:
            # Canceled, or edited: like a settled message, the job comes back only with its next wake-up (an
            # edit writes one), which may already have arrived.
            return False
        if show_steps:
            self._display.show(Status.RUNNING, number)
        lease = timedelta(seconds=claim.lease_seconds)
        attempt = AttemptInput(job=row, attempt_id=attempt_id)

        built = await self._build(attempt, claim.worker_task_queue, lease)
        if built is None or built.file is None:
            if built is not None and built.ended:
                self._state.why = f"build ended: {built.ended}"
            return True

        if not await self._authorize(attempt, built, lease):
            return True
        if show_steps:
            self._display.show(Status.DELIVERING, number)

        await self._deliver(attempt, built, lease)
        return True

    # --- the attempt's steps ------------------------------------------------------------------------------------

    async def _build(self, attempt: AttemptInput, queue: str, lease: timedelta) -> BuildOutput | None:
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
            if self._state.stop_seen:
                await self._stop_without_build(attempt)
                return None
            self._state.build = workflow.start_activity_method(
                ExportActivities.build,
                attempt.model_copy(update={"resumption": resumption}),
                task_queue=queue,
                start_to_close_timeout=timedelta(hours=6),
                # The return to the worker that went quiet: a live worker polls its own queue and takes it at
                # once; a dead one must not hold the build a whole lease more (LV6). Options are not replayed.
                schedule_to_start_timeout=lease / 6 if returned_to_worker and queue != general else lease,
                heartbeat_timeout=lease,
                retry_policy=RetryPolicy(maximum_attempts=1),
                cancellation_type=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
                summary="build contacts CSV" if resumption == 0 else f"build contacts CSV, resumed ({resumption})",
            )
            try:
                built = await self._state.build
                if built.ended != "HandedBack":
                    return built
                if self._state.stop_seen:
                    await self._stop_without_build(attempt)
                    return None
                workflow.logger.info("build of %s handed back by a worker shutting down; resuming elsewhere",
                                     attempt.job.id)
                queue = general
            except asyncio.CancelledError:
                # Only this workflow cancels a build (Temporal's cancel of the run is shielded in `run`): a stop
                # arrived before the build could start, so no activity will record it.
                await self._stop_without_build(attempt)
                return None
            except ActivityError as err:
                if self._state.stop_seen:
                    # The build ended without a result, perhaps cut off before it could record the stop: record
                    # it here (the write is conditional on this attempt, so it is a no-op if the build did).
                    await self._stop_without_build(attempt)
                    return None
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
                self._state.build = None
        return None

    async def _authorize(self, attempt: AttemptInput, built: BuildOutput, lease: timedelta) -> bool:
        """Cutoff 2 on the worker that holds the file: whether the attempt may deliver."""
        assert built.file is not None
        try:
            authorized: AuthorizeOutput = await workflow.execute_activity_method(
                ExportActivities.authorize_delivery,
                AuthorizeInput(job=attempt.job, attempt_id=attempt.attempt_id, file=built.file),
                # It may wait for an upload slot (LD2), its lease kept and its heartbeats sent.
                start_to_close_timeout=timedelta(hours=6),
                # A worker that dies after cutoff 2 committed is noticed within a lease, so that the run reads the
                # row recovery settled without waiting out the whole timeout. Options are not replayed: unpatched.
                heartbeat_timeout=lease,
                summary="cutoff 2: authorize delivery",
                **_on_worker(built, lease),
            )
        except ActivityError:
            # Cutoff 2 may or may not have committed: the row says which side the attempt is on. If its step still
            # runs (Temporal gave it up), the next read tells the row, so that the step authorizes nothing.
            self._state.cutoff_2_given_up = attempt.attempt_id
            return False
        return authorized.result is AuthorizationResult.AUTHORIZED

    async def _deliver(self, attempt: AttemptInput, built: BuildOutput, lease: timedelta) -> None:
        """The upload, past the point of no return, on the worker that holds the file."""
        file = built.file
        assert file is not None
        try:
            delivered: DeliverOutput = await workflow.execute_activity_method(
                ExportActivities.deliver,
                DeliverInput(job=attempt.job, attempt_id=attempt.attempt_id, file=file),
                start_to_close_timeout=timedelta(hours=6),
                heartbeat_timeout=lease,
                summary=f"upload {file.final_name}, {_size(file.size)}",
                **_on_worker(built, lease),
            )
            self._state.why = f"delivery: {delivered.summary}"
            if delivered.row is not None and workflow.patched(patches.ROW_FROM_DELIVERY):
                self._state.delivered_row = delivered.row
        except ActivityError:
            pass  # never a second upload: the row stays Delivering and recovery resolves it

    async def _stop_without_build(self, attempt: AttemptInput) -> None:
        """Record the stop for an attempt whose build is not running: Running -> Stopped, conditional on this
        attempt and on the recorded stop request, so a build that does run on somewhere is refused at cutoff 2."""
        try:
            await workflow.execute_activity_method(
                ExportActivities.stop_attempt, attempt, summary="stop, no build running", **SHORT_STEP
            )
        except ActivityError as err:
            # The stop request is recorded in the row: cutoff 2 refuses the attempt, and recovery stops it.
            workflow.logger.warning("stop of %s not written: %s; left to recovery", attempt.job.id, cause(err))

    # --- reading the row ----------------------------------------------------------------------------------------

    async def _create(self, request: ExportInput) -> None:
        """The creation statement, for a run started directly by a platform team's client."""
        assert request.create is not None
        try:
            await workflow.execute_activity_method(
                ExportActivities.create_export, request.create,
                summary=f"create, key {request.create.delivery_key}", **SHORT_STEP
            )
        except ActivityError as err:
            raise ApplicationError(f"the export was not created: {cause(err)}", type=EXPORT_NOT_CREATED,
                                   non_retryable=True) from None

    async def _wait_for_wake(self) -> None:
        """Between attempts, until a wake-up or the idle recheck. A run that accepts the cancel Update also ends
        here, continuing as new, once Temporal suggests it (history long) and no request or handler is in flight:
        nothing of an attempt is open at this point, and the row holds all the next run needs. A fresh run also
        takes signals again after a flood filled this one's quota."""
        recheck_at = workflow.now() + self._state.idle_recheck
        timeout = self._state.idle_recheck
        while True:
            timed_out = False
            try:
                await workflow.wait_condition(lambda: self._state.woken or self._may_continue_as_new(),
                                              timeout=timeout)
            except builtins.TimeoutError:
                timed_out = True
            if not self._may_continue_as_new():
                return
            if workflow.patched(patches.CANCEL_BEFORE_CONTINUING_AS_NEW) and not (
                    self._state.paused_before_continuing
                    and workflow.patched(patches.PAUSE_ONCE_BEFORE_CONTINUING_AS_NEW)):
                # The SDK runs a task's signal handlers, and checks wait conditions, before it applies the same
                # task's cancel of the run; the check above may thus come before Temporal's cancel is known. A
                # timer's end is applied with the cancel, not before it, and a condition is checked only once every
                # job applied has run: the second check sees the cancel, whichever task brings it.
                # Once is enough: Temporal's suggestion, which a signal's task may bring, stays; what frees the run
                # after that (a recording's end, a handler's answer) ends a step or a timer, applied with the cancel.
                # Pausing again gave each pause's second a new request to end it in flight, with no end.
                await workflow.sleep(_BEFORE_CONTINUING_AS_NEW)
                await workflow.wait_condition(lambda: True)
                self._state.paused_before_continuing = True
                if not self._may_continue_as_new():
                    if timed_out or self._state.woken:
                        return
                    if workflow.patched(patches.PAUSE_ONCE_BEFORE_CONTINUING_AS_NEW):
                        # The pause does not put the idle recheck off: what is left of it, if anything.
                        timeout = recheck_at - workflow.now()
                        if timeout <= timedelta(0):
                            return
                    continue
            workflow.logger.info("export %s continues as new after %d events", self._job_id,
                                 workflow.info().get_current_history_length())
            workflow.continue_as_new(ExportInput(job_id=self._job_id))

    def _may_continue_as_new(self) -> bool:
        # Not with Temporal's cancel still waiting for the row (a run whose claim failed has not read it): the new
        # run would never hear of it, and the export would go on as if never cancelled.
        # Nor with a cutoff 2 given up and not yet marked: the new run would not know to mark it.
        return (self._cancellations.updates_on and workflow.info().is_continue_as_new_suggested()
                and not self._state.temporal_cancel and self._state.cutoff_2_given_up is None
                and self._cancellations.idle and workflow.all_handlers_finished())

    def _observe(self, row: JobRow | None, *, show: bool = True) -> JobRow:
        if row is None:
            raise ApplicationError("no export with this ID", type=EXPORT_NOT_FOUND, non_retryable=True)
        self._state.row = row
        self._cancellations.stop_for_temporal_cancel()
        if show:
            self._display.show(row.status, row.attempt_count)
        return row

    # --- branches that runs of earlier releases replay ----------------------------------------------------------
    # Patch policy-and-claim: 0.1.0's runs evaluated policy and claimed in two steps, and showed no step's state
    # (no Running at the claim, no Delivering at cutoff 2). Retire it (deprecate_patch) in the first release after
    # every run that 0.1.0 started has closed and the namespace's retention has passed: 0.3.0 at the earliest.

    async def _evaluate_then_attempt_before_0_2_0(self, job_id: uuid.UUID) -> JobRow | None:
        self._state.cutoff_2_given_up = None  # its read cannot mark a cutoff 2 given up (a run of 0.1.0's steps)
        try:
            evaluation: Evaluation = await workflow.execute_activity_method(
                ExportActivities.evaluate_policy, str(job_id), summary="read row, evaluate policy",
                **SHORT_STEP
            )
        except ActivityError as err:
            workflow.logger.warning("reading export %s failed: %s; waiting for the row", job_id, cause(err))
            await self._wait_for_wake()
            return None
        row = self._observe(evaluation.row)
        if row.status.is_settled:
            return row
        if evaluation.allowed and await self._claim_then_attempt_before_0_2_0(row):
            return None
        await self._wait_for_wake()
        return None

    async def _claim_then_attempt_before_0_2_0(self, row: JobRow) -> bool:
        attempt_id = workflow.uuid4()
        try:
            claim: ClaimOutput = await workflow.execute_activity_method(
                ExportActivities.claim,
                ClaimInput(job_id=row.id, checked_version=row.version, attempt_id=attempt_id),
                summary=f"claim, attempt {row.attempt_count + 1}",
                **SHORT_STEP,
            )
        except ActivityError as err:
            workflow.logger.warning("claim of %s failed: %s; the row decides", row.id, cause(err))
            claim = ClaimOutput(result=ClaimResult.UNKNOWN, worker_task_queue="", lease_seconds=0)
        return await self._attempt(row, attempt_id, claim, row.attempt_count + 1, show_steps=False)


if TYPE_CHECKING:  # as export_state's StepOptions: a class made again by each run's import
    class _OnWorker(TypedDict):
        task_queue: str
        schedule_to_start_timeout: timedelta
        retry_policy: RetryPolicy


def _on_worker(built: BuildOutput, lease: timedelta) -> _OnWorker:
    """The options of a step after the build: on the worker that holds the file (its own task queue), started
    within one lease, since that worker's lease keeper renews for the attempt meanwhile (the build hands it over,
    the step adopts it: activities/export_base.py, `attempt_step`), and never retried: a second try of the upload
    could be a second upload, and recovery resolves a step that did not end. If that worker is gone, the row is left
    to recovery."""
    assert built.worker_task_queue is not None
    return {"task_queue": built.worker_task_queue, "schedule_to_start_timeout": lease,
            "retry_policy": RetryPolicy(maximum_attempts=1)}


def _size(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size} B"


def _start_tenant(request: ExportInput) -> uuid.UUID | None:
    """The tenant the run's start named: its creation's, else its fairness key. None for a start that named none
    (by hand, without a key)."""
    return request.create.tenant_id if request.create is not None else _key_tenant()


def _key_tenant() -> uuid.UUID | None:
    """The tenant the run's fairness key names (the dispatcher and the client package key every run to its tenant,
    LD5; the server carries the key over to a continued run), or None."""
    try:
        return uuid.UUID(workflow.info().priority.fairness_key or "")
    except ValueError:
        return None


def _validated_start(payload: Any) -> ExportInput:
    """The start's input, or a failure of the run at once (non-retryable) before anything is written."""
    try:
        request = ExportInput.model_validate(payload)
    except ValidationError as exc:
        raise ApplicationError(f"invalid start input, nothing written: {validation_problems(exc, 'input')}",
                               type=INVALID_EXPORT_INPUT, non_retryable=True) from None
    expected = export_workflow_id(request.job_id)
    if workflow.info().workflow_id != expected:
        raise ApplicationError(f"an export's workflow ID must be {expected!r}, not {workflow.info().workflow_id!r}; "
                               "nothing written", type=INVALID_EXPORT_INPUT, non_retryable=True)
    if request.create is not None and request.create.job_id != request.job_id:
        raise ApplicationError(f"create.job_id {request.create.job_id} differs from job_id {request.job_id}; "
                               "nothing written", type=INVALID_EXPORT_INPUT, non_retryable=True)
    return request
