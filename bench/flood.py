"""C2: what a flood of `cancel` signals to one open export costs the worker's memory, against the same worker's
memory before the flood, in the same run.

The export is held open (its upload paced at the partner) while malformed signals, then valid cancels each with
a fresh request ID, are sent as fast as the server takes them. The worker's resident memory (VmRSS) is read from
/proc before and after, once the run has caught up. Signals the server refused (its per-run cap on signal events)
are counted: each one refused after the malformed ones is a cancel the operator could not send that way.

The same flood then goes to a workflow that takes the signals and does nothing with them, on a no-op worker of
its own (bench/noop_worker.py): what the SDK alone keeps of such a flood, beside what the export's worker keeps.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError

from bench.stack import Stack, full_stack
from bench.table import Row
from starter.client import ExportsClient
from store.db import make_engine
from store.jobs import JobStore
from workflows.identity import export_workflow_id

_SENDERS = 50


def rss_megabytes(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


async def _send(handle, payloads: list[object]) -> int:  # type: ignore[no-untyped-def]
    """Each payload as a `cancel` signal, `_SENDERS` at once; how many the server refused."""
    refused = 0
    queue = list(reversed(payloads))

    async def sender() -> None:
        nonlocal refused
        while queue:
            payload = queue.pop()
            try:
                await handle.signal("cancel", payload)
            except RPCError:
                refused += 1

    await asyncio.gather(*(sender() for _ in range(_SENDERS)))
    return refused


async def _settled_memory(pid: int, quiet_seconds: float = 3.0, timeout: float = 300.0) -> float:
    """The worker's memory once it has stopped changing for a few seconds (the run has caught up)."""
    deadline = time.monotonic() + timeout
    last = rss_megabytes(pid)
    steady_since = time.monotonic()
    while time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        now = rss_megabytes(pid)
        if abs(now - last) > 1.0:
            last, steady_since = now, time.monotonic()
        elif time.monotonic() - steady_since >= quiet_seconds:
            return now
    return rss_megabytes(pid)


async def _cancel_by_update(handle, tenant: uuid.UUID) -> str:  # type: ignore[no-untyped-def]
    """One valid cancel sent as the `cancel` Update after the flood: its answer, or why it was refused."""
    request = {"request_id": str(uuid.uuid4()), "tenant": str(tenant), "operator": "flood", "reason": "after"}
    try:
        answer = await asyncio.wait_for(handle.execute_update("cancel", request), timeout=60)
    except (WorkflowUpdateFailedError, RPCError, TimeoutError) as exc:
        return f"refused ({getattr(exc, 'cause', None) or exc})"
    return f"answered {answer['outcome']}"


def _flood(tenant: uuid.UUID, malformed: int, valid: int) -> tuple[list[object], list[object]]:
    """The malformed payloads, then the valid cancels, each with a fresh request ID."""
    junk: list[object] = [{"request_id": "not-a-uuid", "tenant": str(tenant), "operator": "flood"}
                          for _ in range(malformed)]
    cancels: list[object] = [{"request_id": str(uuid.uuid4()), "tenant": str(tenant), "operator": "flood",
                              "reason": "bench"} for _ in range(valid)]
    return junk, cancels


async def _sdk_alone(stack: Stack, client: Client, malformed: int, valid: int) -> list[float]:
    """A no-op worker's memory before the flood and after each of two floods, each to a workflow of its own that
    ignores the signals: what the SDK keeps, and whether a second flood adds to it (a leak) or not (a high-water
    mark of the first)."""
    await stack.spawn("bench.noop_worker", stack.temporal.address, "bench-flood-noop")
    pid = stack.processes[-1].pid
    memory: list[float] = []
    for _ in range(2):
        handle = await client.start_workflow("SignalSinkWorkflow", id=f"flood-sink-{uuid.uuid4()}",
                                             task_queue="bench-flood-noop")
        await handle.describe()
        if not memory:
            memory.append(await _settled_memory(pid))
        junk, cancels = _flood(stack.tenant, malformed, valid)
        await _send(handle, junk)
        await _send(handle, cancels)
        memory.append(await _settled_memory(pid))
        await handle.terminate("the flood's baseline measured")
    return memory


async def measure(*, malformed: int, valid: int) -> Row:
    async with full_stack("flood", contacts=2000) as stack:
        # The cancel Update, which this release ships for the next to activate, is activated early here: the row
        # says whether an operator can still cancel once the flood has filled the run's signal quota.
        settings = stack.settings(task_queue="bench-flood", upload_throttle_bytes_per_second=1000,
                                  early_patches="cancel-update")
        await stack.spawn("worker", settings=settings)
        worker_pid = stack.processes[-1].pid
        client = await Client.connect(stack.temporal.address, data_converter=pydantic_data_converter)
        engine = make_engine(stack.postgres.url("app"))
        try:
            exports = ExportsClient(JobStore(engine, lease_seconds=settings.lease_seconds), client,
                                    task_queue=settings.task_queue)
            job = await exports.create(tenant_id=stack.tenant, destination_id=stack.destination, created_by="bench")
            deadline = time.monotonic() + 120
            while await stack.admin.fetchval("SELECT status FROM export_jobs WHERE id = $1", job) != "Delivering":
                if time.monotonic() > deadline:
                    raise RuntimeError(f"export {job} never started its upload")
                await asyncio.sleep(0.2)
            before = await _settled_memory(worker_pid)
            handle = client.get_workflow_handle(export_workflow_id(job))
            junk, cancels = _flood(stack.tenant, malformed, valid)
            refused_junk = await _send(handle, junk)
            refused_valid = await _send(handle, cancels)
            by_update = await _cancel_by_update(handle, stack.tenant)
            after = await _settled_memory(worker_pid)
            status = await stack.admin.fetchval("SELECT status FROM export_jobs WHERE id = $1", job)
            sink = await _sdk_alone(stack, client, malformed, valid)
        finally:
            await engine.dispose()
    row = Row("C2", f"worker memory growth after {malformed:,} malformed and {valid:,} valid cancel signals", "MB",
              max(0.0, after - before), before, "the worker's memory before", "<= 20", higher_is_better=False,
              goal_on="project")
    row.notes.append(f"worker {before:.0f} MB before, {after:.0f} MB after; the server refused {refused_junk} of the "
                     f"malformed and {refused_valid} of the valid signals (its cap on a run's signals); then a cancel "
                     f"by Update: {by_update}; the export ended {status}")
    row.notes.append(f"the SDK alone: a no-op worker whose workflow ignores the same flood, {sink[0]:.0f} MB before, "
                     f"{sink[1]:.0f} MB after (+{max(0.0, sink[1] - sink[0]):.0f} MB); the same flood again to "
                     f"another workflow: {sink[2]:.0f} MB (+{max(0.0, sink[2] - sink[1]):.0f} MB more)")
    return row
