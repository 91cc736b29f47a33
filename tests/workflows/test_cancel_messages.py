"""Cancel messages an operator or a script gets wrong, and a cancel Update that comes early (LD7): a `cancel` or
`wake` signal with no payload or two (the UI's or `temporal workflow signal` without `--input`), an Update in a
run's first workflow task (sent right after the start, or to a run that has just continued as new), and one
request ID sent by two operators. Each was seen failing: the first stalled the run for good (every retry of its
workflow task met the same signal), the second was refused ("send the cancel signal"), the third was answered
from the run's memory by request ID alone, not as the row records it. And Temporal's own cancel of a run that has
not read its row yet: it was lost when the run continued as new before the read, and, with the patch
`cancel-before-continuing-as-new` off, when one workflow task brought it with signals."""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from contextlib import AsyncExitStack

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowUpdateFailedError, WorkflowUpdateStage
from temporalio.common import Priority
from temporalio.service import RPCError

from activities.contracts import TEMPORAL_CANCEL_OPERATOR, ExportInput, ExportResult
from starter.localstack.temporal import temporal_binary
from store.db import asyncpg_dsn
from store.models import CancellationResult, Status
from tests.helpers.harness import open_harness
from tests.helpers.own_temporal import own_server
from tests.helpers.standins import WITH_CANCEL_UPDATE, cancel_update_alone, temporal_cancel_before_the_row
from tests.helpers.store_states import drive
from tests.helpers.support import eventually, lock_row, unlock_row
from tests.workflows.test_cancel_update import EARLY, _request, _waiting_run
from worker import running_worker
from workflows.identity import export_workflow_id

BOUND = 60.0



async def _task_failures(handle) -> list[str]:
    return [e.workflow_task_failed_event_attributes.failure.message
            for e in (await handle.fetch_history()).events
            if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED]


async def _answered(h, handle, request_id: uuid.UUID | None = None) -> CancellationResult:
    """The cancel Update's answer; without one, the failure names the run's failed workflow tasks (the stall)."""
    try:
        return await asyncio.wait_for(handle.execute_update(
            "cancel", _request(h, request_id), result_type=CancellationResult), timeout=BOUND)
    except (TimeoutError, WorkflowUpdateFailedError, RPCError) as exc:
        failures = await _task_failures(handle)
        pytest.fail(f"the cancel Update got no answer ({exc!r}); workflow task failures: {failures[:1]}")


async def _terminated(handle) -> None:
    try:
        await handle.terminate("test over")
    except RPCError:
        pass


@pytest.mark.spec("LD7")
@pytest.mark.parametrize("args", [[], [{"request_id": "a"}, {"request_id": "b"}]], ids=["no-input", "two-inputs"])
async def test_a_cancel_signal_with_the_wrong_number_of_inputs_is_refused_and_the_next_cancel_still_records(
        db, store, client, tmp_path, args):
    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path, dispatcher=False, early_patches=EARLY)
        job_id, handle = await _waiting_run(h)
        stack.push_async_callback(_terminated, handle)
        await handle.signal("cancel", args=args)
        request_id = uuid.uuid4()
        await handle.signal("cancel", _request(h, request_id))
        try:
            row = await eventually(lambda: h.store.read_job(job_id), lambda r: r.stop_request_id is not None,
                                   timeout=30, interval=0.2, what="the valid cancel after the bad one")
        except (AssertionError, TimeoutError) as exc:
            failures = await _task_failures(handle)
            pytest.fail(f"the valid cancel was never recorded; workflow task failures: {failures[:1]} ({exc})")
        assert row.stop_request_id == request_id
        # and the Update path is still open
        assert (await _answered(h, handle)).outcome.value == "StopAlreadyRequested"
        assert await _task_failures(handle) == []


@pytest.mark.spec("LD7")
async def test_a_wake_signal_with_no_input_does_not_stall_the_run(db, store, client, tmp_path):
    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path, dispatcher=False, early_patches=EARLY)
        _, handle = await _waiting_run(h)
        stack.push_async_callback(_terminated, handle)
        await handle.signal("wake")
        assert (await _answered(h, handle)).outcome.value == "StopRequested"


