"""P1: exports per second, 200 small exports started at once through Temporal and a real worker process, against
no-op workflows with as many activities per run as an export took, on the same dev server in the same run.

An export's shape is read from one export's workflow history, so the baselines follow the project as its steps
change: its activity count (reported beside the ratio; the goal is at most 4), and which of them run on the
building worker's own queue and how many workflow tasks update search attributes. A no-op workflow of that same
shape is measured too: it says what the shape alone costs the server, the ceiling for any export of that shape.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from bench.noop_shape import Shape
from bench.stack import full_stack
from bench.table import Row, middle
from starter.client import ExportsClient
from store.db import make_engine
from store.jobs import JobStore
from workflows.identity import export_workflow_id


async def shape_of(client: Client, workflow_id: str) -> Shape:
    """Activities by task queue, and the workflow tasks whose commands update search attributes."""
    history = await client.get_workflow_handle(workflow_id).fetch_history()
    queue = history.events[0].workflow_execution_started_event_attributes.task_queue.name
    own = shared = updating = 0
    updated_in_this_task = False
    for e in history.events:
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
            updated_in_this_task = False
        elif e.event_type == EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES and not updated_in_this_task:
            updated_in_this_task = True
            updating += 1
        elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            if e.activity_task_scheduled_event_attributes.task_queue.name == queue:
                shared += 1
            else:
                own += 1
    return Shape(on_workflow_queue=shared, on_own_queue=own, search_attribute_updates=updating)


async def exports_per_second(exports: ExportsClient, admin: asyncpg.Connection, tenant: uuid.UUID,
                             destination: uuid.UUID, count: int) -> tuple[float, uuid.UUID]:
    """`count` exports created at once until all are Completed: their rate, and one of them for its history."""
    started = time.perf_counter()
    jobs = await asyncio.gather(*(exports.create(tenant_id=tenant, destination_id=destination, created_by="bench")
                                  for _ in range(count)))
    deadline = time.monotonic() + 600
    while True:
        done = await admin.fetchval("SELECT count(*) FROM export_jobs WHERE id = ANY($1::uuid[]) "
                                    "AND status = 'Completed'", jobs)
        if done == count:
            return count / (time.perf_counter() - started), jobs[0]
        unsettled = await admin.fetchval("SELECT count(*) FROM export_jobs WHERE id = ANY($1::uuid[]) AND status "
                                         "NOT IN ('Queued', 'Running', 'Delivering', 'Completed')", jobs)
        if unsettled or time.monotonic() > deadline:
            raise RuntimeError(f"{done} of {count} exports Completed; {unsettled} ended otherwise")
        await asyncio.sleep(0.1)


async def _sessions_started(admin: asyncpg.Connection) -> int:
    """Sessions PostgreSQL has opened to the exports' database so far, by any role."""
    return int(await admin.fetchval("SELECT sessions FROM pg_stat_database WHERE datname = current_database()"))


_TICKS = os.sysconf("SC_CLK_TCK")


def _machine_cpu_seconds() -> float:
    """CPU time the whole machine has spent busy (not idle, not waiting on I/O) since boot."""
    with open("/proc/stat") as stat:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, stat.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / _TICKS


def _process_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


@asynccontextmanager
async def _cpu_beside(server_pid: int) -> AsyncIterator[list[float]]:
    """Cores' worth of CPU the machine spent outside the Temporal server while the block ran (appended on exit)."""
    started, machine, server = time.perf_counter(), _machine_cpu_seconds(), _process_cpu_seconds(server_pid)
    beside: list[float] = []
    yield beside
    outside = (_machine_cpu_seconds() - machine) - (_process_cpu_seconds(server_pid) - server)
    beside.append(outside / (time.perf_counter() - started))


@asynccontextmanager
async def _busy_loops(cores: float) -> AsyncIterator[None]:
    """Processes that burn `cores` of CPU and do nothing else: the load of the export's own work on the machine,
    without its work."""
    shares = [1.0] * int(cores) + ([cores % 1] if cores % 1 >= 0.05 else [])
    loop = ("import sys, time\nbusy = float(sys.argv[1]) * 0.01\nwhile True:\n    t = time.perf_counter()\n"
            "    while time.perf_counter() - t < busy: pass\n    time.sleep(0.01 - busy)")
    burners = [await asyncio.create_subprocess_exec(sys.executable, "-c", loop, f"{min(share, 0.999):.3f}")
               for share in shares]
    try:
        yield
    finally:
        for burner in burners:
            burner.kill()
            await burner.wait()


async def _baseline(client: Client, task_queue: str, count: int, workflow: str, argument: object) -> float:
    started = time.perf_counter()
    handles = await asyncio.gather(*(client.start_workflow(workflow, argument, id=f"noop-{uuid.uuid4()}",
                                                           task_queue=task_queue) for _ in range(count)))
    await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 600)
    return count / (time.perf_counter() - started)


WARM_UP_RUNS = 20


