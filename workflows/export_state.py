"""The state of one export's run, in one place, and what the run's parts share: the short steps' options and how a
step's failure reads in one line."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypedDict

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, FailureError

with workflow.unsafe.imports_passed_through():
    from activities.contracts import BuildOutput
    from store.models import JobRow

# Short steps on the shared queue: each is a conditional statement, safe to retry, but never without bound (about
# four minutes of retries ride out a database restart); a definite refusal is not retried at all (the worker's
# ClassifyStoreErrors interceptor makes it non-retryable).
class StepOptions(TypedDict):
    start_to_close_timeout: timedelta
    retry_policy: RetryPolicy


SHORT_STEP = StepOptions(
    start_to_close_timeout=timedelta(seconds=30),
    retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=30),
                             maximum_attempts=10),
)
# Without a wake-up, the run still reads its row this often (EXPORTS_IDLE_RECHECK_SECONDS, as the last claim step
# reported it; this until one has).
IDLE_RECHECK = timedelta(minutes=5)


@dataclass
class RunState:
    """What the run knows between its steps. Everything else is read from the row."""

    row: JobRow | None = None  # as last read: what the `row` query answers
    # The tenant the run's start named (its creation's, else its fairness key), until the row is read.
    start_tenant: uuid.UUID | None = None
    woken: bool = False  # a wake-up arrived since the row was last read
    seen_messages: set[str] = field(default_factory=set)  # wake-ups taken, by outbox message ID
    stop_seen: bool = False  # a stop request is recorded: no build starts, a running one is cancelled
    temporal_cancel: bool = False  # Temporal's cancel of the run, not yet a stop request (the row is not known)
    build: workflow.ActivityHandle[BuildOutput] | None = None  # the build in flight, which a stop cancels
    delivered_row: JobRow | None = None  # the row the delivery's terminal write left, read back at once
    idle_recheck: timedelta = IDLE_RECHECK
    why: str = ""  # how the last step ended, for the UI


def cause(err: ActivityError) -> str:
    """The one-line message of what made a step fail."""
    innermost: BaseException = err
    while innermost.__cause__ is not None:
        innermost = innermost.__cause__
    if isinstance(innermost, FailureError) and innermost.message:
        return innermost.message  # without the type the SDK prefixes: the step's own sentence
    return str(innermost) or type(innermost).__name__
