"""The worker process: the export workflow, its activities, and the outbox dispatcher.

It polls two task queues: the shared one (workflows, policy, claims, cancellation requests) and its own, where
the build, cutoff 2 and the delivery of an attempt it claimed run, next to the file it built.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path

from temporalio.client import Client
from temporalio.worker import Worker

from activities.checkpoints import checkpoints_for
from activities.exports import ExportActivities
from activities.interceptors import ClassifyStoreErrors
from activities.recovery import RecoveryActivities
from activities.scavenger import keep_scavenging, scavenge
from starter.dispatcher import OutboxDispatcher
from starter.temporal import CONNECT_TIMEOUT_SECONDS, Unreachable, connect_temporal
from store.db import asyncpg_dsn, make_engine
from store.jobs import JobStore
from store.recovery import Recovery
from store.settings import Settings, get_settings
from workflows.export import ExportWorkflow
from workflows.recovery import PartnerSweepWorkflow, RecoveryWorkflow, SweeperWorkflow

log = logging.getLogger("exports.worker")


def new_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@asynccontextmanager
async def running_worker(
    settings: Settings, client: Client, *, with_dispatcher: bool = True
) -> AsyncIterator[ExportActivities]:
    """The worker's pollers (and dispatcher) run while the context is open; closing it shuts them down."""
    engine = make_engine(settings.database_url)
    store = JobStore(
        engine,
        lease_seconds=settings.lease_seconds,
        lock_timeout_ms=settings.lock_timeout_ms,
        reread_timeout_seconds=settings.reread_timeout_seconds,
    )
    worker_id = settings.worker_id or new_worker_id()
    own_queue = f"{settings.task_queue}-{worker_id}"
    activities = ExportActivities(store, settings, worker_id=worker_id, worker_task_queue=own_queue)
    activities.checkpoints = checkpoints_for(settings.hold_at, Path(settings.work_dir))
    recovery = RecoveryActivities(store, Recovery(engine, max_attempts=settings.max_attempts), client=client)
    # Cancellation reaches an activity only with a heartbeat the SDK sends: keep them frequent (FACTS.md).
    throttle = timedelta(seconds=settings.heartbeat_throttle_seconds)
    shared = Worker(
        client,
        task_queue=settings.task_queue,
        workflows=[ExportWorkflow, RecoveryWorkflow, SweeperWorkflow, PartnerSweepWorkflow],
        activities=activities.all() + recovery.all(),
        max_heartbeat_throttle_interval=throttle,
        default_heartbeat_throttle_interval=throttle,
        interceptors=[ClassifyStoreErrors()],
    )
    own = Worker(
        client,
        task_queue=own_queue,
        activities=activities.all(),
        max_heartbeat_throttle_interval=throttle,
        default_heartbeat_throttle_interval=throttle,
        interceptors=[ClassifyStoreErrors()],
    )
    try:
        await scavenge(store, Path(settings.work_dir))
    except Exception as exc:  # the database is away: the periodic pass tries again; never a reason not to start
        log.warning("scavenging %s at start failed, trying again later: %s", settings.work_dir, exc)
    stop = asyncio.Event()
    dispatcher_task = None
    dispatcher_engine = None
    try:
        async with shared, own:
            if with_dispatcher:
                dispatcher_engine = make_engine(settings.dispatcher_database_url, pool_size=2)
                dispatcher = OutboxDispatcher(
                    client,
                    dispatcher_engine,
                    asyncpg_dsn(settings.dispatcher_database_url),
                    task_queue=settings.task_queue,
                    poll_seconds=settings.dispatcher_poll_seconds,
                )
                dispatcher_task = asyncio.create_task(dispatcher.run(stop), name="outbox-dispatcher")
            scavenger = asyncio.create_task(
                keep_scavenging(store, Path(settings.work_dir), settings.scavenge_interval_seconds),
                name="scavenger")
            log.info("worker %s polling %s and %s", worker_id, settings.task_queue, own_queue)
            try:
                yield activities
            finally:
                scavenger.cancel()
                await asyncio.gather(scavenger, return_exceptions=True)
                stop.set()
                if dispatcher_task is not None:
                    await dispatcher_task
    finally:
        # Handed-over leases of attempts whose next step will not run here: left to lapse for recovery.
        await activities.close()
        if dispatcher_engine is not None:
            await dispatcher_engine.dispose()
        await engine.dispose()


async def connect_when_reachable(settings: Settings, stopping: asyncio.Event) -> Client | None:
    """Temporal, once it answers: a worker started during an outage waits, one line per try, backing off to 30 s,
    and never exits for it. None if asked to stop meanwhile."""
    delay = 1.0
    while not stopping.is_set():
        try:
            return await connect_temporal(settings, timeout=CONNECT_TIMEOUT_SECONDS)
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
    # Nothing at start assumes PostgreSQL answers either: the scavenger, the dispatcher and every step retry.
    client = await connect_when_reachable(settings, stopping)
    if client is not None:
        async with running_worker(settings, client):
            await stopping.wait()
    log.info("worker stopped")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    asyncio.run(main())
