"""The outbox dispatcher against a row whose publication Temporal refuses for good (found by review), and its stop
with a backlog: one row never holds back the rest, and a stop ends the pass, not the backlog."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import pytest

from activities.contracts import ExportInput
from activities.process.dispatcher import OutboxDispatcher
from store.db import asyncpg_dsn, make_engine
from store.outbox import Outbox
from tests.helpers.own_temporal import own_server, spend_signal_quota
from tests.helpers.support import create_job, seed_tenant
from workflows.identity import export_workflow_id

SIGNAL_CAP = 20
OTHERS = 150
WINDOW = 8.0  # seconds: at least this long for each phase; healthy, 150 rows take about a second here
POLL = 2.0  # the shipped EXPORTS_DISPATCHER_POLL_SECONDS


async def run_until_published(dispatcher: OutboxDispatcher, db, job_ids: list[uuid.UUID], bound: float) -> float:
    """Runs the dispatcher until every row of `job_ids` is published, or `bound` seconds; how long it took."""
    stop = asyncio.Event()
    task = asyncio.create_task(dispatcher.run(stop))
    started = time.monotonic()
    try:
        while await unpublished(db, job_ids) and time.monotonic() - started < bound:
            await asyncio.sleep(0.05)
        return time.monotonic() - started
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def unpublished(db, job_ids: list[uuid.UUID]) -> int:
    return await db.admin.fetchval(
        "SELECT count(*) FROM outbox WHERE job_id = ANY($1::uuid[]) AND published_at IS NULL", job_ids)


@pytest.mark.spec("TW8", "FG4")
async def test_one_export_whose_run_refuses_signals_holds_back_every_other_tenants_wakeups(db, store, tmp_path,
                                                                                          caplog):
    caplog.set_level(logging.WARNING, logger="activities.dispatcher")
    async with own_server(tmp_path, {"history.maximumSignalsPerExecution": SIGNAL_CAP}) as client:
        queue = f"refusals-{uuid.uuid4().hex[:8]}"  # nobody polls it: the runs are only started and signalled
        engine = make_engine(db.url("dispatcher"))
        try:
            dispatcher = OutboxDispatcher(client, Outbox(engine), asyncpg_dsn(db.url("dispatcher")),
                                          task_queue=queue, poll_seconds=POLL)
            tenant_a, tenant_b = await seed_tenant(db.admin), await seed_tenant(db.admin)

            # Control: a healthy backlog of another tenant's wake-ups, and how long it takes on this machine now.
            control = [await create_job(store, *tenant_b) for _ in range(OTHERS)]
            healthy = await run_until_published(dispatcher, db, control, 60.0)
            assert await unpublished(db, control) == 0, "control: the healthy backlog was not published"
            bound = max(WINDOW, 3 * healthy)  # one wave per poll (the defect) takes about 20 s

            # Tenant A's export whose open run takes no more signals: anyone who may signal it (junk cancels, LD7)
            # spends the server's per-run quota. Its wake-up (a requeue's, a sweep's) can then never be published.
            poisoned = await create_job(store, *tenant_a)
            handle = await client.start_workflow("ExportWorkflow", ExportInput(job_id=poisoned),
                                                 id=export_workflow_id(poisoned), task_queue=queue)
            await spend_signal_quota(handle, 3 * SIGNAL_CAP)

            # Tenant B's next backlog, the same size as the control's.
            others = [await create_job(store, *tenant_b) for _ in range(OTHERS)]
            await run_until_published(dispatcher, db, others + [poisoned], bound)
            left = await unpublished(db, others)
            warnings = [r.getMessage() for r in caplog.records if str(poisoned) in r.getMessage()]
            assert left == 0, (f"{left} of {OTHERS} other-tenant wake-ups still unpublished after {bound:.1f} s "
                               f"(the healthy control published all {OTHERS} in {healthy:.1f} s); the poisoned row "
                               f"was retried {len(warnings)} times, e.g. {warnings[:1]}")
            # The refused row itself was given up, said twice: at its first refusal, and when given up.
            assert await unpublished(db, [poisoned]) == 0
            assert len(warnings) == 2 and "given up" in warnings[-1], warnings
        finally:
            await engine.dispose()


@pytest.mark.spec("TW8")
async def test_a_dispatcher_asked_to_stop_ends_its_pass_rather_than_drain_the_whole_backlog(db, store, tmp_path):
    """worker.py's shutdown sets the dispatcher's stop event and then waits for its task without a bound. `run`
    looks at the event only once a pass comes back short, so with a backlog (after an outage, a burst) the worker's
    shutdown waits until the whole backlog is published: its length, not one pass, bounds the shutdown."""
    backlog = 1000
    async with own_server(tmp_path, {}) as client:
        queue = f"refusals-{uuid.uuid4().hex[:8]}"
        engine = make_engine(db.url("dispatcher"))
        try:
            tenant = await seed_tenant(db.admin)
            jobs = [await create_job(store, *tenant) for _ in range(backlog)]
            dispatcher = OutboxDispatcher(client, Outbox(engine), asyncpg_dsn(db.url("dispatcher")),
                                          task_queue=queue, poll_seconds=POLL)
            stop = asyncio.Event()
            task = asyncio.create_task(dispatcher.run(stop))
            deadline = time.monotonic() + 30
            while await unpublished(db, jobs) == backlog:
                assert time.monotonic() < deadline, "nothing published"
                await asyncio.sleep(0.02)
            stop.set()  # as worker.py's shutdown does
            asked = time.monotonic()
            left_when_asked = await unpublished(db, jobs)
            await asyncio.wait_for(task, 300)
            took = time.monotonic() - asked
            after = left_when_asked - await unpublished(db, jobs)
            assert took <= 3.0, (f"the dispatcher took {took:.1f} s to stop and published {after} more rows after "
                                 f"it was asked ({left_when_asked} were left then)")
        finally:
            await engine.dispose()
