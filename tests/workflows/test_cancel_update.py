"""The cancel path no flood can close (LD7): a `cancel` Update beside the `cancel` signal. The server takes a bounded
number of signals per run (history.maximumSignalsPerExecution, 10,000 by default) and refuses every signal after
that, valid or not; an Update is validated by the workflow before it enters the history, so a malformed one is
refused to its sender and costs the run nothing, and a valid one is answered with the outcome recorded.

The Update ships as a patch this release understands and the next activates (workflows/patches.py): here the
worker activates it early (EXPORTS_EARLY_PATCHES), as the next release will by default, and one test shows what
this release's defaults answer."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowQueryFailedError, WorkflowUpdateFailedError
from temporalio.common import Priority
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import PatchActivationInput

from activities.contracts import ExportInput, ExportResult
from store.db import asyncpg_dsn
from store.models import CancellationResult, Status
from store.settings import Settings
from tests.helpers.crash import crash_world, processes, start_worker
from tests.helpers.harness import Harness, open_harness
from tests.helpers.own_temporal import own_server, spend_signal_quota
from tests.helpers.store_states import drive
from tests.helpers.support import EXPORTS, eventually, lock_row, unlock_row
from workflows import patches
from workflows.identity import export_workflow_id

BOUND = 60.0
# The server's cap on signals per run, lowered so that the test reaches it in seconds rather than minutes.
SIGNAL_CAP = 40
# For the run that continues as new: Temporal suggests it after this many events, fewer than the cap on signals (as
# with the server's defaults, 4,096 and 10,000), so that signals alone bring the suggestion however many of them a
# busy worker takes in one workflow task; the rest of the cap is the margin for that task's round trip, and for a
# new run's start and first read. 170 signals of margin were once too few on a loaded CI machine (the server's
# defaults leave about 6,000).
SUGGEST_AFTER = 30
FLOOD_CAP = 400
# The server's quota of Updates per run (history.maxTotalUpdates, 2,000 by default), lowered likewise.
UPDATE_CAP = 20
EARLY = patches.CANCEL_UPDATE
_WORKFLOW_TASK = {EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED, EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED,
                  EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED}


async def _waiting_run(h: Harness):
    """An export held Running by an attempt of the test's: its run only waits, and serves cancellations."""
    job_id = uuid.uuid4()
    await h.store.create_job(job_id=job_id, tenant_id=h.tenant_id, destination_id=h.destination_id,
                             delivery_key=f"k{job_id.hex[:12]}", created_by="tests")
    await drive(h.store, job_id, Status.RUNNING)
    # Keyed to its tenant, as the dispatcher and the client package start every run.
    handle = await h.client.start_workflow("ExportWorkflow", ExportInput(job_id=job_id), id=export_workflow_id(job_id),
                                           task_queue=h.settings.task_queue, result_type=ExportResult,
                                           priority=Priority(fairness_key=str(h.tenant_id)))
    # Ready once the run has read its row: a flood sent sooner meets the run's first workflow task, which loads the
    # workflow's module (a second or so) while the signals pile up.
    await _until_row_read(handle)
    return job_id, handle


def _request(h: Harness, request_id: uuid.UUID | None = None) -> dict[str, str]:
    return {"request_id": str(request_id or uuid.uuid4()), "tenant": str(h.tenant_id),
            "operator": "ann@example.com", "reason": "wrong list"}


async def _events(handle, kind: EventType.ValueType) -> int:
    return sum(1 for e in (await handle.fetch_history()).events if e.event_type == kind)


