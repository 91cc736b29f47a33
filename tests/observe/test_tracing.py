"""Tracing: one export, run by the project's worker with its real components on a client carrying Temporal's
TracingInterceptor (as the worker process builds it with EXPORTS_TRACING set), is one trace: the dispatcher's
start of the workflow, the workflow and each of its activities."""

from __future__ import annotations

import asyncio
import signal
from contextlib import AsyncExitStack

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from activities.process import tracing
from store.models import Status
from tests.helpers.harness import WorkerProcess, open_harness
from workflows.identity import export_workflow_id

# The global provider can be set once per process: the tests here share it and clear its spans.
EXPORTER = InMemorySpanExporter()


@pytest.fixture
def spans() -> InMemorySpanExporter:
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
        trace.set_tracer_provider(provider)
    EXPORTER.clear()
    return EXPORTER


async def test_an_export_is_one_trace_across_the_workflow_and_its_activities(db, store, client, tmp_path, spans):
    settings = db.settings(tracing="console")  # any value but off puts the interceptor on the client
    traced = tracing.traced(client, settings)
    assert traced is not client
    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, traced, tmp_path)
        job_id = await h.create()
        assert (await h.settled(job_id)).status is Status.COMPLETED

    finished = spans.get_finished_spans()
    workflow_id = export_workflow_id(job_id)
    mine = [s for s in finished if (s.attributes or {}).get("temporalWorkflowID") == workflow_id]
    names = sorted({s.name for s in mine})
    run_workflow = [s for s in mine if s.name == "RunWorkflow:ExportWorkflow"]
    assert run_workflow, names
    trace_id = run_workflow[0].context.trace_id
    activities = [s for s in mine if s.name.startswith("RunActivity:")]
    ran = {s.name.removeprefix("RunActivity:") for s in activities}
    assert {"build", "authorize_delivery", "deliver"} <= ran, names
    assert {s.context.trace_id for s in mine} == {trace_id}, [(s.name, hex(s.context.trace_id)) for s in mine]
    # The trace begins where the export was started: the outbox dispatcher's signal-with-start of the workflow.
    starts = [s for s in mine if s.name == "SignalWithStartWorkflow:ExportWorkflow"]
    assert starts and starts[0].parent is None and starts[0].context.trace_id == trace_id
    # Each named PostgreSQL statement an activity ran is a span in the export's trace, under that activity's.
    sql = [s for s in finished if s.name.startswith("sql ") and s.context.trace_id == trace_id]
    assert sql, sorted({s.name for s in finished})
    activity_span_ids = {s.context.span_id for s in activities}
    assert all(s.attributes and s.attributes.get("db.system") == "postgresql" for s in sql)
    assert any(s.parent is not None and s.parent.span_id in activity_span_ids for s in sql), \
        [(s.name, s.parent) for s in sql]
    # The delivery's SFTP steps, under its RunActivity:deliver.
    deliver = {s.context.span_id for s in activities if s.name == "RunActivity:deliver"}
    steps = {s.name for s in finished if s.name.startswith("sftp ") and s.parent is not None
             and s.parent.span_id in deliver}
    assert {"sftp connect", "sftp upload", "sftp rename", "sftp evidence read"} <= steps, \
        sorted({s.name for s in finished})


def test_tracing_is_off_unless_configured(db, client):
    settings = db.settings()
    assert settings.tracing == "off"
    assert tracing.configure(settings) is False
    assert tracing.traced(client, settings) is client


async def test_a_worker_process_exports_its_last_spans_before_it_exits(db, store, client, tmp_path, monkeypatch):
    """The worker ends its process without the interpreter's teardown (activities.process.temporal.exit_now), so
    the tracer's own at-exit flush never runs: the worker flushes it on its way out. The batch's delay is set past
    the test, so a span of the export is printed only by that flush."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")
    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path, in_process_worker=False)
        worker = await WorkerProcess(h.settings, tracing="console", http_port=0).start()
        try:
            job_id = await h.create()
            assert (await h.settled(job_id)).status is Status.COMPLETED
            worker.process.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(worker.process.wait(), timeout=60) == 0
        finally:
            worker.kill()
            await asyncio.wait_for(worker.process.wait(), timeout=15)
        printed = worker.log_path.read_text(errors="replace")
    assert '"name": "RunActivity:deliver"' in printed, printed[-3000:]
