"""OpenTelemetry tracing through Temporal's TracingInterceptor, off unless EXPORTS_TRACING says otherwise.

- `off` (the default): no interceptor, no provider; nothing is paid.
- `console`: spans printed on the worker's standard output, in batches.
- `otlp`: spans sent to OTEL_EXPORTER_OTLP_ENDPOINT (and the other standard OTEL_* variables) by the OTLP
  exporter, which is a package of its own (opentelemetry-exporter-otlp): without it the worker says so at start
  and runs untraced.

The interceptor goes on the worker's client, so that the outbox dispatcher's start of an export opens the trace
(a "StartWorkflow" span), the workflow's spans hang under it and each activity's span under the workflow's: one
trace per export run. Workflows started without a traced client (schedules, the `temporal` command) get
activity spans only, each a trace of its own, since workflow spans without a parent could not be rebuilt the
same way after a replay.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from opentelemetry import trace as otel_trace
from temporalio.client import Client

from store.settings import Settings

# The logger keeps the name it had before the module moved into process/: log filters and alerts match on it.
log = logging.getLogger("activities.tracing")


P = ParamSpec("P")
R = TypeVar("R")


def spanned(name: str, **attributes: str) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]:
    """An async function run inside a span of its own (a no-op span while tracing is off): for the steps of an
    activity (SFTP connect, upload, rename, evidence read) that its RunActivity span alone would not show."""
    tracer = otel_trace.get_tracer("activities")

    def wrap(function: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        @functools.wraps(function)
        async def run(*args: P.args, **kwargs: P.kwargs) -> R:
            with tracer.start_as_current_span(name, kind=otel_trace.SpanKind.CLIENT, attributes=attributes):
                return await function(*args, **kwargs)
        return run
    return wrap


def configure(settings: Settings) -> bool:
    """The global tracer provider and its exporter, as EXPORTS_TRACING asks. False when tracing stays off."""
    if settings.tracing == "off":
        return False
    # Imported only when asked for: a worker that does not trace pays nothing at start.
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    if settings.tracing == "console":
        exporter = ConsoleSpanExporter()
    else:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            except ImportError:
                log.error("EXPORTS_TRACING=otlp, but the OTLP exporter is not installed: pip install "
                          "opentelemetry-exporter-otlp; the worker runs untraced")
                return False
        exporter = OTLPSpanExporter()  # reads OTEL_EXPORTER_OTLP_ENDPOINT and the other standard variables
    service = os.environ.get("OTEL_SERVICE_NAME", "exports-worker")
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    log.info("tracing on (%s), service %s%s", settings.tracing, service,
             f", to {os.environ.get('OTEL_EXPORTER_OTLP_ENDPOINT', 'the default endpoint')}"
             if settings.tracing == "otlp" else "")
    return True


def flush() -> None:
    """Export the spans still batched, and stop the exporter: the worker ends its process without the
    interpreter's teardown (activities.process.temporal.exit_now), so the tracer's own at-exit shutdown never runs."""
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    shutdown = getattr(provider, "shutdown", None)  # the API's default provider has none: nothing was traced
    if shutdown is not None:
        shutdown()


def traced(client: Client, settings: Settings) -> Client:
    """The same connection, with the tracing interceptor when tracing is on; the workers built on it inherit the
    interceptor, so activities and workflows are traced too."""
    if settings.tracing == "off":
        return client
    from temporalio.contrib.opentelemetry import TracingInterceptor

    config = client.config()
    config["interceptors"] = [*config["interceptors"], TracingInterceptor()]
    return Client(**config)