@pytest.mark.spec("LD7")
async def test_past_the_servers_signal_cap_an_operator_still_cancels_by_update_and_junk_updates_cost_nothing(
        db, store, tmp_path, monkeypatch):
    async with own_server(tmp_path, {"history.maximumSignalsPerExecution": SIGNAL_CAP}) as client:
        async with AsyncExitStack() as stack:
            h = await open_harness(stack, db, store, client, tmp_path, dispatcher=False, early_patches=EARLY)
            job_id, handle = await _waiting_run(h)
            try:
                # The flood: malformed cancels until the server refuses signals to this run.
                refused = await spend_signal_quota(handle, 2 * SIGNAL_CAP)
                assert "signal" in str(refused).lower(), refused
                with pytest.raises(RPCError):  # the signal path is closed to a valid cancel too
                    await handle.signal("cancel", _request(h))

                # Junk sent as an Update is refused to its sender, saying what is wrong, and enters no history.
                before = len((await handle.fetch_history()).events)
                for junk in ({"request_id": "junk"}, "not even an object", {**_request(h), "tenant": "x"}):
                    with pytest.raises(WorkflowUpdateFailedError) as refused_update:
                        await handle.execute_update("cancel", junk, result_type=CancellationResult)
                    assert "nothing recorded" in str(refused_update.value.cause), refused_update.value.cause
                # (the run's last workflow task for the flood may still complete meanwhile: nothing else is new)
                after = (await handle.fetch_history()).events[before:]
                assert all(e.event_type in _WORKFLOW_TASK for e in after), [e.event_type for e in after]

                # A valid Update records the request and answers with its outcome; asked again, the same answer,
                # without recording it again.
                request_id = uuid.uuid4()
                answer = await asyncio.wait_for(
                    handle.execute_update("cancel", _request(h, request_id), result_type=CancellationResult),
                    timeout=BOUND)
                assert answer.request_id == request_id and answer.outcome.value == "StopRequested", answer
                recorded = await h.db.admin.fetch("SELECT id, outcome FROM cancellation_requests WHERE job_id = $1",
                                                  job_id)
                assert [(r["id"], r["outcome"]) for r in recorded] == [(request_id, "StopRequested")]
                scheduled = await _events(handle, EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED)
                again = await asyncio.wait_for(
                    handle.execute_update("cancel", _request(h, request_id), result_type=CancellationResult),
                    timeout=BOUND)
                assert again == answer
                assert await _events(handle, EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED) == scheduled
                row = await eventually(lambda: h.store.read_job(job_id), lambda r: r.stop_request_id is not None,
                                       timeout=BOUND, interval=0.2, what="the stop on the row")
                assert row.stop_request_id == request_id, row
            finally:
                await handle.terminate("test over")


@pytest.mark.spec("LD7")
async def test_another_tenants_cancel_updates_during_a_build_are_refused_unrecorded_and_never_use_up_the_quota(
        db, store, tmp_path):
    """The server takes a bounded number of Updates into one run (history.maxTotalUpdates) and refuses every one
    after that; a run in the middle of an attempt cannot continue as new to renew it. A well-formed request for
    another tenant is junk: were it accepted (the row answers it NotFound), a few thousand of them during a build
    would close the operator's path. The validator refuses it, so it never enters the history."""
    async with own_server(tmp_path, {"history.maxTotalUpdates": UPDATE_CAP}) as client:
        async with AsyncExitStack() as stack:
            # A build long enough for the whole flood: a stop ends it, through the database, within a second.
            h = await open_harness(stack, db, store, client, tmp_path, early_patches=EARLY, contacts=2000,
                                   build_throttle_bytes_per_second=1_000)
            job_id = await h.create()
            await eventually(lambda: h.store.read_job(job_id), lambda r: r.status is Status.RUNNING, timeout=BOUND,
                             interval=0.1, what="the build running")
            handle = client.get_workflow_handle(export_workflow_id(job_id), result_type=ExportResult)
            # The run's own read of the row too: an Update that comes with the activity's result that brings the row
            # is validated before the run takes that result in, when it cannot yet tell the tenant.
            await _until_row_read(handle)
            try:
                async def building() -> bool:
                    return (await h.store.read_job(job_id)).status is Status.RUNNING

                request_id, answer = await _another_tenants_flood_then_the_operators_cancel(h, job_id, handle,
                                                                                           building)
                assert answer.outcome.value == "StopRequested", answer
                result = await asyncio.wait_for(handle.result(), timeout=BOUND)
                assert result.status is Status.STOPPED, result
                row = await h.store.read_job(job_id)
                assert row.stop_request_id == request_id, row
            finally:
                try:
                    await handle.terminate("test over")
                except RPCError:
                    pass  # it had ended


