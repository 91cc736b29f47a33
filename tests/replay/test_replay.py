"""Every recorded history (histories/, written by `make histories`) replayed against today's workflow code.

A change to a workflow that alters the commands an existing run already recorded (an activity added, removed,
moved or renamed, a timer, a search attribute update, a patch marker) fails here with the SDK's nondeterminism
error, before it reaches a worker that would fail those runs' workflow tasks. docs/changing-workflows.md has the
rule for such changes. The Replayer runs in this process: no PostgreSQL, Temporal or SFTP server is involved.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from tests.replay.history_files import HISTORIES, load, recorded, workflow_type
from worker import WORKFLOWS, workflow_interceptors


def replayer() -> Replayer:
    # The worker's workflows and interceptors, and the converter its client connects with
    # (activities/process/temporal.py); the sandbox is the SDK's default in both.
    return Replayer(workflows=WORKFLOWS, data_converter=pydantic_data_converter, interceptors=workflow_interceptors())


def case_name(path: Path) -> str:
    return path.relative_to(HISTORIES).with_suffix("").as_posix()


@pytest.mark.parametrize("path", recorded(), ids=case_name)
async def test_replay__recorded_history_replays_on_todays_workflow_code(path: Path):
    history = load(path)
    result = await replayer().replay_workflow(history)
    assert result.replay_failure is None


def test_replay__every_registered_workflow_type_has_a_recorded_history():
    recorded_types = {workflow_type(load(path)) for path in recorded()}
    registered = {cls.__name__ for cls in WORKFLOWS}
    assert registered <= recorded_types, f"no recorded history for {sorted(registered - recorded_types)}: " \
                                         "add a case to tests/replay/record_histories.py and run `make histories`"
