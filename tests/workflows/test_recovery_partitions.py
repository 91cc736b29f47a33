"""Case PT3 through two real worker processes on one task queue, the Temporal dev server and PostgreSQL: one worker
reaches PostgreSQL through tests/helpers/faults.py's proxy, which goes silent once the worker polls (its way to
Temporal stays up, so it goes on taking tasks from the shared queue); the other is healthy. Recovery runs from a
Schedule defined as `exports schedules install` defines it (SKIP overlap), and from triggers of it.

The cut-off worker is seen taking a recovery step (Temporal's record of each try's worker) before the arranged lease
lapses, so the run in progress at the lapse has met it; as it turns out, that worker then also runs the run's
workflow and gets each step's first try. Each try it takes must end within the bound for finding PostgreSQL silent:
that is what keeps a run from being its hostage. The takeover must come within one recovery interval of the lapse,
the default (30 s) rather than a few seconds: Temporal fires retries on a one-second tick and the cut-off worker
takes some 70 % of them here, so the two steps (nominate, take over) may need up to some 27 tries between them (about
one chance in a thousand of more). Times of the takeover are on the database's clock."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from datetime import UTC, datetime
from pathlib import Path

import pytest
from temporalio.api.enums.v1 import EventType, PendingActivityState
from temporalio.client import ScheduleActionExecutionStartWorkflow, ScheduleActionStartWorkflow, WorkflowFailureError
from temporalio.exceptions import ActivityError, ApplicationError

from activities.contracts import RecoveryInput, RecoveryReport
from activities.recovery import ANSWER_WITHIN_SECONDS, DATABASE_UNANSWERED
from starter.schedules import RECOVERY_SCHEDULE, remove_schedules, schedules
from store.models import Status
from tests.helpers.crash import processes, start_worker
from tests.helpers.events import events, kinds
from tests.helpers.faults import fault_proxy
from tests.helpers.harness import Harness, WorkerProcess, open_harness, stranded_in_queued
from tests.helpers.store_states import drive
from tests.helpers.support import Sampler, eventually
from worker import running_worker

INTERVAL = 30.0  # the recovery interval of this test: the default
BOUND = 60.0  # no single wait of this test may take longer
# How long the cut-off worker may hold a step: the bound to find PostgreSQL silent, and the sampling's slack.
HOLD_BOUND = ANSWER_WITHIN_SECONDS + 1.0
# The line a worker logs when it leaves a recovery step to another (activities/recovery.py).
LEFT_TO_ANOTHER = "left to another worker"


def identity(process: WorkerProcess) -> str:
    """The Temporal SDK's default worker identity, which the worker keeps."""
    assert process.process is not None
    return f"{process.process.pid}@{socket.gethostname()}"


async def polling(process: WorkerProcess) -> None:
    await eventually(lambda: asyncio.sleep(0, "polling" in log_of(process)), bool, timeout=BOUND, interval=0.2,
                     what=f"worker {process.log_path.name} polling")


def log_of(process: WorkerProcess) -> str:
    path: Path = process.log_path
    return path.read_text(errors="replace") if path.exists() else ""


class StepWatch(Sampler):
    """Every 0.1 s, the recovery steps in flight in the schedule's running runs, as Temporal records them: (run,
    step, attempt, state, worker identity), and how long each started try had been held when last seen."""

    interval = 0.1

    def __init__(self, h: Harness, schedule_id: str) -> None:
        self.h = h
        self.schedule_id = schedule_id
        self.seen: list[tuple[str, str, int, str, str]] = []
        self.held: dict[tuple[str, str, int, str], float] = {}

    async def sample(self) -> None:
        schedule = self.h.client.get_schedule_handle(self.schedule_id)
        running = [a for a in (await schedule.describe()).info.running_actions
                   if isinstance(a, ScheduleActionExecutionStartWorkflow)]
        for action in running:
            described = await self.h.client.get_workflow_handle(action.workflow_id).describe()
            for p in described.raw_description.pending_activities:
                seen = (action.workflow_id, p.activity_type.name, p.attempt,
                        PendingActivityState.Name(p.state), p.last_worker_identity)
                if seen not in self.seen:
                    self.seen.append(seen)
                if p.state == PendingActivityState.PENDING_ACTIVITY_STATE_STARTED:
                    held = (datetime.now(UTC) - p.last_started_time.ToDatetime(tzinfo=UTC)).total_seconds()
                    self.held[seen[:3] + seen[4:]] = held

    def started_on(self, worker: str) -> list[tuple[str, str, int, str, str]]:
        return [s for s in self.seen if s[4] == worker and s[3] == "PENDING_ACTIVITY_STATE_STARTED"]

    def tries(self, ended: list[tuple[str, str, int, str]]) -> dict[tuple[str, str, int], str]:
        """Which worker took each try seen: a try that failed shows its worker as the next one's last worker."""
        out: dict[tuple[str, str, int], str] = {}
        for run, step, attempt, state, worker in self.seen:
            if state == "PENDING_ACTIVITY_STATE_STARTED":
                out[(run, step, attempt)] = worker
            elif attempt > 1:
                out[(run, step, attempt - 1)] = worker
        out.update({(run, step, attempt): worker for run, step, attempt, worker in ended})
        return out

    def longest_hold(self, worker: str) -> float:
        return max((held for key, held in self.held.items() if key[3] == worker), default=0.0)


