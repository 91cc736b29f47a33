"""C2: what a flood of `cancel` signals to one open export costs the worker's memory, against the same worker's
memory before the flood, in the same run.

The export is held open (its upload paced at the partner) while malformed signals, then valid cancels each with
a fresh request ID, are sent as fast as the server takes them. The worker's resident memory (VmRSS) is read from
/proc before and after, once the run has caught up. Signals the server refused (its per-run cap on signal events)
are counted: each one refused after the malformed ones is a cancel the operator could not send that way.

The baseline is the same flood to a workflow that takes the signals and does nothing with them, on a no-op worker of
its own (bench/noop_worker.py): what the SDK alone keeps of such a flood while the run stays open and in the
worker's cache, as the export's does. Each flood waits until its run is idle, and so reaches it in one workflow
task, as the export's flood does (see `_idle`). Two more floods, to workflows ended once flooded (and so out of the
worker's cache), say what a flood leaves behind once its run is gone. The notes say how many signals the largest
workflow task brought each run, so the rows compare like with like. Last, the same flood once more to such a
workflow on a Temporal server of its own whose per-run cap on signals is the one docs/operating.md suggests: what
that setting bounds.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

from temporalio.client import Client, WorkflowFailureError, WorkflowUpdateFailedError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError

from bench.stack import Stack, full_stack
from bench.table import Row
from starter.client import ExportsClient
from starter.localstack import processes
from starter.localstack.ports import free_port
from starter.localstack.temporal import LocalTemporal
from store.db import make_engine
from store.jobs import JobStore
from store.settings import Settings
from workflows.identity import export_workflow_id

_SENDERS = 50
# The per-run cap on signals that docs/operating.md suggests where the cancel Update is active.
SUGGESTED_SIGNAL_CAP = 1000


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


async def _settled_memory(pid: int, quiet_seconds: float, timeout: float = 300.0) -> float:
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


async def _idle(handle, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    """Once the run's first workflow task is done, and a second more, so that the flood meets an idle run, as it
    meets the export's, and reaches it in one workflow task (why: docs/operating.md, "A flood of signals")."""
    deadline = time.monotonic() + timeout
    while not any(event.WhichOneof("attributes") == "workflow_task_completed_event_attributes"
                  for event in (await handle.fetch_history()).events):
        if time.monotonic() > deadline:
            raise RuntimeError(f"workflow {handle.id} never took its first task")
        await asyncio.sleep(0.2)
    await asyncio.sleep(1.0)


def largest_signal_batch(history) -> int:  # type: ignore[no-untyped-def]
    """The most signals one workflow task brought the run: those recorded since the previous task started (the SDK
    decodes each task's activation whole)."""
    largest = pending = 0
    for event in history.events:
        kind = event.WhichOneof("attributes")
        if kind == "workflow_execution_signaled_event_attributes":
            pending += 1
        elif kind == "workflow_task_started_event_attributes":
            largest, pending = max(largest, pending), 0
    return max(largest, pending)


async def _flood_sink(client: Client, pid: int, task_queue: str, tenant: uuid.UUID, malformed: int, valid: int, *,
                      end: bool, quiet_seconds: float) -> tuple[float, int]:
    """One flood to a new workflow that ignores it, ended afterwards (so it leaves the worker's cache) or left open:
    the no-op worker's memory once settled, and the most signals one workflow task brought the run."""
    handle = await client.start_workflow("SignalSinkWorkflow", id=f"flood-sink-{uuid.uuid4()}", task_queue=task_queue)
    await _idle(handle)
    junk, cancels = _flood(tenant, malformed, valid)
    await _send(handle, junk)
    await _send(handle, cancels)
    # One more activation, as the export's cancel Update is after its flood: the SDK's poll loop holds the last
    # activation it handed out (tens of MB for 10,000 signals) until the next one arrives.
    await handle.query("taken")
    if end:
        # The server's cap refuses `finish` too: a cancellation ends the run, and the worker drops it from its cache.
        await handle.cancel()
        try:
            await asyncio.wait_for(handle.result(), timeout=120)
        except WorkflowFailureError:
            pass
    memory = await _settled_memory(pid, quiet_seconds)
    batch = largest_signal_batch(await handle.fetch_history())
    if not end:
        await handle.terminate("the flood's baseline measured")
    return memory, batch


async def _noop_worker(stack: Stack, client: Client, task_queue: str) -> int:
    """A no-op worker on `client`'s server, with one workflow run through it (so that what it loads for its first
    run is not counted as the flood's): its PID."""
    await stack.spawn("bench.noop_worker", client.service_client.config.target_host, task_queue)
    pid = stack.processes[-1].pid
    assert pid is not None
    await (await client.start_workflow("NoopWorkflow", 0, id=f"flood-warm-{uuid.uuid4()}",
                                       task_queue=task_queue)).result()
    return pid


