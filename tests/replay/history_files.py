"""Where the recorded histories live, and how one is written and read back.

Each file is the SDK's own JSON for a history (`WorkflowHistory.to_json_dict()`, the shape the Temporal CLI and UI
export too), indented so that two recordings of one case diff event by event. The workflow ID, which a replay
needs (the export workflow checks that its ID names its job), is read from the start event.
"""

from __future__ import annotations

import json
from pathlib import Path

from temporalio.client import WorkflowHistory

HISTORIES = Path(__file__).parent / "histories"


def save(folder: str, case: str, history: WorkflowHistory) -> Path:
    """Write one case's history into the folder of the code that recorded it (histories/<folder>/<case>.json)."""
    (HISTORIES / folder).mkdir(parents=True, exist_ok=True)
    path = HISTORIES / folder / f"{case}.json"
    path.write_text(json.dumps(history.to_json_dict(), indent=1) + "\n")
    return path


def recorded() -> list[Path]:
    """Every recorded history, also those kept in subfolders from before a workflow change."""
    return sorted(HISTORIES.rglob("*.json"))


def load(path: Path) -> WorkflowHistory:
    data = json.loads(path.read_text())
    started = data["events"][0]["workflowExecutionStartedEventAttributes"]
    return WorkflowHistory.from_json(started["workflowId"], data)


def workflow_type(history: WorkflowHistory) -> str:
    return history.events[0].workflow_execution_started_event_attributes.workflow_type.name


def patch_ids(history: WorkflowHistory) -> set[str]:
    """The patches whose markers the run recorded (the SDK's `core_patch` markers carry {"id": ...})."""
    found = set()
    for event in history.events:
        if event.HasField("marker_recorded_event_attributes") and \
                event.marker_recorded_event_attributes.marker_name == "core_patch":
            for payload in event.marker_recorded_event_attributes.details["patch-data"].payloads:
                found.add(json.loads(payload.data)["id"])
    return found