@pytest.mark.spec("LD7")
async def test_another_tenants_cancel_updates_while_the_claim_waits_for_a_build_slot_are_refused_by_the_starts_tenant(
        db, store, tmp_path):
    """Under load, a claim waits (up to an hour) for a worker with a build slot free, and only its result brings the
    run its row. Meanwhile the tenant the run was started for (its fairness key, which the dispatcher sets) judges a
    cancel Update: another tenant's is refused and never uses up the quota; the tenant's own is recorded."""
    async with own_server(tmp_path, {"history.maxTotalUpdates": UPDATE_CAP}) as client:
        async with AsyncExitStack() as stack:
            # One build slot, held by a slow build: the next export's claim waits for it.
            h = await open_harness(stack, db, store, client, tmp_path, early_patches=EARLY, contacts=2000,
                                   build_throttle_bytes_per_second=1_000, max_builds=1)
            busy = await h.create()
            await eventually(lambda: h.store.read_job(busy), lambda r: r.status is Status.RUNNING, timeout=BOUND,
                             interval=0.1, what="the slow build holding the only slot")
            job_id = await h.create()
            handle = client.get_workflow_handle(export_workflow_id(job_id), result_type=ExportResult)
            handles = [client.get_workflow_handle(export_workflow_id(busy)), handle]
            try:
                await eventually(lambda: _described(handle), lambda d: d is not None, timeout=BOUND, interval=0.1,
                                 what="the waiting export's run started")
                await asyncio.sleep(1.0)  # its claim scheduled, and waiting
                async def unread() -> bool:
                    return await handle.query("row") is None

                assert await unread()  # the run has not read its row
                request_id, answer = await _another_tenants_flood_then_the_operators_cancel(h, job_id, handle, unread)
                assert answer.outcome.value == "CanceledWhileQueued", answer
                row = await h.store.read_job(job_id)
                assert (row.status, row.cancellation_request_id) == (Status.CANCELED, request_id), row
            finally:
                for each in handles:
                    try:
                        await each.terminate("test over")
                    except RPCError:
                        pass  # it had ended


async def _another_tenants_flood_then_the_operators_cancel(
        h: Harness, job_id: uuid.UUID, handle, still: Callable[[], Awaitable[bool]]
) -> tuple[uuid.UUID, CancellationResult]:
    """As many well-formed cancel Updates for other tenants as the server's quota (lowered to UPDATE_CAP), while
    `still` holds, then the operator's own: each junk one refused unrecorded, the operator's the only one accepted
    and the only request recorded. The operator's request ID and its answer."""
    answered, refused = [], []
    for _ in range(UPDATE_CAP):
        junk = {**_request(h), "tenant": str(uuid.uuid4())}
        try:
            answered.append(await asyncio.wait_for(
                handle.execute_update("cancel", junk, result_type=CancellationResult), timeout=BOUND))
        except WorkflowUpdateFailedError as err:
            refused.append(err.cause)
        except RPCError as err:  # the server's quota: the path closed
            refused.append(err)
    assert await still(), "the flood came too late"
    request_id = uuid.uuid4()
    answer = await asyncio.wait_for(
        handle.execute_update("cancel", _request(h, request_id), result_type=CancellationResult), timeout=BOUND)
    assert answered == [], f"{len(answered)} of {UPDATE_CAP} accepted, the first {answered[0]}"
    assert all("nothing recorded" in str(c) and getattr(c, "type", None) == "CancelExportNotFound"
               for c in refused), refused
    accepted = await _events(handle, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED)
    assert accepted == 1, accepted  # the operator's alone
    recorded = await h.db.admin.fetch("SELECT id FROM cancellation_requests WHERE job_id = $1", job_id)
    assert [r["id"] for r in recorded] == [request_id]
    return request_id, answer


async def _row_read(handle):
    """The run's `row` query; None also while the run cannot answer yet (its first workflow task not done)."""
    try:
        return await handle.query("row")
    except (RPCError, WorkflowQueryFailedError):
        return None


async def _until_row_read(handle) -> None:
    await eventually(lambda: _row_read(handle), lambda row: row is not None, timeout=BOUND, interval=0.1,
                     what="the run's first read of its row")


async def _described(handle):
    try:
        return await handle.describe()
    except RPCError as err:
        if err.status is RPCStatusCode.NOT_FOUND:
            return None
        raise


