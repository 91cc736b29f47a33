"""Every payload of every recorded history decodes into today's contracts (case UP2).

A worker that takes over a run recorded by an earlier release decodes what that release wrote: the workflow's
start input, its signals and its result, and every activity's input (an activity task scheduled before the deploy
is started after it) and result. Replay alone does not cover this: the workflow decodes only the results it awaits,
never an activity's input. A model field added without a default fails here, with the history and the event that
carry the old payload.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
from temporalio import activity, workflow
from temporalio.api.common.v1 import Payloads
from temporalio.api.history.v1 import HistoryEvent
from temporalio.contrib.pydantic import pydantic_data_converter

from activities.contracts import CancelRequest, ExportInput
from activities.exports import ExportActivities
from activities.recovery import RecoveryActivities
from tests.replay.history_files import HISTORIES, load, recorded, workflow_type
from worker import WORKFLOWS

# Entry points typed loosely on purpose (a broken payload is rejected inside the workflow, visibly, not by the SDK's
# decoding), and the model each validates with.
VALIDATED_AS: dict[tuple[str, str], type] = {
    ("ExportWorkflow", "run"): ExportInput,
    ("ExportWorkflow", "signal cancel"): CancelRequest,
}


def activity_types() -> dict[str, activity._Definition]:
    found = {}
    for cls in (ExportActivities, RecoveryActivities):
        for _, fn in inspect.getmembers(cls):
            definition = activity._Definition.from_callable(fn)
            if definition is not None:
                found[definition.name] = definition
    return found


def decode(payloads: Payloads, types: list[Any]) -> None:
    if payloads.payloads and types:
        pydantic_data_converter.payload_converter.from_payloads(payloads.payloads[:len(types)], types)


def typed(hint: Any, workflow_name: str, entry: str) -> Any:
    return VALIDATED_AS.get((workflow_name, entry), hint) if hint is Any else hint


def payload_problems(path: Path) -> list[str]:
    history = load(path)
    name = workflow_type(history)
    definition = workflow._Definition.from_class(next(cls for cls in WORKFLOWS if cls.__name__ == name))
    activities = activity_types()
    scheduled: dict[int, str] = {}
    problems = []

    def check(event: HistoryEvent, what: str, payloads: Payloads, types: list[Any]) -> None:
        try:
            decode(payloads, types)
        except Exception as exc:  # the converter wraps pydantic's ValidationError; its message names the field
            problems.append(f"{path.relative_to(HISTORIES)} event {event.event_id}, {what}: {exc}")

    for event in history.events:
        if event.HasField("workflow_execution_started_event_attributes"):
            attrs = event.workflow_execution_started_event_attributes
            check(event, f"{name} start input", attrs.input,
                  [typed(t, name, "run") for t in definition.arg_types or []])
        elif event.HasField("workflow_execution_signaled_event_attributes"):
            attrs = event.workflow_execution_signaled_event_attributes
            signal = definition.signals.get(attrs.signal_name)
            if signal is None:
                problems.append(f"{path.relative_to(HISTORIES)} event {event.event_id}: signal {attrs.signal_name!r} "
                                "has no handler today")
                continue
            check(event, f"signal {attrs.signal_name}", attrs.input,
                  [typed(t, name, f"signal {attrs.signal_name}") for t in signal.arg_types or []])
        elif event.HasField("activity_task_scheduled_event_attributes"):
            attrs = event.activity_task_scheduled_event_attributes
            scheduled[event.event_id] = attrs.activity_type.name
            known = activities.get(attrs.activity_type.name)
            if known is None:
                problems.append(f"{path.relative_to(HISTORIES)} event {event.event_id}: activity "
                                f"{attrs.activity_type.name!r} is not registered today (a task scheduled before "
                                "the deploy would find no worker)")
                continue
            check(event, f"{known.name} input", attrs.input, list(known.arg_types or []))
        elif event.HasField("activity_task_completed_event_attributes"):
            attrs = event.activity_task_completed_event_attributes
            known = activities.get(scheduled.get(attrs.scheduled_event_id, ""))
            if known is not None and known.ret_type not in (None, type(None)):
                check(event, f"{known.name} result", attrs.result, [known.ret_type])
        elif event.HasField("workflow_execution_completed_event_attributes"):
            attrs = event.workflow_execution_completed_event_attributes
            if definition.ret_type not in (None, type(None)):
                check(event, f"{name} result", attrs.result, [definition.ret_type])
    return problems


@pytest.mark.spec("UP2")
@pytest.mark.parametrize("path", recorded(), ids=lambda p: p.relative_to(HISTORIES).with_suffix("").as_posix())
def test_contracts__every_recorded_payload_decodes_into_todays_models(path: Path):
    problems = payload_problems(path)
    assert not problems, "payloads an earlier run wrote that today's contracts refuse (give the new field a " \
                         "default):\n" + "\n".join(problems)
