"""P1's baseline worker, in a process of its own like the project's worker:

- `NoopWorkflow(n)`: n activities that do nothing, one after another, on the workflow's own task queue;
- `ShapedNoopWorkflow(shape)`: no-op activities in an export's shape as Temporal sees it: some on the workflow's
  queue, the rest on a second queue (as the build, cutoff 2 and the delivery run on the building worker's own
  queue), and the same number of workflow tasks that update a search attribute. What no work at all costs in
  that shape: the most any export of that shape could reach on the same server;
- `SignalSinkWorkflow()`: takes `cancel` signals and does nothing with them until `finish`: C2's baseline, what a
  flood of signals costs a worker's memory in the SDK alone (its `taken` query: the signals it took).

    python -m bench.noop_worker <temporal address> <task queue>
"""

from __future__ import annotations

import asyncio
import sys
from datetime import timedelta
from typing import Any

from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.common import SearchAttributeKey
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Worker

# Everything but the workflows is passed through, as the export's contracts and models are: the sandbox imports
# only this module afresh for each run, so a run costs the worker what an export's costs it, not a pydantic
# model (Shape, Settings) built again for each.
with workflow.unsafe.imports_passed_through():
    from activities.process.allocator import configure_allocator
    from activities.process.workflow_code import compile_workflow_modules_once
    from bench.noop_shape import Shape, own_queue
    from store.settings import Settings

# Registered on the local Temporal server for the exports; any keyword attribute would do.
_SHOWN = SearchAttributeKey.for_keyword("ExportStatus")
_TIMEOUT = timedelta(seconds=30)


@activity.defn
async def noop() -> None:
    return None


@workflow.defn
class NoopWorkflow:
    @workflow.run
    async def run(self, activities: int) -> int:
        for _ in range(activities):
            await workflow.execute_activity(noop, start_to_close_timeout=_TIMEOUT)
        return activities


@workflow.defn
class ShapedNoopWorkflow:
    @workflow.run
    async def run(self, shape: Shape) -> int:
        queue = workflow.info().task_queue
        queues = [queue] * shape.on_workflow_queue + [own_queue(queue)] * shape.on_own_queue
        updates = shape.search_attribute_updates
        for step, task_queue in enumerate(queues):
            await workflow.execute_activity(noop, start_to_close_timeout=_TIMEOUT, task_queue=task_queue)
            # Each update in the workflow task that follows an activity, the last ones in the final task.
            if updates and (len(queues) - step <= updates):
                workflow.upsert_search_attributes([_SHOWN.value_set(f"step {step}")])
                updates -= 1
        while updates:
            workflow.upsert_search_attributes([_SHOWN.value_set(f"update {updates}")])
            updates -= 1
        return len(queues)


@workflow.defn
class SignalSinkWorkflow:
    def __init__(self) -> None:
        self._taken = 0
        self._finished = False

    @workflow.signal
    def cancel(self, payload: Any) -> None:
        self._taken += 1

    @workflow.signal
    def finish(self) -> None:
        self._finished = True

    @workflow.query
    def taken(self) -> int:
        return self._taken

    @workflow.run
    async def run(self) -> int:
        await workflow.wait_condition(lambda: self._finished)
        return self._taken


async def main(address: str, task_queue: str) -> None:
    # The export's worker fixes glibc's mmap threshold at start and gives free pages back (C2): the baselines run
    # with the same allocator.
    defaults = Settings.model_construct()
    configure_allocator(defaults.malloc_mmap_threshold_bytes, defaults.malloc_trim_interval_seconds)
    # And it compiles its workflow modules once: so does this one.
    compile_workflow_modules_once({"bench"})
    client = await Client.connect(address, data_converter=pydantic_data_converter)
    workflows = [NoopWorkflow, ShapedNoopWorkflow, SignalSinkWorkflow]
    await asyncio.gather(Worker(client, task_queue=task_queue, workflows=workflows, activities=[noop]).run(),
                         Worker(client, task_queue=own_queue(task_queue), activities=[noop]).run())


if __name__ == "__main__":
    # The workflows of this module imported by its name: the sandbox would load __main__'s from its path, past the
    # compiled code kept above.
    from bench.noop_worker import main as by_name

    asyncio.run(by_name(sys.argv[1], sys.argv[2]))