async def _sdk_alone(stack: Stack, client: Client, malformed: int, valid: int,
                     quiet_seconds: float) -> tuple[list[float], list[int]]:
    """A no-op worker's memory before, after a flood to a workflow left open (as the export is), and after each of
    two more to workflows that end once flooded; and the largest signal batch of each run."""
    pid = await _noop_worker(stack, client, "bench-flood-noop")
    memory, batches = [await _settled_memory(pid, quiet_seconds)], []
    for flood_number in range(3):
        after, batch = await _flood_sink(client, pid, "bench-flood-noop", stack.tenant, malformed, valid,
                                         end=flood_number > 0, quiet_seconds=quiet_seconds)
        memory.append(after)
        batches.append(batch)
    return memory, batches


async def _sdk_alone_capped(stack: Stack, malformed: int, valid: int, cap: int,
                            quiet_seconds: float) -> tuple[float, float, int]:
    """The same flood, once, to a workflow on a server whose per-run cap on signals is `cap`: a no-op worker's
    memory before and after, and the largest signal batch."""
    temporal = LocalTemporal(stack.folder / "temporal-capped", ui_port=free_port(),
                             dynamic_config={"history.maximumSignalsPerExecution": cap})
    await temporal.start()
    try:
        client = await Client.connect(temporal.address, data_converter=pydantic_data_converter)
        pid = await _noop_worker(stack, client, "bench-flood-capped")
        before = await _settled_memory(pid, quiet_seconds)
        after, batch = await _flood_sink(client, pid, "bench-flood-capped", stack.tenant, malformed, valid, end=True,
                                         quiet_seconds=quiet_seconds)
        await processes.stop(stack.processes.pop())  # before its server
        return before, after, batch
    finally:
        await temporal.stop()


async def measure(*, malformed: int, valid: int, quiet_seconds: float | None = None) -> Row:
    """`quiet_seconds`: how long the worker's memory must hold still to count as settled; by default a little
    longer than the workers' interval between handing free pages back, so that each reading comes after one."""
    if quiet_seconds is None:
        quiet_seconds = Settings.model_construct().malloc_trim_interval_seconds + 2.0
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
            before = await _settled_memory(worker_pid, quiet_seconds)
            handle = client.get_workflow_handle(export_workflow_id(job))
            run_id = (await handle.describe()).run_id
            junk, cancels = _flood(stack.tenant, malformed, valid)
            refused_junk = await _send(handle, junk)
            refused_valid = await _send(handle, cancels)
            by_update = await _cancel_by_update(handle, stack.tenant)
            after = await _settled_memory(worker_pid, quiet_seconds)
            status = await stack.admin.fetchval("SELECT status FROM export_jobs WHERE id = $1", job)
            batch = largest_signal_batch(await client.get_workflow_handle(
                export_workflow_id(job), run_id=run_id).fetch_history())
            sink, sink_batches = await _sdk_alone(stack, client, malformed, valid, quiet_seconds)
            capped = await _sdk_alone_capped(stack, malformed, valid, SUGGESTED_SIGNAL_CAP, quiet_seconds)
        finally:
            await engine.dispose()
    row = Row("C2", f"worker memory growth after {malformed:,} malformed and {valid:,} valid cancel signals", "MB",
              max(0.0, after - before), max(0.0, sink[1] - sink[0]),
              "the SDK alone, a run left open after the same flood",
              "<= 20", higher_is_better=False, goal_on="project")
    row.notes.append(f"worker {before:.0f} MB before, {after:.0f} MB after, its largest workflow task bringing "
                     f"{batch:,} signals; the server refused {refused_junk} of the malformed and {refused_valid} of "
                     f"the valid signals (its cap on a run's signals); then a cancel by Update: {by_update}; the "
                     f"export ended {status}")
    row.notes.append(f"the SDK alone: a no-op worker whose workflow ignores the flood, {sink[0]:.0f} MB before, "
                     f"{sink[1]:.0f} MB after the flood to a run left open, in the cache (largest workflow task "
                     f"{sink_batches[0]:,} signals); then two more to runs ended once flooded, {sink[2]:.0f} and "
                     f"{sink[3]:.0f} MB ({sink[2] - sink[1]:+.0f} and {sink[3] - sink[2]:+.0f} MB; largest tasks "
                     f"{sink_batches[1]:,} and {sink_batches[2]:,} signals)")
    row.notes.append(f"the SDK alone on a server whose per-run cap on signals is {SUGGESTED_SIGNAL_CAP:,} "
                     f"(docs/operating.md): {capped[0]:.0f} MB before, {capped[1]:.0f} MB after "
                     f"({capped[1] - capped[0]:+.0f} MB, largest task {capped[2]:,} signals)")
    return row
