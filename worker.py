"""The worker process: the export workflow, its activities, and the outbox dispatcher.

It polls three task queues: the shared one (workflows, recovery, cancellation requests), the admission queue
(policy and the claim, polled only while it has a build slot free: activities/capacity.py), and its own, where the
build, cutoff 2 and the delivery of an attempt it claimed run, next to the file it built.

SIGTERM (or SIGINT): the worker stops taking tasks; a build hands its attempt back (its lease ends, and the
workflow resumes it elsewhere at once); an upload in flight has `shutdown_grace_seconds` to end (the SDK's
graceful shutdown timeout) and, since an upload ignores cancellation, the process exits at the latest
`shutdown_grace_seconds + 5` after the signal, leaving an upload that has not ended to recovery, as after a crash.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path
from typing import TypedDict

from temporalio.client import Client
from temporalio.worker import FixedSizeSlotSupplier, Interceptor, Worker, WorkerTuner

from activities.capacity import AdmissionSlots
from activities.checkpoints import checkpoints_for
from activities.exports import ExportActivities
from activities.interceptors import ClassifyStoreErrors
from activities.process import endpoint, metrics, tracing
from activities.process.allocator import configure_allocator
from activities.process.dispatcher import OutboxDispatcher
from activities.process.logs import configure_logging, settings_or_exit
from activities.process.scavenger import keep_scavenging, scavenge
from activities.process.temporal import (
    CONNECT_TIMEOUT_SECONDS,
    NotConfigured,
    Unreachable,
    connect_temporal,
    exit_now,
)
from activities.process.workflow_code import compile_workflow_modules_once
from activities.recovery import RecoveryActivities
from starter import preflight
from store import errors
from store.db import Bounds, asyncpg_dsn, make_engine
from store.jobs import JobStore
from store.outbox import Outbox
from store.recovery import Recovery
from store.settings import Settings, get_settings
from workflows import patches
from workflows.export import ExportWorkflow
from workflows.identity import admission_queue
from workflows.recovery import (
    EvidenceFollowUpWorkflow,
    PartnerSweepWorkflow,
    RecoveryWorkflow,
    SweeperWorkflow,
)

log = logging.getLogger("exports.worker")

# What the worker runs and how: the replay test (tests/replay) replays recorded histories with the same.
WORKFLOWS = [ExportWorkflow, RecoveryWorkflow, SweeperWorkflow, PartnerSweepWorkflow, EvidenceFollowUpWorkflow]


def workflow_interceptors() -> list[ClassifyStoreErrors]:
    return [ClassifyStoreErrors()]


class WorkerOptions(TypedDict):
    """What both of a process's Temporal workers (the shared queue's and its own) are given alike."""

    max_heartbeat_throttle_interval: timedelta
    default_heartbeat_throttle_interval: timedelta
    interceptors: Sequence[Interceptor]
    graceful_shutdown_timeout: timedelta
    on_fatal_error: Callable[[BaseException], Awaitable[None]]


def new_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@asynccontextmanager
async def running_worker(
    settings: Settings, client: Client, *, with_dispatcher: bool = True, health: endpoint.Health | None = None,
) -> AsyncIterator[ExportActivities]:
    """The worker's pollers (and dispatcher) run while the context is open; closing it shuts them down. `health`,
    when given, is kept up to date for the probes."""
    health = health if health is not None else endpoint.Health()
    # Each run the worker starts imports these in a sandbox of its own (activities/process/workflow_code.py).
    compile_workflow_modules_once({cls.__module__.partition(".")[0] for cls in WORKFLOWS})
    engine = make_engine(settings.database_url, pool_size=settings.database_pool_size,
                         max_overflow=settings.database_max_overflow, bounds=Bounds.of(settings))
    store = JobStore(
        engine,
        lease_seconds=settings.lease_seconds,
        lock_timeout_ms=settings.lock_timeout_ms,
        reread_timeout_seconds=settings.reread_timeout_seconds,
        on_ended=metrics.ended,
    )
    worker_id = settings.worker_id or new_worker_id()
    own_queue = f"{settings.task_queue}-{worker_id}"
    activities = ExportActivities(store, settings, worker_id=worker_id, worker_task_queue=own_queue)
    activities.checkpoints = checkpoints_for(settings.hold_at, Path(settings.work_dir))
    recovery = RecoveryActivities(
        store, Recovery(engine, max_attempts=settings.max_attempts, max_hand_backs=settings.max_hand_backs,
                        max_shared_losses=settings.max_shared_losses,
                        max_losses_amid_others=settings.max_losses_amid_others,
                        renew_seconds=settings.renew_every_seconds,
                        together_seconds=settings.lease_seconds + settings.recovery_interval_seconds,
                        on_ended=metrics.ended), client=client,
        view_window_seconds=settings.recovery_view_window_seconds)
    # The SDK sends a step's heartbeats at most this often whatever the step asks: at the lease's cadence (LD6).
    throttle = timedelta(seconds=settings.heartbeat_seconds)
    common = WorkerOptions(
        max_heartbeat_throttle_interval=throttle,
        default_heartbeat_throttle_interval=throttle,
        interceptors=workflow_interceptors(),
        graceful_shutdown_timeout=timedelta(seconds=settings.shutdown_grace_seconds),
        on_fatal_error=_record_fatal(health),
    )
    shared = Worker(
        client,
        task_queue=settings.task_queue,
        workflows=WORKFLOWS,
        # A run cached on a worker that died waits this long on that worker's sticky queue before any worker takes
        # its next task: part of how soon a killed worker's build resumes elsewhere (LV6).
        sticky_queue_schedule_to_start_timeout=timedelta(seconds=settings.sticky_queue_timeout_seconds),
        # A patch this release only understands is replayed where recorded, never written (workflows/patches.py).
        patch_activation_callback=patches.activation(settings.early_patch_ids),
        activities=activities.all() + recovery.all(),
        **common,
    )
    capacity = activities.capacity
    # Build and upload slots bound the work (activities/capacity.py); the SDK's activity slots on the own queue are
    # sized so that a step of an attempt never waits for one (it would be taken for a lost worker).
    own = Worker(client, task_queue=own_queue, activities=activities.all(),
                 max_concurrent_activities=max(100, 2 * (settings.max_builds + settings.max_uploads)), **common)
    # Claims, polled only while a build slot is free: a busy worker takes no export (LD1).
    admission = Worker(
        client, task_queue=admission_queue(settings.task_queue), activities=[activities.claim_if_allowed],
        tuner=WorkerTuner.create_composite(
            workflow_supplier=FixedSizeSlotSupplier(1),
            activity_supplier=AdmissionSlots(capacity.builds, asyncio.get_running_loop()),
            local_activity_supplier=FixedSizeSlotSupplier(1),
            nexus_supplier=FixedSizeSlotSupplier(1)),
        **common)
    try:
        await scavenge(store, Path(settings.work_dir))
    except Exception as exc:  # the database is away: the periodic pass tries again; never a reason not to start
        log.warning("scavenging %s at start failed, trying again later: %s", settings.work_dir, exc)
    stop = asyncio.Event()
    dispatcher_task = None
    dispatcher_engine = None
    try:
        async with shared, own, admission:
            if with_dispatcher:
                dispatcher_engine = make_engine(settings.dispatcher_database_url,
                                                pool_size=settings.dispatcher_pool_size,
                                                max_overflow=settings.dispatcher_max_overflow,
                                                bounds=Bounds.of(settings))
                dispatcher = OutboxDispatcher(
                    client,
                    Outbox(dispatcher_engine, lock_idle_seconds=settings.dispatcher_lock_idle_seconds),
                    asyncpg_dsn(settings.dispatcher_database_url),
                    task_queue=settings.task_queue,
                    poll_seconds=settings.dispatcher_poll_seconds,
                    concurrency=settings.dispatcher_concurrency,
                    bounds=Bounds.of(settings),
                )
                dispatcher_task = asyncio.create_task(dispatcher.run(stop), name="outbox-dispatcher")
                dispatcher_task.add_done_callback(lambda task: None if stop.is_set() else _dispatcher_died(task))
                health.dispatcher = dispatcher_task
            health.workers = (shared, own, admission)
            scavenger = asyncio.create_task(
                keep_scavenging(store, Path(settings.work_dir), settings.scavenge_interval_seconds),
                name="scavenger")
            log.info("worker %s polling %s, %s and %s (%d builds, %d uploads at once)", worker_id, settings.task_queue,
                     own_queue, admission_queue(settings.task_queue), settings.max_builds, settings.max_uploads)
            if settings.early_patch_ids:
                log.warning("worker %s activates %s early (EXPORTS_EARLY_PATCHES): a rollback to the previous release "
                            "must first drain the runs that record it", worker_id, settings.early_patches)
            try:
                yield activities
            finally:
                log.info("worker %s stops taking tasks; running steps have %g s to end", worker_id,
                         settings.shutdown_grace_seconds)
                # Both at once: a queue still polled while the other shuts down would take back handed-back work.
                shutting_down = asyncio.gather(shared.shutdown(), own.shutdown(), admission.shutdown())
                await asyncio.sleep(0)  # the shutdowns begin: no more polls
                await activities.hand_back_between_steps()
                await shutting_down
                scavenger.cancel()
                await asyncio.gather(scavenger, return_exceptions=True)
                health.dispatcher = None  # asked to end: its end is no longer a failure
                stop.set()
                if dispatcher_task is not None:
                    # An end that came earlier, unasked, was logged then and is on /livez.
                    await asyncio.gather(dispatcher_task, return_exceptions=True)
    finally:
        # Handed-over leases of attempts whose next step will not run here: left to lapse for recovery.
        await activities.close()
        if dispatcher_engine is not None:
            await dispatcher_engine.dispose()
        await engine.dispose()


def _dispatcher_died(task: asyncio.Task[None]) -> None:
    error = None if task.cancelled() else task.exception()
    log.error("the outbox dispatcher stopped%s; /livez says so, so that the process is restarted",
              f": {errors.describe(error)}" if error else "")


def _record_fatal(health: endpoint.Health) -> Callable[[BaseException], Awaitable[None]]:
    async def record(error: BaseException) -> None:
        # The SDK shuts the failed worker down and ends the process's `async with`: until then, the probes say so.
        health.fatal = errors.describe(error)
        log.error("a Temporal worker failed, the process exits: %s", health.fatal)

    return record


async def connect_when_reachable(settings: Settings, stopping: asyncio.Event) -> Client | None:
    """Temporal, once it answers: a worker started during an outage waits, one line per try, backing off to 30 s,
    and never exits for it. None if asked to stop meanwhile. Settings that name no usable connection (a malformed
    address, an unknown profile) are `NotConfigured`, raised at once: waiting cannot mend them."""
    delay = 1.0
    while not stopping.is_set():
        try:
            return await connect_temporal(settings, timeout=CONNECT_TIMEOUT_SECONDS)
        except NotConfigured:
            raise
        except Unreachable as exc:
            log.warning("%s; trying again in %.0f s", exc, delay)
        try:
            await asyncio.wait_for(stopping.wait(), delay)
        except TimeoutError:
            pass
        delay = min(delay * 2, 30.0)
    return None


async def main() -> None:
    settings = get_settings()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    # Before the client connects: the SDK's metrics live in the runtime a client is created with.
    observing = await endpoint.start(settings, stopping)
    tracing.configure(settings)
    # Nothing at start assumes PostgreSQL answers either: the scavenger, the dispatcher and every step retry, and
    # the preflight's database checks wait for it.
    client = await connect_when_reachable(settings, stopping)
    # Before any poller or the dispatcher starts: what this release needs of Temporal and the database, each
    # missing piece one line, and PreflightFailed (exit status 2) having taken no task (starter/preflight.py).
    checked = await preflight.before_polling(settings, client, stopping) if client is not None else None
    late_problems: list[str] = []
    if client is not None and checked is not None and not stopping.is_set():
        async with running_worker(settings, tracing.traced(client, settings), health=observing.health,
                                  with_dispatcher=settings.dispatcher_enabled):
            later = None
            if checked.waiting and not stopping.is_set():
                later = asyncio.create_task(_database_checks_later(settings, checked.waiting, stopping,
                                                                   late_problems))
            await stopping.wait()
            # An upload ignores its cancellation, so the SDK's shutdown could wait for it: bound the exit.
            loop.call_later(settings.shutdown_grace_seconds + 5, _exit_past_the_bound, 2 if late_problems else 0)
            if later is not None:
                await asyncio.gather(later, return_exceptions=True)
    await observing.close()
    tracing.flush()
    log.info("worker stopped")
    if late_problems:
        raise preflight.PreflightFailed(late_problems)


async def _database_checks_later(settings: Settings, waiting: tuple[preflight.Role, ...], stopping: asyncio.Event,
                                 problems: list[str]) -> None:
    """The database checks of a worker that started while PostgreSQL did not answer, once it does: a problem
    stops the worker as SIGTERM would, and it exits with status 2."""
    problems.extend(await preflight.database_later(settings, waiting, stopping))
    if problems:
        stopping.set()


def _exit_past_the_bound(code: int) -> None:
    log.warning("shutdown bound passed: exiting; an upload that has not ended is left to recovery")
    exit_now(code)


class OneLineFailures(logging.Filter):
    """The SDK logs each failed activity attempt with its traceback; a retried step would print one per retry.
    Here each says its error in one line (the full error is in the workflow's history, in the Temporal UI)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None and record.name.startswith("temporalio"):
            record.msg = f"{record.getMessage()}: {errors.describe(record.exc_info[1])}"
            record.args = None
            record.exc_info = None
            record.exc_text = None
        return True


def configure_worker_logging(settings: Settings) -> None:
    """The worker's logs, whichever way it starts (`python -m worker`, `exports worker`): EXPORTS_LOG_FORMAT and
    EXPORTS_LOG_LEVEL, a failed activity attempt in one line."""
    configure_logging(settings).addFilter(OneLineFailures())


if __name__ == "__main__":
    # A malformed setting is one line and exit status 2.
    configure_worker_logging(settings_or_exit(get_settings))
    # Before the SDK's runtime allocates anything.
    settings = get_settings()
    for done in configure_allocator(settings.malloc_mmap_threshold_bytes, settings.malloc_trim_interval_seconds):
        log.info("memory: %s", done)
    try:
        asyncio.run(main())
    except preflight.PreflightFailed:  # its lines are logged: Kubernetes restarts the pod, the log says why
        exit_now(2)
    except NotConfigured as exc:
        log.error("%s", exc)
        exit_now(2)
    except Exception:  # a Temporal worker's fatal error, said once more with its traceback
        log.exception("the worker stopped on an error")
        exit_now(1)
    exit_now(0)
