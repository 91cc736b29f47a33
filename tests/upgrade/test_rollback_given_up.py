"""UP3, LV5: a run that gave a cutoff 2 up, rolled back to 0.2.0, which replays every export run 0.3.0 started or
touched. The read after the give-up (0.3.0's) names the attempt; whatever it finds, the run's commands are those
0.2.0 makes for the same answers. A first fix claimed at once after an unclaimed answer, where 0.2.0 waits for a
wake-up (a timer), and 0.2.0 could not replay the run (found by review); the read now writes the wake-up instead.
The steps are stand-ins: what is replayed is the workflow's own code."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from temporalio import activity
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer, Worker

from activities.contracts import (
    Admission,
    AdmitInput,
    ClaimOutput,
    ClaimResult,
    Evaluation,
    ExportInput,
    ExportResult,
    Wake,
)
from store.models import JobRow, Status
from tests.helpers.releases import ReleaseCode, previous_release, release_code
from tests.helpers.standins import cutoff_2_given_up_steps
from tests.replay.history_files import load
from workflows import patches
from workflows.export import ExportWorkflow
from workflows.identity import admission_queue, export_workflow_id


@pytest.fixture(scope="module")
def previous() -> Iterator[ReleaseCode]:
    with release_code(previous_release()) as code:
        yield code


async def _given_up_history(client: Client, tmp_path: Path, found: Status) -> tuple[Path, list[AdmitInput]]:
    """A 0.3.0 run (stand-in steps): claimed, built, its cutoff 2 failed (Temporal gave it up); the read after the
    give-up finds the row Queued (recovery took the attempt back first), allowed; the claim then finds it Rejected."""
    job_id, tenant_id, destination_id = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    queue = f"given-up-{uuid.uuid4().hex[:8]}"
    reads: list[AdmitInput] = []

    def row(status: Status, attempt: uuid.UUID | None = None) -> JobRow:
        return JobRow(id=job_id, tenant_id=tenant_id, status=status, version=len(reads) + 1,
                      destination_id=destination_id, woken_at=datetime.now(UTC), delivery_key="k",
                      created_by="tests", final_name=f"contacts-{tenant_id}-k.csv", attempt_id=attempt,
                      attempt_count=1 if attempt else 0)

    @activity.defn(name="claim_if_allowed")
    async def claim_if_allowed(request: AdmitInput) -> Admission:
        reads.append(request)
        if len(reads) == 1:
            return Admission(evaluation=Evaluation(row=row(Status.RUNNING, request.attempt_id), allowed=True),
                             claim=ClaimOutput(result=ClaimResult.CLAIMED, worker_task_queue=queue,
                                               lease_seconds=30),
                             attempt=1)
        if request.given_up is not None:
            if found is Status.QUEUED:  # read only, allowed and unclaimed (with a wake-up, sent below)
                return Admission(evaluation=Evaluation(row=row(Status.QUEUED), allowed=True))
            return Admission(evaluation=Evaluation(row=row(Status.RUNNING, request.given_up)))  # marked; waits
        return Admission(evaluation=Evaluation(row=row(Status.REJECTED)))

    async with Worker(client, task_queue=queue, workflows=[ExportWorkflow],
                      activities=[claim_if_allowed, *cutoff_2_given_up_steps(queue)],
                      patch_activation_callback=patches.activates), \
            Worker(client, task_queue=admission_queue(queue), activities=[claim_if_allowed]):
        handle = await client.start_workflow(ExportWorkflow.run, ExportInput(job_id=job_id),
                                             id=export_workflow_id(job_id), task_queue=queue,
                                             result_type=ExportResult)
        # The wake-up: the read's own (a Queued row), or the marked attempt's end (a Running one), as the dispatcher
        # would signal it.
        await asyncio.sleep(2)
        await handle.signal("wake", Wake(message_id=uuid.uuid4()))
        result = await asyncio.wait_for(handle.result(), 60)
        history = await handle.fetch_history()
    assert result.status is Status.REJECTED, result
    path = tmp_path / f"export_cutoff_2_given_up_then_{found.value}.json"
    path.write_text(json.dumps(history.to_json_dict()))
    return path, reads


@pytest.mark.spec("UP3", "LV5")
@pytest.mark.parametrize("found", [Status.QUEUED, Status.RUNNING], ids=["row-queued", "row-running-marked"])
async def test_the_previous_release_replays_a_run_whose_read_after_a_give_up_found_the_row(
        client: Client, tmp_path: Path, previous: ReleaseCode, found: Status):
    path, reads = await _given_up_history(client, tmp_path, found)
    # The path was taken: a read naming the given-up attempt, then a claim on the admission queue.
    assert [r.given_up is not None for r in reads] == [False, True, False], reads
    # This release replays its own run.
    own = await Replayer(workflows=[ExportWorkflow], data_converter=pydantic_data_converter).replay_workflow(
        load(path), raise_on_replay_failure=False)
    assert own.replay_failure is None, own.replay_failure
    # CHANGELOG.md: 0.2.0 replays every export run 0.3.0 started or touched.
    failures = await asyncio.wait_for(previous.replay([path]), 150)
    assert not failures, "\n".join(failures)
