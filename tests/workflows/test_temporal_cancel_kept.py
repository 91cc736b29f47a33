"""Temporal's own cancel of an export's run (the UI's Cancel) is sent once: the server takes one cancel request of a
run and ignores the next. So the run, not the operator, must see it recorded, whatever the client that sent it
called itself, and however long the row stays locked (found by review). A cancel signal given up as Busy can be
sent again, and then gets all its tries again."""

from __future__ import annotations

import uuid
from contextlib import AsyncExitStack

import pytest
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType
from temporalio.api.workflowservice.v1 import RequestCancelWorkflowExecutionRequest

from store.db import asyncpg_dsn
from store.models import Status
from tests.helpers.harness import open_harness
from tests.helpers.support import eventually, lock_row, unlock_row
from tests.workflows.test_cancel_update import _waiting_run
from workflows import patches

BOUND = 60.0


async def _asks(handle) -> int:
    """How often the run asked the row to record a cancellation."""
    return sum(1 for e in (await handle.fetch_history()).events
               if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
               and e.activity_task_scheduled_event_attributes.activity_type.name == "record_cancellation")


@pytest.mark.spec("TW7")
async def test_temporal_cancel_by_a_client_whose_identity_holds_control_characters_is_recorded(
        db, store, client, tmp_path):
    """A client's identity is its own free text. It went into the request's operator unchecked, and PostgreSQL
    refuses a NUL: the request failed for good, and the export went on although it was cancelled. The identity is
    now mended (control characters become U+FFFD), never refused."""
    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path, dispatcher=False)
        job_id, handle = await _waiting_run(h)
        try:
            await client.workflow_service.request_cancel_workflow_execution(RequestCancelWorkflowExecutionRequest(
                namespace=client.namespace, workflow_execution=WorkflowExecution(workflow_id=handle.id),
                identity="ann@ui\x00\x1b[2J", request_id=str(uuid.uuid4())))
            row = await eventually(lambda: h.store.read_job(job_id), lambda r: r.stop_request_id is not None,
                                   timeout=BOUND, interval=0.2, what="Temporal's cancel recorded as a stop request")
            assert row.status is Status.RUNNING
            by = await h.db.admin.fetchval("SELECT requested_by FROM cancellation_requests WHERE id = $1",
                                           row.stop_request_id)
            assert by == "temporal-cancel: ann@ui\ufffd\ufffd[2J", by
        finally:
            await handle.terminate("test over")


@pytest.mark.spec("TW7")
@pytest.mark.parametrize("early", [True, False], ids=["branch", "this-release"])
async def test_temporal_cancel_that_finds_the_row_locked_past_its_tries_is_asked_until_recorded(
        db, store, client, tmp_path, early):
    """Temporal's cancel found the row locked through the five tries any Busy request gets, and was given up: the
    UI's Cancel cannot be sent again, so the export went on to deliver. With the patch
    `temporal-cancel-until-recorded` the run goes on asking, backing off, and records it once the row is free.
    Without it (this release's default, which a rollback needs), the run gives up as before and writes no marker."""
    extra = {"early_patches": patches.TEMPORAL_CANCEL_UNTIL_RECORDED} if early else {}
    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path, dispatcher=False, lock_timeout_ms=200, **extra)
        job_id, handle = await _waiting_run(h)  # Running; the run has read its row
        locker = await lock_row(asyncpg_dsn(h.db.url("owner")), job_id)
        try:
            await handle.cancel()
            if early:  # past the five tries, the branch's own
                await eventually(lambda: _asks(handle), lambda n: n >= 7, timeout=BOUND, interval=0.5,
                                 what="Temporal's cancel asked past its five tries")
            else:
                await eventually(lambda: handle.query("rejected_signals"),
                                 lambda said: any("stayed busy" in line for line in said), timeout=BOUND,
                                 interval=0.5, what="Temporal's cancel given up as Busy")
            await unlock_row(locker)  # the row is free again
            if early:
                row = await eventually(lambda: h.store.read_job(job_id), lambda r: r.stop_request_id is not None,
                                       timeout=BOUND, interval=0.5, what="Temporal's cancel recorded")
                assert row.status is Status.RUNNING
            else:
                asked = await _asks(handle)
                assert asked == 6, asked  # the first try and five more, then nothing
                assert (await h.store.read_job(job_id)).stop_request_id is None
            history = await handle.fetch_history()
            marked = any(e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED
                         and patches.TEMPORAL_CANCEL_UNTIL_RECORDED.encode() in e.SerializeToString()
                         for e in history.events)
            assert marked is early
        finally:
            await unlock_row(locker)
            await handle.terminate("test over")