@pytest.mark.spec("LD7")
async def test_this_release_refuses_cancel_updates_until_the_next_activates_them_and_writes_no_marker(
        db, store, client, tmp_path):
    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path, dispatcher=False)
        job_id, handle = await _waiting_run(h)
        try:
            with pytest.raises(WorkflowUpdateFailedError) as refused:
                await handle.execute_update("cancel", _request(h), result_type=CancellationResult)
            assert "send the cancel signal" in str(refused.value.cause), refused.value.cause
            await handle.signal("cancel", _request(h))  # the signal path is the one this release opens
            await eventually(lambda: h.db.admin.fetchval(
                "SELECT count(*) FROM cancellation_requests WHERE job_id = $1", job_id), lambda n: n == 1,
                timeout=BOUND, interval=0.2, what="the signalled cancel recorded")
            history = await handle.fetch_history()
            kinds = {e.event_type for e in history.events}
            markers = [e.marker_recorded_event_attributes.SerializeToString() for e in history.events
                       if e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED]
            assert markers and not any(patches.CANCEL_UPDATE.encode() in m for m in markers)
            assert EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED not in kinds
        finally:
            await handle.terminate("test over")


@pytest.mark.spec("LD7")
async def test_many_valid_cancels_are_recorded_together_not_one_step_each(db, store, client, tmp_path):
    requests = 150
    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path, dispatcher=False, early_patches=EARLY)
        job_id, handle = await _waiting_run(h)
        try:
            await asyncio.gather(*(handle.signal("cancel", _request(h)) for _ in range(requests)))
            await eventually(lambda: h.db.admin.fetchval(
                "SELECT count(*) FROM cancellation_requests WHERE job_id = $1", job_id), lambda n: n == requests,
                timeout=BOUND, interval=0.2, what="every request recorded")
            history = await handle.fetch_history()
            steps = [e.activity_task_scheduled_event_attributes.activity_type.name for e in history.events
                     if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED]
            recorded_by = [name for name in steps if name.startswith("record_cancellation")]
            assert recorded_by and set(recorded_by) == {"record_cancellations"}, steps
            assert len(recorded_by) <= requests // 10, f"{len(recorded_by)} steps for {requests} requests"
        finally:
            await handle.terminate("test over")


@pytest.mark.spec("LD7")
async def test_a_waiting_run_flooded_with_signals_continues_as_new_and_never_reaches_the_servers_cap(
        db, store, tmp_path, monkeypatch):
    """Past the history length at which Temporal suggests it, a run between attempts continues as new: its
    history stays bounded, and a fresh run takes signals again, so the flood never closes the signal path."""
    async with own_server(tmp_path, {"history.maximumSignalsPerExecution": FLOOD_CAP,
                                      "limit.historyCount.suggestContinueAsNew": SUGGEST_AFTER}) as client:
        async with AsyncExitStack() as stack:
            h = await open_harness(stack, db, store, client, tmp_path, dispatcher=False, early_patches=EARLY)
            job_id, handle = await _waiting_run(h)
            latest = client.get_workflow_handle(export_workflow_id(job_id))
            try:
                for n in range(FLOOD_CAP * 3 // 2):  # would be refused from the cap on, were it one run
                    await latest.signal("cancel", {"request_id": f"junk {n}"})
                first = await client.get_workflow_handle(handle.id, run_id=handle.result_run_id).describe()
                assert first.status.name == "CONTINUED_AS_NEW", first.status
                runs = [w async for w in client.list_workflows(f"WorkflowId = '{export_workflow_id(job_id)}'")]
                assert len(runs) >= 3, [r.status for r in runs]
                # Each continued run keeps its start's fairness key, by which the cancel Update's validator judges a
                # tenant until the run has read its row.
                keys = {(await client.get_workflow_handle(r.id, run_id=r.run_id).describe())
                        .raw_description.workflow_execution_info.priority.fairness_key for r in runs}
                assert keys == {str(h.tenant_id)}, keys
                most = max([sum(e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED for e in
                                (await client.get_workflow_handle(r.id, run_id=r.run_id).fetch_history()).events)
                            for r in runs])
                # Continued as new before the cap, which counts a run's signals: alone, it would take FLOOD_CAP.
                # (Its events, the workflow tasks' too, may pass FLOOD_CAP: the run pauses 1 s before continuing.)
                assert most < FLOOD_CAP, most
                request_id = uuid.uuid4()
                await latest.signal("cancel", _request(h, request_id))
                row = await eventually(lambda: h.store.read_job(job_id), lambda r: r.stop_request_id is not None,
                                       timeout=BOUND, interval=0.2, what="the stop on the row")
                assert row.stop_request_id == request_id, row
            finally:
                await latest.terminate("test over")


@pytest.mark.parametrize("within", [patches.CANCEL_BEFORE_CONTINUING_AS_NEW,
                                    patches.PAUSE_ONCE_BEFORE_CONTINUING_AS_NEW])
def test_the_patch_reached_only_within_the_cancel_update_is_activated_early_with_it(within):
    """`cancel-before-continuing-as-new` and `pause-once-before-continuing-as-new` are reached only by runs that
    took `cancel-update`: a worker that turns that one on early takes each with it; each alone does not bring
    `cancel-update`; by default, neither."""
    assert patches.activation(frozenset({EARLY}))(_asking(within))
    alone = patches.activation(frozenset({within}))
    assert alone(_asking(within)) and not alone(_asking(EARLY))
    assert not patches.activation()(_asking(within))


def test_early_patches_are_only_those_this_release_understands_and_a_wrong_name_is_one_line():
    assert Settings(_env_file=None).early_patch_ids == frozenset()
    assert Settings(_env_file=None, early_patches=f" {EARLY} ,").early_patch_ids == {EARLY}
    activates = patches.activation(Settings(_env_file=None, early_patches=EARLY).early_patch_ids)
    assert activates(_asking(EARLY)) and not patches.activates(_asking(EARLY))
    assert all(activates(_asking(active)) for active in patches.ACTIVE)  # what the release writes anyway
    # A wrong name stops every process at start, in one line, before it does anything.
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("EXPORTS_", "PG"))}
    env = {**clean, "EXPORTS_EARLY_PATCHES": f"{EARLY},policy-and-claim,no-such-patch",
           "EXPORTS_OWNER_DATABASE_URL": "postgresql+asyncpg://x@127.0.0.1:1/y"}
    done = subprocess.run([str(EXPORTS), "migrate"], capture_output=True, text=True, timeout=60,
                          cwd=tempfile.gettempdir(), env=env)
    assert done.returncode == 2, done
    assert done.stderr.startswith("error: setting EXPORTS_EARLY_PATCHES") and len(done.stderr.splitlines()) == 1
    assert "no-such-patch, policy-and-claim: not a patch this release can activate early" in done.stderr, done.stderr


