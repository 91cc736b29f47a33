"""The bench's count of Temporal actions (C1, bench/cost.py) read against histories recorded on a real server: it
follows Temporal Cloud's published rules, so that the row says what an export would be billed, not how many of its
events look billable."""

from __future__ import annotations

from temporalio.api.enums.v1 import EventType

from bench.cost import history_actions
from tests.replay.history_files import HISTORIES, load

TCV = "the SDK's TemporalChangeVersion upsert for a patch"
WITH_START = "the signal of a signal-with-start, one action with the start"
MARKER_TASKS = "workflow tasks that recorded markers, one each"


def test_a_small_export_counts_its_start_once_its_steps_and_status_upserts_and_each_task_with_markers():
    history = load(HISTORIES / "0.3.0" / "export_completed.json")
    kinds = [history.events[0].event_type, history.events[1].event_type]
    assert kinds == [EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED, EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED]
    total, billed, exempt = history_actions(history)
    # Signal-with-start is one action; the patches' TemporalChangeVersion upserts are exempt; the two patch markers,
    # each in its own workflow task, count one each.
    assert billed == {"workflow_execution_started": 1, "activity_task_scheduled": 4,
                      "upsert_workflow_search_attributes": 3, MARKER_TASKS: 2}, billed
    assert exempt == {TCV: 2, WITH_START: 1}, exempt
    assert total == 10


def test_a_wake_up_signal_to_a_run_already_open_is_counted():
    history = load(HISTORIES / "0.3.0" / "export_woken_during_delivery.json")
    _, billed, exempt = history_actions(history)
    assert billed["workflow_execution_signaled"] == 1 and exempt[WITH_START] == 1, (billed, exempt)


def test_a_signal_second_in_a_history_is_not_taken_for_one_that_came_with_the_start():
    history = load(HISTORIES / "0.3.0" / "export_completed.json")
    started, signaled = history.events[0], history.events[1]
    del history.events[:]
    history.events.extend([signaled, started])  # a signal first: not a signal-with-start's
    _, billed, exempt = history_actions(history)
    assert billed["workflow_execution_signaled"] == 1 and WITH_START not in exempt, (billed, exempt)
