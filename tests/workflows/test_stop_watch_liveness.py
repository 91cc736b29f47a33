"""Case PT4 through the real worker, the Temporal dev server, PostgreSQL and an SFTP partner: the stop listener's
LISTEN connection (one per worker, for all its builds) goes through tests/helpers/faults.py's proxy, and only it.
The rest of the worker keeps its way to PostgreSQL, so within the bound nothing but the watcher can hear the stop:
no signal is sent (the row write alone, as the LISTEN/NOTIFY path of TW6), cutoff 2 is a long build away, and the
lease is kept. A partition of every connection is PT1's and PT2's (tests/hardening/test_lease_partitions.py).

Times are on the database's clock: the heal (or the proxy's return) is read from it the moment it happens, and the
stop from the Stopped event."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from datetime import datetime

import pytest

from activities import build_activities
from activities.stop_watch import StopListener
from store.db import asyncpg_dsn
from store.models import CancellationOutcome, Status
from tests.helpers.events import events, kinds
from tests.helpers.faults import PgFaultProxy, fault_proxy
from tests.helpers.harness import Harness, building, open_harness

# About 270 kB of contacts at 10 kB/s: a build of some 27 s, so that only the watcher can stop it within the bound.
CONTACTS = 3000
BUILD_BYTES_PER_SECOND = 10_000
# What the watcher promises once PostgreSQL is back (activities/stop_watch.py): a check of its connection every
# CHECK_EVERY_SECONDS, bounded by CHECK_TIMEOUT_SECONDS, then a new connection and a read of the row; and a margin
# for the stop's own write and a loaded machine.
STOP_BOUND_SECONDS = 10.0
# Longer than a check and its bound: the watcher finds its connection dead while it is away (and tries to connect
# into the silence); and shorter than one check, so that it learns only after the heal.
AWAY_SECONDS = 6.0
BRIEF_SECONDS = 1.0


@pytest.fixture
async def watched(db, store, client, tmp_path, monkeypatch) -> AsyncIterator[tuple[Harness, PgFaultProxy]]:
    """Slow builds whose stop listener (and only it) reaches PostgreSQL through the proxy: the listener takes the
    worker's database URL, which the build's COPY takes too, so the listener alone is given the proxy's."""
    async with AsyncExitStack() as stack:
        proxy = await stack.enter_async_context(fault_proxy(db.server))
        through_proxy = asyncpg_dsn(proxy.url("exports_app", db.name))

        def listener_through_proxy(dsn: str, *args: object, **kwargs: object) -> StopListener:
            return StopListener(through_proxy, *args, **kwargs)

        monkeypatch.setattr(build_activities, "StopListener", listener_through_proxy)
        h = await open_harness(stack, db, store, client, tmp_path, contacts=CONTACTS,
                               build_throttle_bytes_per_second=BUILD_BYTES_PER_SECOND)
        # Before the worker shuts down, whatever failed: never leave the watcher cut off.
        stack.callback(proxy.accept_new_connections)
        stack.callback(proxy.heal)
        yield h, proxy


async def db_now(h: Harness) -> datetime:
    return await h.db.admin.fetchval("SELECT clock_timestamp()")


async def request_stop(h: Harness, job_id: uuid.UUID) -> uuid.UUID:
    """The row write only (its NOTIFY at commit); no signal reaches the workflow."""
    request_id = uuid.uuid4()
    result = await h.store.request_cancellation(tenant_id=h.tenant_id, job_id=job_id, request_id=request_id,
                                                requested_by="ann@example.com", reason="while the watcher was away")
    assert result.outcome is CancellationOutcome.STOP_REQUESTED
    return request_id


async def assert_stopped_by_the_watcher_within_the_bound(h: Harness, job_id: uuid.UUID, request_id: uuid.UUID,
                                                         back_at: datetime, what: str) -> None:
    row = await h.settled(job_id)
    found = await events(h.db, job_id)
    stopped = [e for e in found if e["kind"] == "Stopped"]
    latency = (stopped[0]["recorded_at"] - back_at).total_seconds() if stopped else None
    print(f"\nPT4 {what}: back -> Stopped in {latency} s (DB clock); events {kinds(found)}")
    assert row.status is Status.STOPPED and row.stop_request_id == request_id, row
    # Stopped by the build itself, mid-build (its watcher heard), not at cutoff 2 after the whole build.
    assert latency is not None and latency < STOP_BOUND_SECONDS, latency
    assert kinds(found) == ["Claimed", "BuildStarted", "Stopped"]
    assert stopped[0]["detail"] == "WhileBuilding", stopped[0]
    assert row.delivery_authorized_at is None