def _asking(patch_id: str) -> PatchActivationInput:
    return PatchActivationInput(workflow_info=None, patch_id=patch_id)  # type: ignore[arg-type]


@pytest.mark.spec("LD7")
async def test_a_flood_that_piled_up_while_the_worker_was_paused_is_taken_in_one_task_and_the_next_cancel_records(
        db, store, client, tmp_path):
    """Signals sent while the only worker is stopped reach the run together, in one workflow task: thousands of
    handlers in one activation must stay inside the SDK's deadlock bound (2 s without yielding), or the task fails
    on every retry and the run never moves again. The refusals are logged a line per workflow task, not a line
    each: a line each was a third of such an activation's time (and a flood of log lines). A real worker process;
    SIGSTOP is a real pause. (A pile the size of the server's default cap, 10,000, is measured by `make bench`'s
    C2 and in docs/operating.md: sending that many to a paused worker took longer than a workflow task's timeout
    under CI's load, which split the pile.)"""
    flood = 3000
    async with crash_world(db, store, client, tmp_path, lease_seconds=30, renew_every_seconds=5) as h, \
            processes(h) as started:
        worker = await start_worker(started, h)
        job_id, handle = await _waiting_run(h)
        try:
            await eventually(lambda: handle.describe(), lambda d: d.raw_description.pending_workflow_task is None
                             or not d.raw_description.pending_workflow_task.ListFields(), timeout=BOUND,
                             interval=0.2, what="the run at rest")
            worker.process.send_signal(signal.SIGSTOP)
            try:
                senders = asyncio.Semaphore(50)

                async def send(n: int) -> None:
                    async with senders:
                        await handle.signal("cancel", {"request_id": f"junk {n}"})

                await asyncio.wait_for(asyncio.gather(*(send(n) for n in range(flood))), timeout=BOUND)
                request_id = uuid.uuid4()
                await handle.signal("cancel", _request(h, request_id))
            finally:
                worker.process.send_signal(signal.SIGCONT)
            row = await eventually(lambda: h.store.read_job(job_id), lambda r: r.stop_request_id is not None,
                                   timeout=BOUND, interval=0.2, what="the cancel after the pile recorded")
            assert row.stop_request_id == request_id, row
            log = worker.log_path.read_text(errors="replace")
            assert "TMPRL1101" not in log and "deadlock" not in log.lower(), "a workflow task took too long"
            refusals = [line for line in log.splitlines() if "rejected, nothing recorded" in line]
            assert 1 <= len(refusals) <= 10, f"{len(refusals)} log lines for {flood} refused signals"
            assert f"({flood} refused by this run" in refusals[-1], refusals[-1]
            # The pile was real: most of the flood reached the run in one workflow task.
            pile, largest = 0, 0
            for event in (await handle.fetch_history()).events:
                if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
                    pile += 1
                elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED:
                    largest, pile = max(largest, pile), 0
            assert largest >= flood // 2, largest
        finally:
            await handle.terminate("test over")


