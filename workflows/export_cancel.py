"""How an export's run serves cancellation requests: the `cancel` signal's payloads, the `cancel` Update's, and
Temporal's own cancel of the run, recorded in arrival order by `record_cancellation` (under the row lock, one
record per request ID), or by `record_cancellations`, several together, in runs that accept the Update. A payload
that does not validate is refused visibly and records nothing; a request that cannot be recorded never blocks the
next one; a Busy answer (the row locked past lock_timeout) is asked again a few times. A recorded stop cancels the
build in flight; any answer wakes the run to read its row.

The Update is the path a flood cannot close: the server refuses every signal to a run past its cap
(history.maximumSignalsPerExecution), while an Update is validated before it enters the history, so a malformed
one is refused to its sender and costs the run nothing. A valid one is answered with the outcome recorded.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime, timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

from workflows.export_display import Display
from workflows.export_state import SHORT_STEP, RunState, cause

with workflow.unsafe.imports_passed_through():
    from exports_client.contracts import validation_problems
    from pydantic import BaseModel, ValidationError

    from activities.contracts import (
        TEMPORAL_CANCEL_OPERATOR,
        CancelBatch,
        CancelBatchOutput,
        CancelOutput,
        CancelRequest,
    )
    from activities.exports import ExportActivities
    from store.models import CancellationOutcome, CancellationResult, Status
    from workflows import patches

_STOP_OUTCOMES = (CancellationOutcome.STOP_REQUESTED, CancellationOutcome.STOP_ALREADY_REQUESTED)
# A cancellation that found its row locked (Busy) is asked again this many times, this far apart.
_BUSY_RETRIES = 5
_BUSY_RETRY_INTERVAL = timedelta(seconds=2)
# Temporal's cancel cannot be sent again, so past those tries it is asked again as long as this (patch
# temporal-cancel-until-recorded), the pause doubling up to the longest: a row locked that long holds its export
# still too, and each ask adds about a dozen events to the run's history (some 4,000 in six hours), which cannot
# continue as new meanwhile.
_TEMPORAL_CANCEL_ASKED_FOR = timedelta(hours=6)
_LONGEST_BUSY_PAUSE = timedelta(minutes=1)
_LONGEST_BUSY_DOUBLINGS = 5  # 2 s doubled 5 times passes the longest pause: no more (a timedelta has a bound)
# Temporal's cancel of a run becomes one stop request, the same one however often the cancel is repeated.
_TEMPORAL_CANCEL = uuid.UUID("5d0c7f3e-5e1b-4c52-9a4b-7d2f3c1e0a11")
# At most this many Update requests wait to be recorded; past it an Update is refused (send it again), so that a
# flood of valid requests cannot grow the run's memory or history without bound.
_MOST_WAITING = 100
# Answers kept for Updates that ask again with the same request ID (oldest forgotten first).
_ANSWERS_KEPT = 1000
# Requests recorded together by one step, at most (a run that accepts the Update records what waited together).
_BATCH = 100
_Payload = TypeVar("_Payload", bound=BaseModel)
_Asked = tuple[uuid.UUID, uuid.UUID, str]  # request ID, tenant, operator


class Cancellations:
    def __init__(self, state: RunState, display: Display) -> None:
        self._state = state
        self._display = display
        self._pending: list[CancelRequest] = []
        self._recording = False
        self._waiting_to_ask_again = 0
        self._busy: dict[_Asked, int] = {}  # request -> how often its row was found locked
        # Whether this run accepts the `cancel` Update: decided once, by its patch, as the workflow object is made.
        self.updates_on = False
        self._answers: dict[_Asked, CancellationResult | str] = {}  # request -> outcome, or why none
        self._updates_waiting = 0
        self._refused_unlogged = 0  # refusals since the last line logged
        # Temporal's cancel: whether it was asked before the row was read, and the tenant a request of it recorded.
        self._temporal_cancel_asked_early = False
        self._temporal_cancel_recorded_for: uuid.UUID | None = None
        self._temporal_cancel_first_busy: datetime | None = None  # when Temporal's cancel first found it locked
        self._last_refusal = ""

    @property
    def idle(self) -> bool:
        """Nothing pending, being recorded, or waiting to be asked again: the run may end."""
        return not self._pending and not self._recording and not self._waiting_to_ask_again

    def accept(self, payloads: tuple[Any, ...]) -> None:
        """A `cancel` signal's payloads: a request to record, or refused here, recording nothing."""
        request = self.signal_payload("cancel", payloads, CancelRequest)
        if request is None:
            return
        asked = _asked(request)
        # Sent again after its Busy tries were spent, as the run told its sender to: a new request, with all its
        # tries (the Update path starts them afresh too). Asked only then, so that no other run records a marker.
        if self._busy.get(asked, 0) > _BUSY_RETRIES and workflow.patched(patches.BUSY_SIGNAL_SENT_AGAIN):
            del self._busy[asked]
        self._pending.append(request)

    def signal_payload(self, signal: str, payloads: tuple[Any, ...], model: type[_Payload]) -> _Payload | None:
        """A signal's one payload as `model`; else None, refused (log, the details and the `rejected_signals`
        query), and nothing done with it."""
        if len(payloads) != 1:
            problem = f"payload: one expected, {len(payloads)} sent"
        else:
            try:
                return model.model_validate(payloads[0])
            except ValidationError as exc:
                problem = validation_problems(exc, "payload")
        self._display.reject(f"{signal} rejected, nothing recorded: {problem}")
        self._log_refusal(f"{signal}: {problem}")
        return None

    def _log_refusal(self, problem: str) -> None:
        """Refusals are logged a line per workflow task, once its handlers have run: a flood that piled up reaches
        the run thousands of signals in one activation, which must end inside the SDK's deadlock bound (2 s), and a
        line each took a third of it. The details and the `rejected_signals` query keep the last ones."""
        self._refused_unlogged += 1
        self._last_refusal = problem
        if self._refused_unlogged == 1:
            # Queued behind the handlers of the signals that came with this task, so it counts them all.
            asyncio.create_task(self._log_refusals())

    async def _log_refusals(self) -> None:
        workflow.logger.warning("%d signal(s) rejected, nothing recorded; the last: %s (%d refused by this "
                                "run, the last %d in the rejected_signals query)", self._refused_unlogged,
                                self._last_refusal, self._display.rejected_count, len(self._display.rejected))
        self._refused_unlogged = 0

    def validate_update(self, payload: Any) -> None:
        """The `cancel` Update's validator: a refusal here reaches the sender and never the run's history."""
        if not self.updates_on:
            raise ApplicationError("this run takes cancellation requests by the `cancel` signal or `exports cancel`; "
                                   "send the cancel signal: nothing recorded", type="CancelUpdateNotAccepted",
                                   non_retryable=True)
        request = _parse_update(payload)
        row = self._state.row
        # Another tenant's request is junk like a malformed one: accepted, it would enter the history and count
        # towards the server's quota of Updates a run takes (history.maxTotalUpdates), which a run in the middle of
        # an attempt cannot renew by continuing as new. The row would answer NotFound, recording nothing, and the
        # client package turns this refusal into that answer. A job's tenant never changes: the row read decides.
        # Before that read (it comes with the claim, which may wait an hour for a build slot), the tenant the start
        # named does. A run started by hand keyed to another tenant refuses its own tenant's Update so until the
        # claim; the signal and `exports cancel` record it meanwhile.
        tenant = row.tenant_id if row is not None else self._state.start_tenant
        if tenant is not None and request.tenant_id != tenant:
            raise ApplicationError("no such export for this tenant: nothing recorded", type="CancelExportNotFound",
                                   non_retryable=True)
        kept = self._answers.get(_asked(request))
        # Only a request answered for good is answered at once; one answered Busy (or whose step failed) waits again.
        if (kept is None or not _final(kept)) and self._updates_waiting >= _MOST_WAITING:
            raise ApplicationError(f"{_MOST_WAITING} cancellation requests are waiting to be recorded; send it again "
                                   "shortly: nothing recorded", type="CancelRequestsWaiting", non_retryable=True)

    async def answer_update(self, payload: Any) -> CancellationResult:
        """The `cancel` Update: the request recorded (or its earlier answer, asked again), and its outcome."""
        request = _parse_update(payload)
        asked = _asked(request)
        earlier = self._answers.get(asked)
        if earlier is not None and not _final(earlier):
            # Busy, or a step that failed, recorded nothing: the same request asked again is asked of the row
            # again, with all its tries, as the answer told the sender to do.
            del self._answers[asked]
            self._busy.pop(asked, None)
        if asked not in self._answers:
            self._updates_waiting += 1
            try:
                self._pending.append(request)
                await workflow.wait_condition(lambda: asked in self._answers)
            finally:
                self._updates_waiting -= 1
        answer = self._answers[asked]
        if isinstance(answer, str):
            raise ApplicationError(answer, type="CancelNotRecorded", non_retryable=True)
        return answer

    def _remember(self, request: CancelRequest, answer: CancellationResult | str) -> None:
        if (isinstance(answer, CancellationResult) and answer.recorded
                and request.request_id == _temporal_cancel_request_id()):
            self._temporal_cancel_recorded_for = request.tenant_id
        asked = _asked(request)
        self._answers.pop(asked, None)
        self._answers[asked] = answer
        while len(self._answers) > _ANSWERS_KEPT:
            del self._answers[next(iter(self._answers))]

    def stop_for_temporal_cancel(self) -> None:
        """Temporal's cancel of the run as a stop request of its own, for the row's tenant once the row is read.

        Before that read, which comes with the claim and so may wait an hour for a build slot, a run that takes the
        canceled-while-claiming branch asks once at once, for the tenant its start named: the export, still Queued,
        is then cancelled, not claimed and built first. Unless that request was recorded (the row turned out to be
        another tenant's, it stayed Busy, its step failed), the row's tenant is asked once the row is read."""
        if not self._state.temporal_cancel:
            return
        row = self._state.row
        if row is None:
            tenant = self._state.start_tenant
            if (tenant is None or self._temporal_cancel_asked_early
                    or not workflow.patched(patches.CANCELED_WHILE_CLAIMING)):
                return
            self._temporal_cancel_asked_early = True
        else:
            self._state.temporal_cancel = False
            if row.tenant_id == self._temporal_cancel_recorded_for:
                return  # recorded already, for this tenant
            tenant = row.tenant_id
        info = workflow.info()
        self._pending.append(CancelRequest(
            request_id=_temporal_cancel_request_id(),
            tenant_id=tenant,
            requested_by=TEMPORAL_CANCEL_OPERATOR,
            reason=f"Temporal cancel of workflow {info.workflow_id}, run {info.run_id}",
        ))

    async def serve(self) -> None:
        """Records the requests as they come, for the life of the run: one at a time, or, in a run that accepts the
        cancel Update, all that waited together (up to a batch) by one step."""
        while True:
            await workflow.wait_condition(lambda: bool(self._pending))
            if self.updates_on:
                batch, self._pending = self._pending[:_BATCH], self._pending[_BATCH:]
            else:
                batch = [self._pending.pop(0)]
            self._recording = True
            try:
                results = await (self._record_together(batch) if self.updates_on else self._record_alone(batch[0]))
            finally:
                self._recording = False
            for request, result in zip(batch, results, strict=True):
                if result is not None:
                    self._settle(request, result)

    async def _record_alone(self, request: CancelRequest) -> list[CancellationResult | None]:
        try:
            recorded: CancelOutput = await workflow.execute_activity_method(
                ExportActivities.record_cancellation,
                request,
                summary=f"cancellation request by {request.requested_by}",
                **SHORT_STEP,
            )
        except ActivityError as err:
            # One request that cannot be recorded never blocks the next one.
            problem = f"cancel {request.request_id} not recorded: {cause(err)}"
            self._remember(request, problem)
            self._display.reject(problem)
            workflow.logger.warning("%s", problem)
            return [None]
        return [recorded.result]

    async def _record_together(self, batch: list[CancelRequest]) -> list[CancellationResult | None]:
        try:
            recorded: CancelBatchOutput = await workflow.execute_activity_method(
                ExportActivities.record_cancellations,
                CancelBatch(requests=batch),
                summary=f"{len(batch)} cancellation request(s), the first by {batch[0].requested_by}",
                **SHORT_STEP,
            )
        except ActivityError:
            # One request that cannot be recorded never blocks the others: each is asked alone.
            return [(await self._record_alone(request))[0] for request in batch]
        return list(recorded.results)

    def _settle(self, request: CancelRequest, result: CancellationResult) -> None:
        """What a recorded request's outcome means for the run."""
        outcome = result.outcome
        workflow.logger.info("cancellation request %s: %s", request.request_id, outcome)
        reason = f": \"{request.reason}\"" if request.reason else ""
        self._display.ask(f"cancel by {request.requested_by}{reason} → {outcome.value}")
        if outcome is CancellationOutcome.BUSY and workflow.patched(patches.BUSY_CANCEL_RETRY):
            if self._ask_again_later(request):
                return
        self._remember(request, result)
        if outcome is CancellationOutcome.CANCELED_WHILE_QUEUED or result.found_status is Status.CANCELED:
            self._state.canceled_seen = True
        if outcome in _STOP_OUTCOMES:
            self._state.stop_seen = True
            if self._state.build is not None:
                self._state.build.cancel()
        self._state.woken = True

    def _ask_again_later(self, request: CancelRequest) -> bool:
        """A Busy answer recorded nothing: the same request ID is asked again (its answer, if an earlier try
        committed after all, is the one recorded), a few times; Temporal's cancel, which its sender cannot send
        again, for as long as `_TEMPORAL_CANCEL_ASKED_FOR`, in a run that took that branch. False once the tries
        are spent."""
        asked = _asked(request)
        self._busy[asked] = tries = self._busy.get(asked, 0) + 1
        pause = _BUSY_RETRY_INTERVAL if tries <= _BUSY_RETRIES else self._temporal_cancel_pause(request, tries)
        if pause is None:
            self._display.reject(f"cancel {request.request_id} not recorded: the export stayed busy "
                                 f"through {tries - 1} tries; send it again")
            return False
        # Counted before the task starts, so that the run does not end while the request waits.
        self._waiting_to_ask_again += 1
        asyncio.create_task(self._again_after_a_pause(request, pause))
        return True

    def _temporal_cancel_pause(self, request: CancelRequest, tries: int) -> timedelta | None:
        """How long Temporal's cancel waits before it is asked again past the tries of any request, doubling; None
        for any other request, once Temporal's cancel has been asked for `_TEMPORAL_CANCEL_ASKED_FOR`, and in runs
        without the branch."""
        if request.request_id != _temporal_cancel_request_id():
            return None
        if self._temporal_cancel_first_busy is None:
            self._temporal_cancel_first_busy = workflow.now()
        if workflow.now() - self._temporal_cancel_first_busy > _TEMPORAL_CANCEL_ASKED_FOR:
            return None
        if not workflow.patched(patches.TEMPORAL_CANCEL_UNTIL_RECORDED):
            return None
        pause: timedelta = _BUSY_RETRY_INTERVAL * 2 ** min(tries - _BUSY_RETRIES, _LONGEST_BUSY_DOUBLINGS)
        return min(pause, _LONGEST_BUSY_PAUSE)

    async def _again_after_a_pause(self, request: CancelRequest, pause: timedelta) -> None:
        try:
            await workflow.sleep(pause)
            self._pending.append(request)
        finally:
            self._waiting_to_ask_again -= 1


def _temporal_cancel_request_id() -> uuid.UUID:
    """The request ID of Temporal's cancel of this run: one record, however often the run is cancelled."""
    return uuid.uuid5(_TEMPORAL_CANCEL, workflow.info().run_id)


def _final(answer: CancellationResult | str) -> bool:
    """Whether an answer kept for an Update stands for the same request asked again: a recorded outcome does; Busy
    and a step that failed recorded nothing."""
    return isinstance(answer, CancellationResult) and answer.outcome is not CancellationOutcome.BUSY


def _asked(request: CancelRequest) -> _Asked:
    """What makes two requests one, as the row decides it (store/cancellation.py): the same request ID from another
    operator (or tenant) is another request, answered RequestIdReused by the row, never the first one's answer."""
    return request.request_id, request.tenant_id, request.requested_by


def _parse_update(payload: Any) -> CancelRequest:
    try:
        return CancelRequest.model_validate(payload)
    except ValidationError as exc:
        raise ApplicationError(f"cancel refused, nothing recorded: {validation_problems(exc, 'payload')}",
                               type="InvalidCancelRequest", non_retryable=True) from None