@pytest.mark.spec("PT4")
@pytest.mark.parametrize("silent_seconds", [AWAY_SECONDS, BRIEF_SECONDS], ids=["noticed-while-away", "noticed-after"])
async def test_stop_watcher__silent_then_healed_without_its_connection__a_stop_written_meanwhile_stops_the_build(
        watched: tuple[Harness, PgFaultProxy], silent_seconds: float):
    """The watcher's way to PostgreSQL goes silent while the build runs; a stop is written meanwhile (its
    notification never arrives); the partition heals as after a NAT table flush, the listening connection gone for
    good but silent, never closed. The watcher notices, listens again, reads the row, and the build stops within
    the bound after the heal. (A heal that kept the connection would hand the held notification over and prove
    nothing about the watcher.)"""
    h, proxy = watched
    job_id = await h.create()
    await building(h, job_id)
    assert proxy.open_connections == 1  # the listener's
    proxy.go_silent()
    request_id = await request_stop(h, job_id)
    await asyncio.sleep(silent_seconds)
    assert (await h.store.read_job(job_id)).status is Status.RUNNING, "stopped while the watcher was away"
    proxy.heal(keep_open_connections=False)
    healed_at = await db_now(h)
    await assert_stopped_by_the_watcher_within_the_bound(h, job_id, request_id, healed_at,
                                                         f"listener silent {silent_seconds:g} s")


@pytest.mark.spec("PT4")
async def test_stop_watcher__connection_cut_outright__stops_written_while_it_cannot_reconnect_stop_each_build(
        watched: tuple[Harness, PgFaultProxy]):
    """The listening connection, shared by two builds, is cut (both sides closed), and new connections are refused
    for a while; a stop is written for each build meanwhile. Once connections are accepted again, the listener
    listens again, every build's watch reads its row, and both builds stop within the bound."""
    h, proxy = watched
    jobs = [await h.create() for _ in range(2)]
    for job_id in jobs:
        await building(h, job_id)
    assert proxy.open_connections == 1  # the listener's, for both builds
    proxy.refuse_new_connections()
    proxy.cut_all()
    request_ids = [await request_stop(h, job_id) for job_id in jobs]
    await asyncio.sleep(AWAY_SECONDS)
    for job_id in jobs:
        assert (await h.store.read_job(job_id)).status is Status.RUNNING, "stopped while the listener was away"
    proxy.accept_new_connections()
    back_at = await db_now(h)
    for index, (job_id, request_id) in enumerate(zip(jobs, request_ids, strict=True)):
        await assert_stopped_by_the_watcher_within_the_bound(h, job_id, request_id, back_at,
                                                             f"cut listener, build {index + 1}")


@pytest.mark.spec("PT4", "LD6")
async def test_stop_watcher__builds_on_one_worker_share_one_listening_connection__each_stop_reaches_its_own_build(
        watched: tuple[Harness, PgFaultProxy]):
    """Three builds at once on one worker listen through one connection (a connection per build cost a PostgreSQL
    session per export, and each heard every export's stops). A stop written for one of them (the row write alone)
    stops that build and no other; the next stops the next, through the same connection."""
    h, proxy = watched
    jobs = [await h.create() for _ in range(3)]
    for job_id in jobs:
        await building(h, job_id)
    assert proxy.open_connections == 1, f"{proxy.open_connections} listening connections for {len(jobs)} builds"
    for index, job_id in enumerate(jobs):
        written_at = await db_now(h)
        request_id = await request_stop(h, job_id)
        await assert_stopped_by_the_watcher_within_the_bound(h, job_id, request_id, written_at, f"build {index + 1}")
        for later in jobs[index + 1:]:
            assert (await h.store.read_job(later)).status is Status.RUNNING, "a stop reached another build"
    assert proxy.open_connections == 1