@pytest.mark.spec("LD7")
async def test_the_temporal_cli_signal_without_input_does_not_stall_the_run(db, store, client, tmp_path):
    """As an operator types it: `temporal workflow signal --name cancel` and forgets `--input`."""
    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path, dispatcher=False, early_patches=EARLY)
        _, handle = await _waiting_run(h)
        stack.push_async_callback(_terminated, handle)
        done = await asyncio.to_thread(subprocess.run, [
            temporal_binary(), "workflow", "signal", "--address", client.service_client.config.target_host,
            "--namespace", client.namespace, "--workflow-id", handle.id, "--name", "cancel"],
            capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done
        assert (await _answered(h, handle)).outcome.value == "StopRequested"


@pytest.mark.spec("LD7")
async def test_a_cancel_update_in_the_runs_first_workflow_task_is_taken(db, store, client, tmp_path):
    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path, dispatcher=False, in_process_worker=False,
                               early_patches=EARLY)
        job_id = uuid.uuid4()
        await h.store.create_job(job_id=job_id, tenant_id=h.tenant_id, destination_id=h.destination_id,
                                 delivery_key=f"k{job_id.hex[:12]}", created_by="tests")
        await drive(h.store, job_id, Status.RUNNING)
        handle = await client.start_workflow("ExportWorkflow", ExportInput(job_id=job_id),
                                             id=export_workflow_id(job_id), task_queue=h.settings.task_queue,
                                             result_type=ExportResult, priority=Priority(fairness_key=str(h.tenant_id)))
        stack.push_async_callback(_terminated, handle)
        request_id = uuid.uuid4()
        # The operator's Update, sent before any worker has taken the run's first task.
        update = asyncio.ensure_future(handle.execute_update("cancel", _request(h, request_id),
                                                              result_type=CancellationResult))
        await asyncio.sleep(2.0)
        async with running_worker(h.settings, client, with_dispatcher=False):
            try:
                answer = await asyncio.wait_for(update, timeout=BOUND)
            except WorkflowUpdateFailedError as err:
                raise AssertionError(f"the run refused the Update: {err.cause!r}") from err
            assert answer.request_id == request_id and answer.outcome.value == "StopRequested", answer


def _as(h, request_id, operator):
    return {**_request(h, request_id), "operator": operator}


async def _recorded(h, request_id):
    return await h.db.admin.fetchrow("SELECT requested_by, outcome FROM cancellation_requests WHERE id = $1",
                                     request_id)


@pytest.mark.spec("LD7")
async def test_a_request_id_reused_by_another_operator_is_answered_as_the_row_answers_it(db, store, client, tmp_path):
    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path, dispatcher=False, early_patches=EARLY)
        job_id, handle = await _waiting_run(h)
        stack.push_async_callback(_terminated, handle)
        x = uuid.uuid4()
        first = await asyncio.wait_for(handle.execute_update("cancel", _as(h, x, "ann@example.com"),
                                                             result_type=CancellationResult), timeout=BOUND)
        assert first.outcome.value == "StopRequested", first
        # What the row says to the same request ID from another operator (as `exports cancel` asks it):
        by_row = await h.store.request_cancellation(tenant_id=h.tenant_id, job_id=job_id, request_id=x,
                                                    requested_by="mallory@example.com", reason=None)
        assert by_row.outcome.value == "RequestIdReused", by_row
        by_run = await asyncio.wait_for(handle.execute_update("cancel", _as(h, x, "mallory@example.com"),
                                                              result_type=CancellationResult), timeout=BOUND)
        assert by_run.outcome == by_row.outcome, f"the run answered {by_run.outcome}, the row {by_row.outcome}"