@pytest.fixture
async def world(db, store, client, tmp_path) -> AsyncIterator[Harness]:
    async with AsyncExitStack() as stack:
        yield await open_harness(stack, db, store, client, tmp_path, in_process_worker=False,
                                 recovery_interval_seconds=INTERVAL)


async def running_attempt(h: Harness) -> uuid.UUID:
    """A Running attempt that no worker holds (claimed by "worker-test"), its lease an hour long for now, and no
    wake-up that a dispatcher would publish."""
    job_id = await stranded_in_queued(h)
    await drive(h.store, job_id, Status.RUNNING)
    await h.db.admin.execute("UPDATE export_jobs SET lease_expires_at = clock_timestamp() + interval '1 hour' "
                             "WHERE id = $1", job_id)
    return job_id


async def lapse(h: Harness, job_id: uuid.UUID) -> datetime:
    return await h.db.admin.fetchval("UPDATE export_jobs SET lease_expires_at = clock_timestamp() WHERE id = $1 "
                                     "RETURNING lease_expires_at", job_id)


async def ended_steps(h: Harness, workflow_ids: set[str]) -> list[tuple[str, str, int, str]]:
    """(run, step, attempt, worker identity) of each recovery step that ended, from the runs' histories: the try
    that ended it."""
    out = []
    for workflow_id in workflow_ids:
        history = await h.client.get_workflow_handle(workflow_id).fetch_history()
        scheduled = {e.event_id: e.activity_task_scheduled_event_attributes.activity_type.name
                     for e in history.events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED}
        for e in history.events:
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
                attrs = e.activity_task_started_event_attributes
                out.append((workflow_id, scheduled[attrs.scheduled_event_id], attrs.attempt, attrs.identity))
    return out


