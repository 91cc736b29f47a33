"""The worker's stop listener (activities/stop_watch.py) on its own, reaching PostgreSQL through
tests/helpers/faults.py's proxy: a build whose watch is cancelled while the listener's first connect is still
unanswered leaves no watch behind, and the listener goes on to listen for the builds that follow."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import asyncpg
import pytest

from activities.stop_watch import StopListener, StopWatch
from store.db import Bounds, asyncpg_dsn, make_engine
from store.jobs import JobStore
from store.models import CancellationOutcome, ClaimResult
from tests.helpers.support import create_job, eventually, seed_tenant

BOUNDS = Bounds(statement_seconds=2.0, connect_seconds=1.5, tcp_user_timeout_seconds=4)
BOUND = 20.0


@pytest.mark.spec("PT4")
async def test_a_watch_cancelled_while_the_listener_first_connects_is_not_left_behind(db, store, proxy):
    listener = StopListener(asyncpg_dsn(proxy.url("exports_app", db.name)), BOUNDS, check_every=0.5)
    try:
        proxy.hold_new_connections()
        watch = StopWatch(listener, store, uuid.uuid4(), uuid.uuid4(), on_stop=lambda: None)
        entering = asyncio.create_task(watch.__aenter__())
        await asyncio.sleep(0.5)
        assert not entering.done(), "entered before the listener's first try ended"
        entering.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(entering, BOUND)
        assert listener._watches == {}, listener._watches  # the only place a watch is held

        proxy.accept_new_connections()
        async with StopWatch(listener, store, uuid.uuid4(), uuid.uuid4(), on_stop=lambda: None):
            await eventually(lambda: asyncio.sleep(0, proxy.open_connections), lambda n: n >= 1, timeout=BOUND,
                             what="the listener listening")
            assert len(listener._watches) == 1
        assert listener._watches == {}
    finally:
        proxy.accept_new_connections()
        await listener.close()
    await eventually(lambda: asyncio.sleep(0, proxy.open_connections), lambda n: n == 0, timeout=BOUND,
                     what="the listener closed")


@pytest.mark.spec("LD1")
async def test_a_build_that_ends_while_its_watch_reads_the_row_leaves_the_pool_as_it_was(db, store, proxy):
    """A small build can end before its watch's first read of the row has answered. That read is left to end
    (bounded, its answer ignored) rather than cancelled: the pool takes a cancelled statement for one that may have
    met a dead network and replaces every connection it holds, which in P1 (`make bench`) opened about two
    PostgreSQL sessions per export."""
    tenant_id, destination_id = await seed_tenant(db.admin)
    job_id, attempt_id = await create_job(store, tenant_id, destination_id), uuid.uuid4()
    assert await store.claim(job_id, 1, attempt_id, "worker-a") is ClaimResult.CLAIMED
    # A stop already recorded for this attempt: what the watch's read will find once it is answered.
    stop = await store.request_cancellation(tenant_id=tenant_id, job_id=job_id, request_id=uuid.uuid4(),
                                            requested_by="operator@example", reason=None)
    assert stop.outcome is CancellationOutcome.STOP_REQUESTED
    engine = make_engine(proxy.url("exports_app", db.name), pool_size=3, max_overflow=0)
    pooled = JobStore(engine, lease_seconds=30)
    listener = StopListener(asyncpg_dsn(db.url("app")), BOUNDS, check_every=0.5)
    stopped: list[bool] = []
    try:
        await asyncio.gather(*(pooled.read_job(job_id) for _ in range(3)))  # the pool's connections, warm
        warm = proxy.accepted
        assert warm == 3
        # The watch's read waits behind a lock on the table, as a read waits on a busy server.
        locker = await asyncpg.connect(asyncpg_dsn(db.url("owner")))
        try:
            await locker.execute("BEGIN; LOCK TABLE export_jobs IN ACCESS EXCLUSIVE MODE")
            async with StopWatch(listener, pooled, job_id, attempt_id, on_stop=lambda: stopped.append(True)):
                await eventually(lambda: locker.fetchval(
                    "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'export_jobs'::regclass"),
                    lambda n: n >= 1, timeout=BOUND, what="the watch's read waiting")
        finally:
            await locker.execute("COMMIT")
            await locker.close()
        await eventually(lambda: asyncio.sleep(0, engine.pool.checkedout()), lambda n: n == 0, timeout=BOUND,
                         what="the watch's read ended")
        await asyncio.gather(*(pooled.read_job(job_id) for _ in range(3)))
        assert proxy.accepted == warm, f"{proxy.accepted - warm} pooled connection(s) replaced"
        assert stopped == [], "a watch that ended acted on its read"
    finally:
        await listener.close()
        await engine.dispose()