async def given_up_as_busy(handle, *, times: int) -> None:
    """The run has given up a request as Busy this many times (the `rejected_signals` query says so)."""
    await eventually(lambda: handle.query("rejected_signals"),
                     lambda said: sum("stayed busy" in line for line in said) == times, timeout=BOUND,
                     interval=0.5, what=f"a request given up as Busy {times} time(s)")


async def given_up_as_busy_then_sent_again(h, job_id: uuid.UUID, handle, stack: AsyncExitStack) -> dict[str, str]:
    """A cancel signal sent while another transaction holds the export's row lock, given up after its tries, and
    sent again with the same request ID while the lock is still held (until `stack` closes): the request."""
    request = {"request_id": str(uuid.uuid4()), "tenant": str(h.tenant_id), "operator": "ann@example.com",
               "reason": "locked row"}
    stack.push_async_callback(unlock_row, await lock_row(asyncpg_dsn(h.db.url("owner")), job_id))
    await handle.signal("cancel", request)
    await given_up_as_busy(handle, times=1)
    assert await _asks(handle) == 6  # the first try and five more
    await handle.signal("cancel", request)  # the operator sends it again, as told
    return request


async def asked_again_while_locked(handle) -> None:
    """The row stays locked past the first try of the signal sent again: it is asked again."""
    await eventually(lambda: _asks(handle), lambda n: n >= 8, timeout=BOUND, interval=0.2,
                     what="the signal sent again asked a second time")


@pytest.mark.spec("RQ4", "TW6")
@pytest.mark.parametrize("early", [True, False], ids=["branch", "this-release"])
async def test_a_cancel_signal_sent_again_after_its_busy_tries_were_spent_gets_its_tries_again(
        db, store, client, tmp_path, early):
    """A cancel signal that found the row locked through its five tries is given up ("send it again"). Sent again
    with the same request ID, it got one try, not five: the run still counted the first sending's Busy answers, so
    a lock held a few seconds more refused it again at once. With the patch `busy-signal-sent-again` the signal
    sent again is asked as a new one, and recorded once the row is free within its tries. Without it (this
    release's default, which a rollback needs), one try as before, and no marker."""
    extra = {"early_patches": patches.BUSY_SIGNAL_SENT_AGAIN} if early else {}
    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path, dispatcher=False, lock_timeout_ms=200, **extra)
        job_id, handle = await _waiting_run(h)  # Running; the run has read its row
        async with AsyncExitStack() as locked:  # the row's lock, held until this block ends
            request = await given_up_as_busy_then_sent_again(h, job_id, handle, locked)
            if early:
                await asked_again_while_locked(handle)
            else:
                await given_up_as_busy(handle, times=2)  # the signal sent again, after one try
        if early:
            row = await eventually(lambda: h.store.read_job(job_id), lambda r: r.stop_request_id is not None,
                                   timeout=BOUND, interval=0.5, what="the signal sent again recorded")
            assert row.stop_request_id == uuid.UUID(request["request_id"]) and row.status is Status.RUNNING
        else:
            assert await _asks(handle) == 7
            assert (await h.store.read_job(job_id)).stop_request_id is None
        history = await handle.fetch_history()
        marked = any(e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED
                     and patches.BUSY_SIGNAL_SENT_AGAIN.encode() in e.SerializeToString() for e in history.events)
        assert marked is early
        await handle.terminate("test over")
