"""A run that waits for a wake-up gets one when its row changes, not at its idle recheck (300 s): here, a late
cutoff 2 that settles a `Running` row the run read and waits on (found by review)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from temporalio.api.enums.v1 import EventType

from activities import checkpoints
from activities.contracts import ExportResult
from store.models import Status
from tests.helpers.crash import held_with_temporal_down, processes
from tests.helpers.events import events
from tests.helpers.harness import Harness, release_held
from tests.helpers.support import eventually
from tests.helpers.tcp_cut import TcpCutProxy, temporal_upstream
from tests.workflows.test_crash import activity_runs, named
from workflows.identity import EXPORT_STATUS, export_workflow_id


async def _waiting_after(h: Harness, job_id: uuid.UUID, *, after: int) -> None:
    """The run has started a timer (its idle recheck, in `_wait_for_wake`) after event `after`."""
    async def waiting() -> bool:
        history = await h.client.get_workflow_handle(export_workflow_id(job_id)).fetch_history()
        return any(e.event_type == EventType.EVENT_TYPE_TIMER_STARTED and e.event_id > after
                   for e in history.events)
    await eventually(waiting, bool, timeout=60, interval=0.2, what="the run waiting for a wake-up")


async def _history_length(h: Harness, job_id: uuid.UUID) -> int:
    history = await h.client.get_workflow_handle(export_workflow_id(job_id)).fetch_history()
    return history.events[-1].event_id


@pytest.mark.spec("HI4", "PT6")
async def test_a_late_cutoff_2_that_writes_stopped_wakes_the_run_waiting_on_its_attempt(crash_harness):
    """Cutoff 2 waits on a worker whose heartbeats no longer reach Temporal (its way there is down): by its own count
    Temporal still waits for it, but Temporal gave the step up, and the run read the row `Running` (another
    attempt's, as far as its new read goes) and waits for a wake-up. An operator's stop is recorded meanwhile (the
    run wakes, reads Running again, waits again). Then cutoff 2 runs: STOP_RECORDED, and the step writes `Stopped`
    itself (finish_stopped.sql). Found by review: that write asked for no wake-up, and the run learnt of it only at
    its idle recheck; the run's mark on the row (migration 0017) now makes it ask."""
    h = crash_harness
    async with processes(h) as started, TcpCutProxy(*temporal_upstream(h.client)) as temporal:
        job_id = await held_with_temporal_down(h, started, temporal, checkpoints.BEFORE_CUTOFF_2)
        try:
            await eventually(lambda: activity_runs(h, job_id),
                             lambda runs: [r.outcome for r in named(runs, "authorize_delivery")] == ["timed_out"]
                             and runs[-1].name == "claim_if_allowed" and runs[-1].outcome == "completed",
                             timeout=60, interval=0.2, what="cutoff 2 given up and the row read again")
            await _waiting_after(h, job_id, after=0)
            row = await h.store.read_job(job_id)
            assert row.status is Status.RUNNING  # the held step's keeper still renews its lease
            mark = await _history_length(h, job_id)
            stop = await h.exports.cancel(tenant_id=h.tenant_id, job_id=job_id, requested_by="op", reason="stop")
            assert stop.outcome.value == "StopRequested"
            # The run records the request, wakes, reads Running (stop requested) and waits again.
            await eventually(lambda: activity_runs(h, job_id),
                             lambda runs: len(named(runs, "claim_if_allowed")) >= 2
                             and runs[-1].name == "claim_if_allowed" and runs[-1].outcome == "completed"
                             and any(r.name.startswith("record_cancellation") and r.outcome == "completed"
                                     for r in runs),
                             timeout=60, interval=0.2, what="the stop recorded and the row read again")
            await _waiting_after(h, job_id, after=mark)
            # Cutoff 2 goes on, still cut off from Temporal: it finds the stop and writes Stopped itself.
            release_held(h.settings, checkpoints.BEFORE_CUTOFF_2, job_id)
            await eventually(lambda: h.store.read_job(job_id), lambda r: r.status is Status.STOPPED,
                             timeout=30, interval=0.1, what="the late cutoff 2's Stopped")
        finally:
            release_held(h.settings, checkpoints.BEFORE_CUTOFF_2, job_id)
            temporal.heal()
        stopped = [e for e in await events(h.db, job_id) if e["kind"] == "Stopped"]
        assert [e["detail"] for e in stopped] == ["BeforeDelivery"]  # written by the late cutoff-2 step itself
        outbox = await h.db.admin.fetch("SELECT kind, created_at FROM outbox WHERE job_id = $1 ORDER BY created_at",
                                        job_id)
        handle = h.client.get_workflow_handle(export_workflow_id(job_id), result_type=ExportResult)
        try:
            result = await asyncio.wait_for(handle.result(), timeout=45)
        except TimeoutError:
            described = await handle.describe()
            raise AssertionError(
                "row is Stopped, but the waiting run was not woken within 45 s (idle recheck is "
                f"{h.settings.idle_recheck_seconds:g} s); its ExportStatus still says "
                f"{described.typed_search_attributes.get(EXPORT_STATUS)!r}; outbox rows: "
                f"{[r['kind'] for r in outbox]}") from None
        assert result.status is Status.STOPPED
