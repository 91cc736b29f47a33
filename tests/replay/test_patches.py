"""The rule that makes a rollback by one release safe (workflows/patches.py): a patch ships understood, not written,
and the next release activates it. Here, with a workflow of the test's own on the suite's Temporal server: the
release that only understands a patch writes no marker and takes the old branch, and it replays the runs of the
release that activated it, marker and new branch included; the newer release replays the older one's runs too.
"""

from __future__ import annotations

import ast
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from temporalio import workflow
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import PatchActivationInput, Replayer, Worker

from workflows import patches

CHANGE = "demo-change"


@workflow.defn
class ChangedWorkflow:
    @workflow.run
    async def run(self) -> str:
        if workflow.patched(CHANGE):
            await workflow.sleep(timedelta(milliseconds=10))  # the change: one command more
            return "new"
        return "old"


async def run_once(client: Client, activate: bool) -> tuple[str, WorkflowHistory]:
    queue = f"patches-{uuid.uuid4().hex[:8]}"

    def activation(request: PatchActivationInput) -> bool:
        return activate

    async with Worker(client, task_queue=queue, workflows=[ChangedWorkflow], patch_activation_callback=activation):
        handle = await client.start_workflow(ChangedWorkflow.run, id=queue, task_queue=queue)
        result = await handle.result()
    return result, await handle.fetch_history()


def markers(history: WorkflowHistory) -> int:
    return sum(e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED for e in history.events)


@pytest.mark.spec("UP3", "UP5")
async def test_patches__a_release_that_understands_a_patch_replays_the_runs_of_the_one_that_activates_it(client):
    understood, older_run = await run_once(client, activate=False)
    assert understood == "old" and markers(older_run) == 0  # nothing written that an older release cannot replay
    activated, newer_run = await run_once(client, activate=True)
    assert activated == "new" and markers(newer_run) == 1
    # One code, both histories: the rollback (the understanding release meets the newer run) and the upgrade.
    replayer = Replayer(workflows=[ChangedWorkflow], data_converter=pydantic_data_converter)
    for history in (older_run, newer_run):
        assert (await replayer.replay_workflow(history)).replay_failure is None


def patch_ids_in_workflows() -> set[str]:
    """The patch constants that workflows/ passes to workflow.patched or workflow.deprecate_patch."""
    found = set()
    for path in (Path(__file__).resolve().parents[2] / "workflows").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ("patched", "deprecate_patch"):
                argument = node.args[0]
                assert isinstance(argument, ast.Attribute) and isinstance(argument.value, ast.Name) and \
                    argument.value.id == "patches", f"{path.name}: a patch ID not from workflows/patches.py"
                found.add(getattr(patches, argument.attr))
    return found


@pytest.mark.spec("UP5")
def test_patches__every_patch_the_workflows_use_is_listed_active_or_understood():
    used = patch_ids_in_workflows()
    assert not patches.ACTIVE & patches.UNDERSTOOD
    assert used == patches.ACTIVE | patches.UNDERSTOOD, "list each patch in workflows/patches.py: a new one in " \
                                                        "UNDERSTOOD, activated by the next release"
