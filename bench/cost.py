"""C1: what one export costs Temporal, in billable actions, against a no-op workflow of the export's shape counted
the same way in the same run.

Counted by Temporal Cloud's published rules (docs.temporal.io, "Temporal Cloud Actions"): each workflow start,
signal, activity start and retry, search-attribute upsert, timer, update and child or continued run, and each
activity heartbeat that reaches the server. Three of those rules decide an export's count:
- a Signal-With-Start is one action in all, start and signal: the dispatcher starts every run that way, so the
  signal that came with the start (the history's second event) is not counted again;
- the `TemporalChangeVersion` upsert the SDK makes beside each patch marker is exempt;
- a workflow task's RecordMarker commands count as one action together (the rule written for local activities);
  the page does not say whether patch markers are billed at all, so each task that recorded any counts one.
The history holds all but the heartbeats; those come from the worker's own request metrics (the SDK counts each
RecordActivityTaskHeartbeat it sends), scraped from its /metrics before and after. Two exports: a small one, and
one whose build and upload each take about `long_seconds` (throttled), where heartbeats show.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter

from prometheus_client.parser import text_string_to_metric_families
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import History
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from activities.process.endpoint import free_loopback_port
from bench.stack import Stack, full_stack
from bench.table import Row
from bench.throughput import shape_of
from starter.client import ExportsClient
from starter.localstack import processes
from store.db import make_engine
from store.jobs import JobStore
from workflows.identity import export_workflow_id

_BILLED = {
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED,
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED,
    EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED,
    EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES,
    EventType.EVENT_TYPE_TIMER_STARTED,
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED,
    EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED,
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW,
}
_CONTACT_BYTES = 90  # about, per contact in the built CSV


def history_actions(history: History) -> tuple[int, Counter[str], Counter[str]]:
    """Billed actions a history shows (activity retries included), by kind; and what the rules exempt, by kind."""
    billed: Counter[str] = Counter()
    exempt: Counter[str] = Counter()
    marker_tasks: set[int] = set()
    events = history.events
    for index, event in enumerate(events):
        if event.event_type == EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES and set(
                event.upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields) == {
                "TemporalChangeVersion"}:
            exempt["the SDK's TemporalChangeVersion upsert for a patch"] += 1
        elif (event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED and index == 1
              and events[0].event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED):
            exempt["the signal of a signal-with-start, one action with the start"] += 1
        elif event.event_type in _BILLED:
            billed[EventType.Name(event.event_type).removeprefix("EVENT_TYPE_").lower()] += 1
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            billed["activity_retry"] += max(0, event.activity_task_started_event_attributes.attempt - 1)
        elif event.event_type == EventType.EVENT_TYPE_MARKER_RECORDED:
            marker_tasks.add(event.marker_recorded_event_attributes.workflow_task_completed_event_id)
    if marker_tasks:
        billed["workflow tasks that recorded markers, one each"] = len(marker_tasks)
    return sum(billed.values()), +billed, exempt


async def heartbeats_sent(port: int) -> float:
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    text = raw.partition(b"\r\n\r\n")[2].decode()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "temporal_request_total"
               and sample.labels.get("operation") == "RecordActivityTaskHeartbeat")


async def _one_export(stack: Stack, exports: ExportsClient, port: int, timeout: float) -> tuple[uuid.UUID, float]:
    """One export to Completed: its ID and the heartbeats its worker sent meanwhile."""
    before = await heartbeats_sent(port)
    job = await exports.create(tenant_id=stack.tenant, destination_id=stack.destination, created_by="bench")
    deadline = time.monotonic() + timeout
    while (status := await stack.admin.fetchval("SELECT status FROM export_jobs WHERE id = $1", job)) != "Completed":
        if status not in ("Queued", "Running", "Delivering") or time.monotonic() > deadline:
            raise RuntimeError(f"export {job} ended {status}, not Completed")
        await asyncio.sleep(0.2)
    await asyncio.sleep(1.0)  # the run's last workflow task
    return job, await heartbeats_sent(port) - before


async def _noop_actions(client: Client, workflow_id: str) -> int:
    """The actions of a no-op workflow in the export's shape (bench/noop_worker.py)."""
    shape = await shape_of(client, workflow_id)
    handle = await client.start_workflow("ShapedNoopWorkflow", shape, id=f"noop-{uuid.uuid4()}",
                                         task_queue="bench-noop")
    await asyncio.wait_for(handle.result(), 120)
    return history_actions(await handle.fetch_history())[0]


async def measure(*, long_seconds: float, renew_every: float) -> list[Row]:
    contacts = 2000
    throttle = int(contacts * _CONTACT_BYTES / long_seconds)
    lease = 3 * renew_every
    rows = []
    async with full_stack("cost", contacts=contacts) as stack:
        client = await Client.connect(stack.temporal.address, data_converter=pydantic_data_converter)
        await stack.spawn("bench.noop_worker", stack.temporal.address, "bench-noop")
        engine = make_engine(stack.postgres.url("app"))
        try:
            for name, throttles in (("small", {}), ("long", {"build_throttle_bytes_per_second": throttle,
                                                           "upload_throttle_bytes_per_second": throttle})):
                port = free_loopback_port()
                settings = stack.settings(task_queue=f"bench-cost-{name}", http_port=port,
                                          http_bind_address="127.0.0.1", lease_seconds=lease,
                                          renew_every_seconds=renew_every, **throttles)
                await stack.spawn("worker", settings=settings)
                await _ready(port)
                exports = ExportsClient(JobStore(engine, lease_seconds=lease), client, task_queue=settings.task_queue)
                started = time.monotonic()
                job, heartbeats = await _one_export(stack, exports, port, timeout=6 * long_seconds + 120)
                took = time.monotonic() - started
                history = await client.get_workflow_handle(export_workflow_id(job)).fetch_history()
                actions, kinds, exempt = history_actions(history)
                noop = await _noop_actions(client, export_workflow_id(job))
                total = actions + heartbeats
                bound = 10 if name == "small" else 10 + round(took / renew_every)
                row = Row(f"C1 {name}", f"Temporal actions per export, {name} ({took:.0f} s)", "actions", total,
                          noop, "a no-op workflow of its shape", f"<= {bound}", higher_is_better=False,
                          goal_on="project")
                by_kind = ", ".join(f"{kind} {n}" for kind, n in kinds.items())
                not_billed = ", ".join(f"{kind} {n}" for kind, n in exempt.items()) or "none"
                row.notes.append(f"{name}: {actions} from the history ({by_kind}; not billed: {not_billed}) and "
                                 f"{heartbeats:.0f} heartbeats that reached the server; renewal interval "
                                 f"{renew_every:g} s")
                rows.append(row)
                await _stop_last(stack)
        finally:
            await engine.dispose()
    return rows


async def _ready(port: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 2)
            writer.write(b"GET /readyz HTTP/1.1\r\nHost: localhost\r\n\r\n")
            await writer.drain()
            head = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            if head.split()[1:2] == [b"200"]:
                return
        except (OSError, TimeoutError, IndexError):
            pass
        await asyncio.sleep(0.3)
    raise RuntimeError("the bench worker never became ready")


async def _stop_last(stack: Stack) -> None:
    await processes.stop(stack.processes.pop())
