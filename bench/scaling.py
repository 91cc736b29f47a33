"""S1: how exports/s grows with worker processes: 200 small exports at once with 1, 2 and 4 worker processes
against one Temporal dev server and one PostgreSQL, each against the single process measured in the same run.

Not a goal of its own: it says where the limit is on this machine (docs: README, "Deploying").
"""

from __future__ import annotations

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from bench.stack import full_stack
from bench.table import Row, middle
from bench.throughput import exports_per_second
from starter.client import ExportsClient
from store.db import make_engine
from store.jobs import JobStore


async def _rate_with(workers: int, *, exports: int, rounds: int) -> float:
    async with full_stack(f"scaling-{workers}", contacts=100) as stack:
        settings = stack.settings(task_queue="bench-exports")
        for _ in range(workers):
            await stack.spawn("worker", settings=settings)
        client = await Client.connect(stack.temporal.address, data_converter=pydantic_data_converter)
        engine = make_engine(stack.postgres.url("app"))
        exports_client = ExportsClient(JobStore(engine, lease_seconds=settings.lease_seconds), client,
                                       task_queue=settings.task_queue)
        try:
            rates = []
            for _ in range(rounds):
                rate, _sample = await exports_per_second(exports_client, stack.admin, stack.tenant,
                                                         stack.destination, exports)
                rates.append(rate)
        finally:
            await engine.dispose()
    return middle(rates)


async def measure(*, exports: int, rounds: int, workers: tuple[int, ...] = (2, 4)) -> list[Row]:
    one = await _rate_with(1, exports=exports, rounds=rounds)
    return [Row("S1", f"exports/s, {exports} at once, {n} worker processes", "/s", await _rate_with(
                n, exports=exports, rounds=rounds), one, "1 worker process", "") for n in workers]
