"""Logs: text by default, one JSON object per line with EXPORTS_LOG_FORMAT=json, carrying the workflow ID, run ID,
activity type and job ID of the record's workflow or activity; EXPORTS_LOG_LEVEL sets the level, and a bad one
stops a process at start in one line.

The records with Temporal context come from the SDK's own loggers run in the SDK's own activity context (its
ActivityEnvironment), and from a real worker process (`python -m worker`) taking an export through to Completed
against the session's Temporal dev server, PostgreSQL and an SFTP partner."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import sys
import uuid
from collections.abc import Iterator
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from pydantic import ValidationError
from temporalio import activity, workflow
from temporalio.testing import ActivityEnvironment

from activities.process.logs import JsonFormatter, configure_logging
from store.models import Status
from store.settings import Settings
from tests.helpers.harness import WorkerProcess, open_harness
from tests.helpers.support import run_command
from workflows.identity import job_id_of

ROOT = Path(__file__).resolve().parents[2]
EXPORTS = Path(sys.executable).parent / "exports"
START_BOUND = 30.0


@pytest.fixture
def restored_logging() -> Iterator[None]:
    """configure_logging changes the process's root logger and the SDK's loggers: put them back for pytest."""
    root, ssh = logging.getLogger(), logging.getLogger("asyncssh")
    handlers, level, ssh_level = root.handlers[:], root.level, ssh.level
    on_message = activity.logger.activity_info_on_message, workflow.logger.workflow_info_on_message
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        ssh.setLevel(ssh_level)
        activity.logger.activity_info_on_message, workflow.logger.workflow_info_on_message = on_message


def settings(**values: object) -> Settings:
    return Settings(_env_file=None, **values)


def lines_of(stream: io.StringIO) -> list[dict]:
    text = stream.getvalue()
    assert text.endswith("\n"), text
    return [json.loads(line) for line in text.splitlines()]


def test_records_of_an_activity_carry_its_workflow_run_activity_and_job(restored_logging):
    stream = io.StringIO()
    configure_logging(settings(log_format="json"), stream)
    job_id = uuid.uuid4()
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, workflow_id=f"export-{job_id}", workflow_run_id="run-1",
                                   activity_type="deliver", workflow_type="ExportWorkflow", attempt=2)

    def step() -> None:
        activity.logger.warning("upload of %s refused", "part-1")  # the SDK's adapter: temporal_activity extra
        logging.getLogger("store.jobs").info("claimed")  # a plain logger inside the activity

    env.run(step)
    sdk, plain = lines_of(stream)
    for line in (sdk, plain):
        assert line["workflow_id"] == f"export-{job_id}" and line["run_id"] == "run-1", line
        assert line["activity_type"] == "deliver" and line["job_id"] == str(job_id), line
        assert line["attempt"] == 2 and line["workflow_type"] == "ExportWorkflow", line
        assert set(line) >= {"time", "level", "logger", "message"}, line
    assert (sdk["level"], sdk["logger"], sdk["message"]) == ("WARNING", "temporalio.activity", "upload of part-1 "
                                                                                              "refused")
    assert (plain["level"], plain["logger"], plain["message"]) == ("INFO", "store.jobs", "claimed")


def test_a_workflow_record_is_flattened_and_a_job_id_comes_only_from_an_export_workflow_id():
    job_id = uuid.uuid4()
    details = {"attempt": 1, "namespace": "default", "run_id": "r-9", "task_queue": "exports",
               "workflow_id": f"export-{job_id}", "workflow_type": "ExportWorkflow"}  # as the SDK's adapter adds it
    record = logging.makeLogRecord({"name": "temporalio.workflow", "levelno": logging.WARNING,
                                    "levelname": "WARNING", "msg": "claim of %s failed", "args": (job_id,),
                                    "temporal_workflow": details})
    line = json.loads(JsonFormatter().format(record))
    assert line["workflow_id"] == f"export-{job_id}" and line["run_id"] == "r-9" and line["job_id"] == str(job_id)
    assert line["message"] == f"claim of {job_id} failed" and "activity_type" not in line
    recovery = logging.makeLogRecord({"msg": "ran", "temporal_workflow": {**details, "workflow_id": "exports-"
                                                                                                    "recovery-run"}})
    assert "job_id" not in json.loads(JsonFormatter().format(recovery))
    assert job_id_of("export-not-a-uuid-at-all-but-36-chars-long") is None
    assert job_id_of(f"export-{job_id}") == str(job_id)
    without = json.loads(JsonFormatter().format(logging.makeLogRecord({"msg": "worker polling"})))
    assert set(without) == {"time", "level", "logger", "message"}


def test_a_line_logged_in_a_span_carries_its_trace_and_span_ids_and_none_outside_one(restored_logging):
    stream = io.StringIO()
    configure_logging(Settings(log_format="json"), stream)
    # A provider of the test's own: the global one may be set once per process (test_tracing.py owns it).
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("outer") as span:
        logging.getLogger("store.jobs").warning("inside")
    logging.getLogger("store.jobs").warning("outside")
    inside, outside = (json.loads(line) for line in stream.getvalue().splitlines())
    context = span.get_span_context()
    assert inside["trace_id"] == f"{context.trace_id:032x}" and inside["span_id"] == f"{context.span_id:016x}"
    assert len(inside["trace_id"]) == 32 and len(inside["span_id"]) == 16
    assert "trace_id" not in outside and "span_id" not in outside, outside


def test_a_message_with_line_breaks_and_a_traceback_stays_one_line():
    try:
        raise ValueError("bad\nvalue")
    except ValueError:
        record = logging.makeLogRecord({"msg": "two\nlines\u2028and a separator", "exc_info": sys.exc_info()})
    text = JsonFormatter().format(record)
    assert len(text.splitlines()) == 1, text
    line = json.loads(text)
    assert line["message"] == "two\nlines\u2028and a separator"
    assert "ValueError: bad" in line["error"]


def test_text_is_the_default_and_keeps_the_sdk_context_in_the_message(restored_logging):
    stream = io.StringIO()
    configure_logging(settings(), stream)
    env = ActivityEnvironment()
    env.run(lambda: activity.logger.info("step"))
    line = stream.getvalue().strip()
    assert " INFO temporalio.activity step ({" in line, line  # the SDK's suffix: the context, for people
    with pytest.raises(json.JSONDecodeError):
        json.loads(line)


def test_the_level_is_set_by_name_and_a_bad_one_is_refused(restored_logging):
    stream = io.StringIO()
    configure_logging(settings(log_format="json", log_level="warning"), stream)
    logging.getLogger("exports.worker").info("not shown")
    logging.getLogger("exports.worker").warning("shown")
    assert [line["message"] for line in lines_of(stream)] == ["shown"]
    with pytest.raises(ValidationError, match="'loud' is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL"):
        settings(log_level="loud")
    with pytest.raises(ValidationError, match="'yaml' is not text or json"):
        settings(log_format="yaml")


# --- processes ------------------------------------------------------------------------------------------------------


async def run(*args: str, env: dict[str, str], cwd: Path) -> tuple[int | None, str, float]:
    ran = await run_command(*args, env=env, cwd=cwd, bound=START_BOUND)
    return ran.code, ran.stderr, ran.seconds


@pytest.mark.parametrize("command", [[sys.executable, "-m", "worker"], [str(EXPORTS), "worker"]])
async def test_a_bad_log_level_stops_a_worker_at_start_in_one_line(tmp_path, command):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EXPORTS_", "TEMPORAL_"))}
    code, stderr, _ = await run(*command, cwd=ROOT if command[0] == sys.executable else tmp_path,
                                env={**env, "EXPORTS_LOG_LEVEL": "loud", "EXPORTS_WORK_DIR": str(tmp_path)})
    assert code == 2, stderr
    assert stderr.splitlines() == ["error: setting EXPORTS_LOG_LEVEL: 'loud' is not one of DEBUG, INFO, WARNING, "
                                   "ERROR, CRITICAL"], stderr


async def test_a_real_worker_logs_an_export_in_json_lines(db, store, client, tmp_path):
    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path, in_process_worker=False, log_format="json")
        worker = await WorkerProcess(h.settings).start()
        try:
            job_id = await h.create()
            assert (await h.settled(job_id)).status is Status.COMPLETED
        finally:
            await worker.stop()  # SIGTERM by its PID: the shutdown's lines are JSON too
    text = worker.log_path.read_text()
    lines = [json.loads(line) for line in text.splitlines()]  # every line: a JSON object, or this fails
    assert lines and all({"time", "level", "logger", "message"} <= set(line) for line in lines), text
    ours = [line for line in lines if line.get("job_id") == str(job_id)]
    assert any(line.get("activity_type") and line.get("run_id") and line["workflow_id"] == f"export-{job_id}"
               for line in ours), text
    assert any(line["message"] == "worker stopped" for line in lines), text
    # The partner connection is said once, by the worker; none of the SSH library's step-by-step lines at INFO.
    assert any(line["logger"] == "activities.partner_connection" for line in ours), text
    assert not [line for line in lines if line["logger"].startswith("asyncssh") and line["level"] == "INFO"], text


def test_the_ssh_librarys_connection_steps_are_logged_at_debug_only(restored_logging):
    for level, shown in (("INFO", False), ("DEBUG", True), ("WARNING", False)):
        stream = io.StringIO()
        configure_logging(settings(log_level=level), stream)
        logging.getLogger("asyncssh").info("[conn=0] Beginning auth for user partner")
        logging.getLogger("asyncssh.sftp").warning("[conn=0, chan=0] SFTP client exited with an error")
        assert ("Beginning auth" in stream.getvalue()) is shown, (level, stream.getvalue())
        assert "SFTP client exited" in stream.getvalue(), (level, stream.getvalue())
