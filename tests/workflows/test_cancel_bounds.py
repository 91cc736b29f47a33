"""The bounds of the run's cancellation requests, on the real `Cancellations` with the few workflow calls it makes
answered by stand-ins: how long Temporal's cancel is asked again, and how many Update requests may wait (both
found by review)."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

from temporalio.exceptions import ApplicationError

from activities.contracts import CancelRequest
from store.models import CancellationOutcome, CancellationResult
from workflows import export_cancel
from workflows.export_cancel import Cancellations
from workflows.export_display import Display
from workflows.export_state import RunState

TEMPORAL_CANCEL_ID = uuid.uuid4()
TENANT = uuid.uuid4()


def _cancellations(monkeypatch, clock: list[datetime]) -> Cancellations:
    """As a run that took the branch of temporal-cancel-until-recorded, on a clock the test moves."""
    monkeypatch.setattr(export_cancel, "_temporal_cancel_request_id", lambda: TEMPORAL_CANCEL_ID)
    monkeypatch.setattr(export_cancel.workflow, "now", lambda: clock[0])
    monkeypatch.setattr(export_cancel.workflow, "patched", lambda patch_id: True)
    return Cancellations(RunState(), Display(RunState()))


async def test_temporal_cancel_is_asked_again_for_its_whole_bound_and_then_given_up(monkeypatch):
    """The pause doubled before it was capped at a minute, and a timedelta cannot hold 2 s * 2**46: the 51st Busy
    answer, some 45 minutes in, raised OverflowError in the task that records the run's requests, which ended it:
    nothing was recorded by that run again, and with a request left pending it never ended."""
    clock = [datetime(2026, 1, 1, tzinfo=UTC)]
    c = _cancellations(monkeypatch, clock)
    pauses: list[timedelta] = []

    async def noted(request: CancelRequest, pause: timedelta) -> None:
        pauses.append(pause)
        c._waiting_to_ask_again -= 1

    c._again_after_a_pause = noted  # type: ignore[method-assign]
    request = CancelRequest(request_id=TEMPORAL_CANCEL_ID, tenant_id=TENANT, requested_by="temporal-cancel")
    start = clock[0]
    asked_each = timedelta(seconds=10)  # a Busy answer takes the lock timeout and a step to come back
    tries = 0
    while clock[0] - start <= export_cancel._TEMPORAL_CANCEL_ASKED_FOR + timedelta(hours=1):
        tries += 1
        again = c._ask_again_later(request)  # what the run does with each Busy answer
        await asyncio.sleep(0)
        if not again:
            break
        assert pauses[-1] <= timedelta(minutes=1), (tries, pauses[-1])
        clock[0] += pauses[-1] + asked_each
    asked_for = clock[0] - start
    assert export_cancel._TEMPORAL_CANCEL_ASKED_FOR <= asked_for <= export_cancel._TEMPORAL_CANCEL_ASKED_FOR + \
        timedelta(minutes=2), (tries, asked_for)
    assert pauses[:6] == [timedelta(seconds=s) for s in (2, 2, 2, 2, 2, 4)], pauses[:6]


async def test_a_busy_update_asked_again_is_held_to_the_bound_on_waiting_requests(monkeypatch):
    """The validator let through any request whose answer was kept, as one answered at once; a kept Busy answer is
    now asked of the row again, and so waits: each such request must count against the bound like a new one."""
    clock = [datetime(2026, 1, 1, tzinfo=UTC)]
    c = _cancellations(monkeypatch, clock)
    c.updates_on = True
    never = asyncio.get_running_loop().create_future()

    async def wait_condition(fn, **_):
        await never

    monkeypatch.setattr(export_cancel.workflow, "wait_condition", wait_condition)
    busy = [CancelRequest(request_id=uuid.uuid4(), tenant_id=TENANT, requested_by=f"op{i}") for i in range(20)]
    for request in busy:
        c._remember(request, CancellationResult(request_id=request.request_id, outcome=CancellationOutcome.BUSY))
    waiting = [asyncio.ensure_future(c.answer_update(
        {"request_id": str(uuid.uuid4()), "tenant_id": str(TENANT), "requested_by": "flood"}))
        for _ in range(export_cancel._MOST_WAITING)]
    again = []
    refused = 0
    try:
        await asyncio.sleep(0)
        assert c._updates_waiting == export_cancel._MOST_WAITING
        for request in busy:  # each sender does as Busy told it: the same request again
            payload = request.model_dump(mode="json")
            try:
                c.validate_update(payload)
            except ApplicationError as exc:
                assert exc.type == "CancelRequestsWaiting"
                refused += 1
                continue
            again.append(asyncio.ensure_future(c.answer_update(payload)))
            await asyncio.sleep(0)
        assert c._updates_waiting == export_cancel._MOST_WAITING and refused == len(busy), (c._updates_waiting,
                                                                                              refused)
    finally:
        for task in waiting + again:
            task.cancel()
        await asyncio.gather(*waiting, *again, return_exceptions=True)
