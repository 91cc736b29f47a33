"""P1's baseline worker: a workflow that runs N activities that do nothing, one after another, in a process of its
own like the project's worker.

    python -m bench.noop_worker <temporal address> <task queue>
"""

from __future__ import annotations

import asyncio
import sys
from datetime import timedelta

from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.worker import Worker


@activity.defn
async def noop() -> None:
    return None


@workflow.defn
class NoopWorkflow:
    @workflow.run
    async def run(self, activities: int) -> int:
        for _ in range(activities):
            await workflow.execute_activity(noop, start_to_close_timeout=timedelta(seconds=30))
        return activities


async def main(address: str, task_queue: str) -> None:
    client = await Client.connect(address)
    await Worker(client, task_queue=task_queue, workflows=[NoopWorkflow], activities=[noop]).run()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