@pytest.mark.spec("LD7")
async def test_the_operator_whose_request_was_recorded_is_not_told_it_was_reused(db, store, client, tmp_path):
    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path, dispatcher=False, early_patches=EARLY)
        job_id, handle = await _waiting_run(h)
        stack.push_async_callback(_terminated, handle)
        locker = await lock_row(asyncpg_dsn(h.db.url("owner")), job_id)
        try:
            # Another request keeps the run's recording step busy (the row is locked), so the next two wait together.
            await handle.signal("cancel", _as(h, uuid.uuid4(), "carl@example.com"))
            await asyncio.sleep(0.1)
            x = uuid.uuid4()
            ann = await handle.start_update("cancel", _as(h, x, "ann@example.com"), result_type=CancellationResult,
                                            wait_for_stage=WorkflowUpdateStage.ACCEPTED)
            mallory = await handle.start_update("cancel", _as(h, x, "mallory@example.com"),
                                                result_type=CancellationResult,
                                                wait_for_stage=WorkflowUpdateStage.ACCEPTED)
            # (the test settings' lock_timeout is 0.5 s: both are answered Busy together, and asked again together)
            await asyncio.sleep(1.5)
        finally:
            await unlock_row(locker)
        ann_answer = await asyncio.wait_for(ann.result(), timeout=BOUND)
        mallory_answer = await asyncio.wait_for(mallory.result(), timeout=BOUND)
        record = await _recorded(h, x)
        assert record is not None
        assert record["requested_by"] == "ann@example.com", record
        # ann's request is the one recorded: her answer must be its recorded outcome.
        assert ann_answer.outcome.value == record["outcome"], (
            f"ann told {ann_answer.outcome.value}, recorded {record['outcome']} for her; "
            f"mallory told {mallory_answer.outcome.value}")


@pytest.mark.spec("LD7")
async def test_a_temporal_cancel_before_the_row_is_read_is_not_lost_when_the_run_continues_as_new(tmp_path):
    """Temporal's cancel becomes a stop request once the run knows its row (its tenant). A run whose claim failed
    has not read it, and waits for a wake-up; there it continues as new once Temporal suggests it. It did so with
    the cancel not yet a request, and the new run never heard of it: the export went on as if never cancelled. Now
    a run with such a cancel pending does not continue as new until the cancel is recorded. (The worker activates
    the patch of the next test with the Update's: a loaded worker may take the cancel in one task with the first
    signals, which that patch is for.)"""
    async with own_server(tmp_path, {"limit.historyCount.suggestContinueAsNew": 20}) as client:
        run = await temporal_cancel_before_the_row(client)
    assert run.recorded == [TEMPORAL_CANCEL_OPERATOR], (run.recorded, run.runs)


@pytest.mark.spec("LD7", "TW7")
@pytest.mark.parametrize("branch", [True, False], ids=["branch", "cancel-update-alone"])
async def test_a_temporal_cancel_in_one_workflow_task_with_signals_is_not_lost_when_the_run_continues_as_new(
        tmp_path, branch):
    """The same cancel, reaching the run in one workflow task with the signals that make Temporal suggest
    continuing as new (sent while the worker was away). The SDK runs a task's signal handlers, and checks the run's
    wait conditions, before it applies the task's cancel: the run continued as new in that check, and the cancel,
    applied after it, was lost with the run. Seen failing in a CI run, where a loaded worker took the cancel and
    the first signals in one task. With the patch `cancel-before-continuing-as-new` (which comes with
    `cancel-update`) the run checks again after a timer, and the cancel is recorded; a worker that activated
    `cancel-update` alone, as before, keeps the commands it recorded and writes no marker."""
    activates = WITH_CANCEL_UPDATE if branch else cancel_update_alone
    async with own_server(tmp_path, {"limit.historyCount.suggestContinueAsNew": 20}) as client:
        run = await temporal_cancel_before_the_row(client, activates=activates, cancel_comes="with-signals")
    assert run.marked is branch, (run.recorded, run.runs)
    if branch:
        assert run.recorded == [TEMPORAL_CANCEL_OPERATOR], (run.recorded, run.runs)
    else:
        # Continued as new at once, the cancel lost (the next run may continue as new too, with the row read).
        assert run.recorded == [] and run.runs >= 2, (run.recorded, run.runs)


@pytest.mark.spec("LD7", "TW7")
async def test_a_temporal_cancel_that_comes_with_the_end_of_the_pause_before_continuing_as_new_is_not_lost(tmp_path):
    """The run with the patch waits a moment before it continues as new; the same cancel may reach it in the task
    that ends that pause. The SDK resumes the run's steps in the order the task's jobs came: a check made as the
    pause ends may come before the cancel is applied. The check is made once every job of the task has run."""
    async with own_server(tmp_path, {"limit.historyCount.suggestContinueAsNew": 20}) as client:
        run = await temporal_cancel_before_the_row(client, cancel_comes="with-the-pause")
    assert run.marked
    assert run.recorded == [TEMPORAL_CANCEL_OPERATOR], (run.recorded, run.runs)
