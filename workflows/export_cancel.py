"""How an export's run serves cancellation requests: the `cancel` signal's payloads and Temporal's own cancel of the
run, recorded one at a time, in arrival order, by `record_cancellation` (under the row lock, one record per request
ID). A payload that does not validate is refused visibly and records nothing; a request that cannot be recorded never
blocks the next one; a Busy answer (the row locked past lock_timeout) is asked again a few times. A recorded stop
cancels the build in flight; any answer wakes the run to read its row.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError

from workflows.export_display import Display
from workflows.export_state import SHORT_STEP, RunState, cause

with workflow.unsafe.imports_passed_through():
    from pydantic import ValidationError

    from activities.contracts import TEMPORAL_CANCEL_OPERATOR, CancelOutput, CancelRequest
    from activities.exports import ExportActivities
    from store.models import CancellationOutcome
    from workflows import patches

_STOP_OUTCOMES = (CancellationOutcome.STOP_REQUESTED, CancellationOutcome.STOP_ALREADY_REQUESTED)
# A cancellation that found its row locked (Busy) is asked again this many times, this far apart.
_BUSY_RETRIES = 5
_BUSY_RETRY_INTERVAL = timedelta(seconds=2)
# Temporal's cancel of a run becomes one stop request, the same one however often the cancel is repeated.
_TEMPORAL_CANCEL = uuid.UUID("5d0c7f3e-5e1b-4c52-9a4b-7d2f3c1e0a11")


class Cancellations:
    def __init__(self, state: RunState, display: Display) -> None:
        self._state = state
        self._display = display
        self._pending: list[CancelRequest] = []
        self._recording = False
        self._waiting_to_ask_again = 0
        self._busy: dict[uuid.UUID, int] = {}  # request ID -> how often its row was found locked

    @property
    def idle(self) -> bool:
        """Nothing pending, being recorded, or waiting to be asked again: the run may end."""
        return not self._pending and not self._recording and not self._waiting_to_ask_again

    def accept(self, payload: Any) -> None:
        """A `cancel` signal's payload: a request to record, or refused here (log, the details and the
        `rejected_signals` query), recording nothing."""
        try:
            request = CancelRequest.model_validate(payload)
        except ValidationError as exc:
            problem = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'payload'}: {e['msg']}" for e in exc.errors())
            self._display.reject(f"cancel rejected, nothing recorded: {problem}")
            workflow.logger.warning("cancel signal rejected, nothing recorded: %s", problem)
            return
        self._pending.append(request)

    def stop_for_temporal_cancel(self) -> None:
        """Temporal's cancel of the run, once the row (and so the tenant) is known, as a stop request of its own."""
        row = self._state.row
        if row is None or not self._state.temporal_cancel:
            return
        self._state.temporal_cancel = False
        info = workflow.info()
        self._pending.append(CancelRequest(
            request_id=uuid.uuid5(_TEMPORAL_CANCEL, info.run_id),
            tenant_id=row.tenant_id,
            requested_by=TEMPORAL_CANCEL_OPERATOR,
            reason=f"Temporal cancel of workflow {info.workflow_id}, run {info.run_id}",
        ))

    async def serve(self) -> None:
        """Records the requests as they come, for the life of the run."""
        while True:
            await workflow.wait_condition(lambda: bool(self._pending))
            request = self._pending.pop(0)
            self._recording = True
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
                self._display.reject(problem)
                workflow.logger.warning("%s", problem)
                continue
            finally:
                self._recording = False
            outcome = recorded.result.outcome
            workflow.logger.info("cancellation request %s: %s", request.request_id, outcome)
            reason = f": \"{request.reason}\"" if request.reason else ""
            self._display.ask(f"cancel by {request.requested_by}{reason} → {outcome.value}")
            if outcome is CancellationOutcome.BUSY and workflow.patched(patches.BUSY_CANCEL_RETRY):
                if self._ask_again_later(request):
                    continue
            if outcome in _STOP_OUTCOMES:
                self._state.stop_seen = True
                if self._state.build is not None:
                    self._state.build.cancel()
            self._state.woken = True

    def _ask_again_later(self, request: CancelRequest) -> bool:
        """A Busy answer recorded nothing: the same request ID is asked again (its answer, if an earlier try
        committed after all, is the one recorded), a few times. False once the tries are spent."""
        self._busy[request.request_id] = tries = self._busy.get(request.request_id, 0) + 1
        if tries > _BUSY_RETRIES:
            self._display.reject(f"cancel {request.request_id} not recorded: the export stayed busy "
                                          f"through {_BUSY_RETRIES} tries; send it again")
            return False
        # Counted before the task starts, so that the run does not end while the request waits.
        self._waiting_to_ask_again += 1
        asyncio.create_task(self._again_after_a_pause(request))
        return True

    async def _again_after_a_pause(self, request: CancelRequest) -> None:
        try:
            await workflow.sleep(_BUSY_RETRY_INTERVAL)
            self._pending.append(request)
        finally:
            self._waiting_to_ask_again -= 1
