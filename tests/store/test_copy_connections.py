"""The builds' COPY connections (activities/builder.py's `copy_connections`, store/db.py's `RawConnections`),
reaching PostgreSQL through tests/helpers/faults.py's proxy, which counts the connections it forwards and those
still open: a finished build's connection serves the next build; one whose COPY was abandoned midway is
terminated, never handed to the next; an idle one closes after its idle time; and closing them leaves none."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from activities.builder import build_contacts_csv, copy_connections, partial_path
from store.db import RawConnections
from tests.helpers.faults import PgFaultProxy, fault_proxy
from tests.helpers.support import eventually, seed_tenant

CONTACTS = 2000
BOUND = 20.0


@pytest.fixture
async def proxy(db) -> AsyncIterator[PgFaultProxy]:
    async with fault_proxy(db.server) as running:
        yield running


async def open_count(proxy: PgFaultProxy) -> int:
    return proxy.open_connections


@pytest.mark.spec("LD1")
async def test_a_finished_builds_connection_serves_the_next_and_an_abandoned_ones_never_does(db, proxy, tmp_path):
    tenant_id, _ = await seed_tenant(db.admin, contacts=CONTACTS)
    connections = copy_connections(proxy.url("exports_app", db.name), most=2)
    try:
        whole = {await build_contacts_csv(connections, tenant_id, tmp_path / f"build-{n}.csv") for n in range(3)}
        assert len(whole) == 1 and next(iter(whole))[0] > 0, whole
        assert (proxy.accepted, proxy.open_connections) == (1, 1), "three builds, one connection"

        # A build cancelled mid-COPY (a stop): its connection is in no state to serve another.
        writing = asyncio.Event()
        slow = tmp_path / "stopped.csv"
        build = asyncio.create_task(build_contacts_csv(connections, tenant_id, slow,
                                                       on_progress=lambda size: writing.set(),
                                                       throttle_bytes_per_second=20_000))
        await asyncio.wait_for(writing.wait(), BOUND)
        build.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(build, BOUND)
        assert build.cancelled()
        assert not slow.exists() and not partial_path(slow).exists()
        await eventually(lambda: open_count(proxy), lambda n: n == 0, timeout=BOUND,
                         what="the abandoned COPY's connection terminated")

        assert await build_contacts_csv(connections, tenant_id, tmp_path / "after.csv") in whole
        assert proxy.accepted == 2, "the build after the abandoned one got a new connection"
    finally:
        await connections.close()
    await eventually(lambda: open_count(proxy), lambda n: n == 0, timeout=BOUND, what="every connection closed")


@pytest.mark.spec("LD1")
async def test_an_idle_copy_connection_closes_after_its_idle_time(db, proxy, tmp_path):
    tenant_id, _ = await seed_tenant(db.admin, contacts=10)
    connections = RawConnections("COPY", proxy.url("exports_app", db.name), most=1, idle_seconds=1.0)
    try:
        await build_contacts_csv(connections, tenant_id, tmp_path / "build.csv")
        assert proxy.open_connections == 1
        await eventually(lambda: open_count(proxy), lambda n: n == 0, timeout=BOUND,
                         what="the idle connection closed")
        await build_contacts_csv(connections, tenant_id, tmp_path / "later.csv")
        assert proxy.accepted == 2
    finally:
        await connections.close()
