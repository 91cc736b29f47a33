"""The state of one export's run, in one place, and what the run's parts share: the short steps' options and how a
step's failure reads in one line."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import TYPE_CHECKING, TypedDict

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, FailureError

with workflow.unsafe.imports_passed_through():
    from activities.contracts import BuildOutput
    from store.models import JobRow

# Short steps on the shared queue: each is a conditional statement, safe to retry, but never without bound (about
# four minutes of retries ride out a database restart); a definite refusal is not retried at all (the worker's
# ClassifyStoreErrors interceptor makes it non-retryable).
if TYPE_CHECKING:  # only: a TypedDict class costs each run's import more than the dict it describes
    class StepOptions(TypedDict):
        start_to_close_timeout: timedelta
        retry_policy: RetryPolicy


SHORT_STEP: StepOptions = {
    "start_to_close_timeout": timedelta(seconds=30),
    "retry_policy": RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=30),
                                maximum_attempts=10),
}
# Without a wake-up, the run still reads its row this often (EXPORTS_IDLE_RECHECK_SECONDS, as the last claim step
# reported it; this until one has).
IDLE_RECHECK = timedelta(minutes=5)


class RunState:
    """What the run knows between its steps. Everything else is read from the row.

    A plain class, not a dataclass: the sandbox runs this module again for every run, and a dataclass compiles its
    generated methods each time (about 1.5 ms of a small export's worker CPU)."""

    def __init__(self) -> None:
        self.row: JobRow | None = None  # as last read: what the `row` query answers
        # The tenant the run's start named (its creation's, else its fairness key), until the row is read.
        self.start_tenant: uuid.UUID | None = None
        self.woken = False  # a wake-up arrived since the row was last read
        self.seen_messages: set[str] = set()  # wake-ups taken, by outbox message ID
        self.stop_seen = False  # a stop request is recorded: no build starts, a running one is cancelled
        self.canceled_seen = False  # a recorded request found or left the row Canceled: nothing left to claim
        self.temporal_cancel = False  # Temporal's cancel of the run, not yet a stop request (the row is not known)
        self.build: workflow.ActivityHandle[BuildOutput] | None = None  # the build in flight, which a stop cancels
        self.delivered_row: JobRow | None = None  # the row the delivery's terminal write left, read back at once
        # The attempt whose cutoff 2 the run gave up, until its next read has named it, so that the step, if it
        # goes on, authorizes nothing (run_waits_on_attempt.sql). Once read, the row can never be that attempt's
        # Running row again unmarked.
        self.cutoff_2_given_up: uuid.UUID | None = None
        self.idle_recheck = IDLE_RECHECK
        # The run has paused once before continuing as new (`_wait_for_wake`): the suggestion is then known, and
        # what makes the run free to continue later ends a step or a timer, applied with any cancel of that task.
        self.paused_before_continuing = False
        self.why = ""  # how the last step ended, for the UI


def cause(err: ActivityError) -> str:
    """The one-line message of what made a step fail."""
    innermost: BaseException = err
    while innermost.__cause__ is not None:
        innermost = innermost.__cause__
    if isinstance(innermost, FailureError) and innermost.message:
        return innermost.message  # without the type the SDK prefixes: the step's own sentence
    return str(innermost) or type(innermost).__name__