@pytest.mark.spec("PT3")
@pytest.mark.timeout(180)
async def test_recovery__a_worker_silently_cut_off_from_postgresql_never_holds_it_hostage(world: Harness):
    """The cut-off worker takes some of recovery's steps from the shared queue; each one it takes fails fast and is
    retried, soon, by whichever worker polls first. The expired attempt is taken over within one recovery interval
    of its lapse, by the run that was in progress when it lapsed or the next."""
    h = world
    schedule_id = f"pt3-recovery-{uuid.uuid4().hex[:8]}"
    async with AsyncExitStack() as stack:
        proxy = await stack.enter_async_context(fault_proxy(h.db.server))
        started = await stack.enter_async_context(processes(h))
        cut_off = await start_worker(started, h, database_url=proxy.url("exports_app", h.db.name),
                                     dispatcher_database_url=proxy.url("exports_dispatcher", h.db.name))
        healthy = await start_worker(started, h)
        await asyncio.gather(polling(cut_off), polling(healthy))
        job_id = await running_attempt(h)
        proxy.go_silent()

        schedule = schedules(h.settings)[RECOVERY_SCHEDULE]
        assert isinstance(schedule.action, ScheduleActionStartWorkflow)
        schedule.action.id = f"{schedule_id}-run"
        handle = await h.client.create_schedule(schedule_id, schedule)
        stack.push_async_callback(remove_schedules, h.client, [schedule_id])  # and its open run
        watch = StepWatch(h, schedule_id)
        watch.start()
        stack.push_async_callback(watch.stop)

        # Runs now and then, besides the schedule's, until the cut-off worker is seen with a step of one.
        async def trigger_until_cut_off_takes_a_step() -> None:
            while not watch.started_on(identity(cut_off)):
                await handle.trigger()
                await asyncio.sleep(1.0)

        await asyncio.wait_for(trigger_until_cut_off_takes_a_step(), BOUND)
        lapsed_at = await lapse(h, job_id)
        seen_at = time.monotonic()
        print(f"\nPT3: cut-off worker seen at {watch.started_on(identity(cut_off))[0]}; lease lapsed at {lapsed_at}")

        found = await eventually(lambda: events(h.db, job_id), lambda es: "RequeuedByRecovery" in kinds(es),
                                 timeout=INTERVAL * 3, interval=0.1, what="the takeover")
        taken_at = next(e["recorded_at"] for e in found if e["kind"] == "RequeuedByRecovery")
        latency = (taken_at - lapsed_at).total_seconds()
        await asyncio.sleep(0.5)  # the sampler's last look
        runs = {s[0] for s in watch.seen}
        ended = await ended_steps(h, runs)
        cut_off_lines = log_of(cut_off).count(LEFT_TO_ANOTHER)
        longest = watch.longest_hold(identity(cut_off))
        tries = watch.tries(ended)
        print(f"PT3: lapse -> takeover {latency:.2f} s (DB clock; {time.monotonic() - seen_at:.2f} s by the test's)"
              f"\n  steps seen in flight: {watch.seen}\n  steps ended (run, step, attempt, worker): {ended}"
              f"\n  cut-off worker {identity(cut_off)} held a step at most {longest:.2f} s, left {cut_off_lines} "
              f"steps to another; healthy is {identity(healthy)}"
              f"\n  tries: {sum(w == identity(cut_off) for w in tries.values())} of {len(tries)} on the cut-off worker")
        assert longest <= HOLD_BOUND, f"the cut-off worker held a recovery step {longest:.1f} s"
        assert latency < INTERVAL, f"taken over {latency:.1f} s after the lapse"
        row = await h.store.read_job(job_id)
        assert row.attempt_id is None or row.attempt_count == 2, row  # requeued: a new attempt or none yet
        # The cut-off worker took recovery steps, and said it could not act on each.
        assert watch.started_on(identity(cut_off))
        assert cut_off_lines >= 1
        assert all(worker == identity(healthy) for _, _, _, worker in ended), ended


@pytest.mark.spec("PT3")
async def test_recovery__a_run_whose_every_worker_is_cut_off_fails_within_an_interval_saying_why(world: Harness,
                                                                                                   caplog):
    """The only worker is silently cut off from PostgreSQL. The run does not hang, nor end in silence: each try of
    its first step fails within the bound, and the run fails before the next would be due (the default interval,
    30 s), naming the worker and why; the last try logs that the run could not act."""
    h = world
    async with AsyncExitStack() as stack:
        proxy = await stack.enter_async_context(fault_proxy(h.db.server))
        stack.callback(proxy.heal)  # before the worker shuts down
        settings = h.settings.model_copy(update={"database_url": proxy.url("exports_app", h.db.name)})
        await stack.enter_async_context(running_worker(settings, h.client, with_dispatcher=False))
        proxy.go_silent()
        started = time.monotonic()
        with caplog.at_level(logging.INFO, logger="activities.recovery"), pytest.raises(WorkflowFailureError) as failed:
            await asyncio.wait_for(h.client.execute_workflow(
                "RecoveryWorkflow", RecoveryInput(limit=h.settings.recovery_batch),
                id=f"pt3-alone-{uuid.uuid4().hex[:8]}", task_queue=h.settings.task_queue,
                result_type=RecoveryReport), BOUND)
        took = time.monotonic() - started
        step = failed.value.cause
        assert isinstance(step, ActivityError), step
        cause = step.cause
        print(f"\nPT3 alone: the run failed after {took:.1f} s: {cause}")
        assert isinstance(cause, ApplicationError) and cause.type == DATABASE_UNANSWERED, cause
        assert "nominate_expired on worker" in cause.message and "did not answer" in cause.message, cause.message
        assert took < INTERVAL
        assert [r for r in caplog.records if r.levelno == logging.ERROR and "could not act" in r.getMessage()]
