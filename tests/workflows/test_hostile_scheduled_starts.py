"""Found by review: a raw start of the scheduled workflows with a broken input, as the Temporal UI's 'start workflow' or
`temporal workflow start` send it. ExportWorkflow takes its input loosely and fails at once (HI3); the recovery
and sweeper workflows take typed inputs, so a payload that does not decode fails the workflow task again and
again: the run stays Running for ever, with no clear error."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError

from tests.helpers.harness import Harness

BOUND = 20.0


@pytest.mark.spec("HI3")
@pytest.mark.parametrize("workflow_type, payload", [
    ("RecoveryWorkflow", {"limit": 0}),
    ("RecoveryWorkflow", "garbage"),
    ("SweeperWorkflow", {}),
])
async def test_a_scheduled_workflow_started_with_a_broken_input_fails_at_once(quiet_harness: Harness,
                                                                             workflow_type: str, payload: object):
    h = quiet_harness
    handle = await h.client.start_workflow(workflow_type, args=[payload], id=f"hostile-{uuid.uuid4().hex[:8]}",
                                           task_queue=h.settings.task_queue)
    try:
        with pytest.raises(WorkflowFailureError):
            await asyncio.wait_for(handle.result(), BOUND)
    except TimeoutError:
        status = (await handle.describe()).status
        await handle.terminate("test cleanup")
        raise AssertionError(f"{workflow_type} started with {payload!r} still {status.name} after {BOUND} s "
                             "(its workflow task fails at every retry: 'Failed decoding arguments')") from None
    assert (await handle.describe()).status is WorkflowExecutionStatus.FAILED