@pytest.mark.spec("LD7")
async def test_a_cancel_update_retried_with_its_request_id_after_busy_is_asked_of_the_row_again(
        db, store, client, tmp_path):
    """Busy records nothing, and the answer says to send the same request again. The run kept the Busy answer and
    gave it to the same request asked again, without a step: once the row was free, the operator's retry was
    still Busy, for good (found by review)."""
    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path, dispatcher=False, early_patches=EARLY,
                               lock_timeout_ms=200)
        job_id, handle = await _waiting_run(h)
        locker = await lock_row(asyncpg_dsn(h.db.url("owner")), job_id)
        try:
            request_id = uuid.uuid4()
            first = await asyncio.wait_for(
                handle.execute_update("cancel", _request(h, request_id), result_type=CancellationResult), BOUND)
            assert first.outcome.value == "Busy", first
            await unlock_row(locker)
            again = await asyncio.wait_for(
                handle.execute_update("cancel", _request(h, request_id), result_type=CancellationResult), BOUND)
            assert again.outcome.value == "StopRequested", again
            assert (await h.store.read_job(job_id)).stop_request_id == request_id
        finally:
            await unlock_row(locker)
            await handle.terminate("test over")


@pytest.mark.spec("LD7")
async def test_a_batch_of_cancel_requests_meeting_a_locked_row_is_answered_busy_within_one_step(
        db, store, client, tmp_path):
    """Requests that waited together are recorded by one step, each under the row lock. With the row locked, each
    waited the lock timeout in turn: 40 of them (1 s each) outlasted the step's 30 s, and the step was retried whole,
    up to ten times, while the requests waited (found by review). Past the first Busy, the rest are answered Busy
    at once, and the run asks them again, as it asks a Busy request alone. (Signals: the server lets 10 Updates
    wait at once, and a run that accepts the Update records signals in batches too.)"""
    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path, dispatcher=False, early_patches=EARLY,
                               lock_timeout_ms=1000)
        job_id, handle = await _waiting_run(h)
        locker = await lock_row(asyncpg_dsn(h.db.url("owner")), job_id)
        try:
            first = _request(h)
            await handle.signal("cancel", first)  # its step waits for the lock while the others come
            for _ in range(40):
                await handle.signal("cancel", _request(h))

            def big_batch_ended(events: list) -> list:
                scheduled = {e.event_id for e in events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
                             and e.activity_task_scheduled_event_attributes.activity_type.name ==
                             "record_cancellations"
                             and e.activity_task_scheduled_event_attributes.input.payloads[0].data.count(
                                 b"request_id") >= 20}
                return [e for e in events if _scheduled_of(e) in scheduled
                        and e.event_type != EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED]

            history = await eventually(handle.fetch_history, lambda hist: bool(big_batch_ended(hist.events)),
                                       timeout=BOUND, interval=0.5, what="a step of 20 requests or more ended")
            ended = big_batch_ended(history.events)[0]
            assert ended.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED, ended
        finally:
            await unlock_row(locker)
            await handle.terminate("test over")


def _scheduled_of(event) -> int | None:
    for field in ("activity_task_completed_event_attributes", "activity_task_timed_out_event_attributes",
                  "activity_task_failed_event_attributes", "activity_task_started_event_attributes"):
        if event.HasField(field):
            return int(getattr(event, field).scheduled_event_id)
    return None