async def measure(*, exports: int, rounds: int) -> Row:
    async with full_stack("throughput", contacts=100) as stack:
        settings = stack.settings(task_queue="bench-exports")
        await stack.spawn("worker", settings=settings)
        await stack.spawn("bench.noop_worker", stack.temporal.address, "bench-noop")
        client = await Client.connect(stack.temporal.address, data_converter=pydantic_data_converter)
        engine = make_engine(stack.postgres.url("app"))
        client_of_exports = ExportsClient(JobStore(engine, lease_seconds=settings.lease_seconds), client,
                                          task_queue=settings.task_queue)
        ours, theirs, shaped, loaded, extra = [], [], [], [], []
        worker_ms, noop_ms = [], []  # each worker process's CPU per run
        assert stack.temporal.process is not None  # started by full_stack
        server = stack.temporal.process.pid
        worker, noop_worker = (process.pid for process in stack.processes)
        try:
            # A round of each first, small and untimed: the first runs on a worker pay for what every later run
            # finds ready (connections to PostgreSQL and the partner, compiled code and statements).
            warm_up = min(exports, WARM_UP_RUNS)
            _, sample = await exports_per_second(client_of_exports, stack.admin, stack.tenant, stack.destination,
                                                 warm_up)
            await _baseline(client, "bench-noop", warm_up, "ShapedNoopWorkflow",
                            await shape_of(client, export_workflow_id(sample)))
            sessions_before = await _sessions_started(stack.admin)
            for _ in range(rounds):
                used = _process_cpu_seconds(worker)
                async with _cpu_beside(server) as beside_ours:
                    rate, sample = await exports_per_second(client_of_exports, stack.admin, stack.tenant,
                                                            stack.destination, exports)
                worker_ms.append((_process_cpu_seconds(worker) - used) / exports * 1000)
                ours.append(rate)
                shape = await shape_of(client, export_workflow_id(sample))
                per_export = shape.on_workflow_queue + shape.on_own_queue
                theirs.append(await _baseline(client, "bench-noop", exports, "NoopWorkflow", per_export))
                used = _process_cpu_seconds(noop_worker)
                async with _cpu_beside(server) as beside_shaped:
                    shaped.append(await _baseline(client, "bench-noop", exports, "ShapedNoopWorkflow", shape))
                noop_ms.append((_process_cpu_seconds(noop_worker) - used) / exports * 1000)
                # The ceiling again, with the machine as busy beside the server as the export's own work made it.
                extra.append(max(0.0, beside_ours[0] - beside_shaped[0]))
                async with _busy_loops(extra[-1]):
                    loaded.append(await _baseline(client, "bench-noop", exports, "ShapedNoopWorkflow", shape))
            # Read after the no-op rounds: each backend has reported its counts by then (they report at most once
            # a second while busy).
            new_sessions = (await _sessions_started(stack.admin) - sessions_before) / (exports * rounds)
        finally:
            await engine.dispose()
    # The goal is against the ceiling: a no-op workflow of the export's own shape, on the same server.
    ceiling = middle(shaped)
    row = Row("P1", f"exports/s, {exports} small exports at once through Temporal", "/s", middle(ours), ceiling,
              "no-op workflows of the export's shape", ">= 0.9")
    row.notes.append(f"{per_export} activities per export (goal: at most 4)")
    row.notes.append(
        f"the shape: {shape.on_workflow_queue} activities on the workflow's queue, {shape.on_own_queue} on other "
        f"queues (admission, a worker's own), {shape.search_attribute_updates} workflow tasks updating search "
        f"attributes; plain no-op workflows of {per_export} activities reach {middle(theirs):.3g}/s, the shape "
        f"{ceiling / middle(theirs):.2f} of that, the project {middle(ours) / middle(theirs):.2f}")
    # What sharing the machine costs the ceiling: the server competes for the same cores with the export's work
    # (database, SFTP, files, the worker), which no no-op does.
    row.notes.append(f"CPU per run: the export's worker {middle(worker_ms):.0f} ms, the no-op worker "
                     f"{middle(noop_ms):.0f} ms")
    # A new session costs about 6 ms of CPU, client and server; a warm worker needs none for an export.
    row.notes.append(f"new PostgreSQL sessions per export: {new_sessions:.2f} (the worker's and the starter's)")
    # The machine's pace drifts between rounds (the ceiling moved from 6.0 to 7.7/s across full runs on one 2-core
    # machine): each round's export rate against the ceiling measured right after it shows how far the ratio
    # above is the machine's drift.
    row.notes.append("each round against its own ceiling: " + ", ".join(
        f"{rate / ceiling_now:.2f}" for rate, ceiling_now in zip(ours, shaped, strict=True)))
    row.notes.append(
        f"beside the server, the export's work kept {middle(extra):.2f} of a core busier than the no-ops did "
        f"({os.cpu_count()} cores); the shape's no-ops beside busy loops burning that much reach "
        f"{middle(loaded):.3g}/s, and the project {middle(ours) / middle(loaded):.2f} of that")
    return row
