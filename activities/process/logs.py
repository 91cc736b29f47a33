"""Logs: text for people (the default), or one JSON object per line (EXPORTS_LOG_FORMAT=json) for a log collector.

Every JSON line has time, level, logger and message, and, when the record comes from a workflow or an activity,
workflow_id, run_id, workflow_type, activity_type, activity_id, attempt, and the export's job_id (taken from a
workflow ID `export-<uuid>`), and trace_id and span_id when a span is current (tracing on). The
SDK's workflow and activity loggers put those on the record (the extras
`temporal_workflow` and `temporal_activity`); a record from any other logger while an activity runs (e.g.
`store.jobs` under a claim) gets the activity's from its context.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import IO, Any

from opentelemetry import trace as otel_trace
from temporalio import activity, workflow
from temporalio.runtime import LogForwardingConfig, LoggingConfig, TelemetryFilter

from store.settings import Settings, setting_problem
from workflows.identity import job_id_of

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
def record_context(record: logging.LogRecord) -> dict[str, Any]:
    """The Temporal context of a record, flattened: only the keys that have a value."""
    found: dict[str, Any] = {}
    run = getattr(record, "temporal_workflow", None)
    if isinstance(run, Mapping):
        found.update(workflow_id=run.get("workflow_id"), run_id=run.get("run_id"),
                     workflow_type=run.get("workflow_type"), update_id=run.get("update_id"))
    step = getattr(record, "temporal_activity", None)
    if not isinstance(step, Mapping) and activity.in_activity():
        # A plain logger called from activity code: the activity's own context says which one it serves.
        info = activity.info()
        step = {"workflow_id": info.workflow_id, "workflow_run_id": info.workflow_run_id,
                "workflow_type": info.workflow_type, "activity_type": info.activity_type,
                "activity_id": info.activity_id, "attempt": info.attempt}
    if isinstance(step, Mapping):
        found.update(workflow_id=step.get("workflow_id"), run_id=step.get("workflow_run_id"),
                     workflow_type=step.get("workflow_type"), activity_type=step.get("activity_type"),
                     activity_id=step.get("activity_id"), attempt=step.get("attempt"))
    job_id = getattr(record, "job_id", None) or job_id_of(found.get("workflow_id"))
    if job_id:
        found["job_id"] = str(job_id)
    return {key: value for key, value in found.items() if value is not None}


def trace_context() -> dict[str, str]:
    """The current span's trace_id and span_id (hex, as trace back ends show them), so that a log line can be
    found from its trace and back; nothing when no span is current or tracing is off."""
    context = otel_trace.get_current_span().get_span_context()
    if not context.is_valid:
        return {}
    return {"trace_id": format(context.trace_id, "032x"), "span_id": format(context.span_id, "016x")}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line whatever the message holds (newlines and every non-ASCII
    character are escaped, so no reader splits a record)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(record_context(record))
        entry.update(trace_context())
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["error"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str, ensure_ascii=True)


def configure_logging(settings: Settings, stream: IO[str] | None = None) -> logging.Handler:
    """The process's one log handler (on stderr unless given a stream), in the format and at the level the
    settings say; replaces any handler configured before. Returns it, for filters."""
    json_lines = settings.log_format == "json"
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if json_lines else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=settings.log_level, handlers=[handler], force=True)
    # asyncssh writes about twenty INFO lines for each connection it opens and closes, two an export: they are
    # shown at DEBUG only. Its warnings and errors stay, and the worker's own lines say which partner it connects
    # to and why a session failed.
    level = logging.getLevelName(settings.log_level)
    logging.getLogger("asyncssh").setLevel(level if level == logging.DEBUG else max(level, logging.WARNING))
    # In JSON the context has fields of its own: the SDK's copy of it at the end of each message would repeat it.
    activity.logger.activity_info_on_message = not json_lines
    workflow.logger.workflow_info_on_message = not json_lines
    return handler


def sdk_core_logging(settings: Settings) -> LoggingConfig:
    """The SDK core's (Rust) logging, for whoever builds the process's `temporalio.runtime.Runtime`: in JSON, its
    warnings are forwarded to the `temporalio.core` logger, so they are JSON lines too; in text they go to
    stderr as the SDK prints them by default."""
    if settings.log_format != "json":
        return LoggingConfig.default
    return LoggingConfig(filter=TelemetryFilter(core_level="WARN", other_level="ERROR"),
                         forwarding=LogForwardingConfig(logger=logging.getLogger("temporalio.core")))


def settings_or_exit(load: Callable[[], Settings]) -> Settings:
    """The settings for a process's start, or one line on stderr naming the EXPORTS_* variable that does not
    parse, and exit status 2 (as the command line answers it)."""
    from pydantic import ValidationError

    try:
        return load()
    except ValidationError as exc:
        print(f"error: {setting_problem(exc)}", file=sys.stderr)
        raise SystemExit(2) from None
