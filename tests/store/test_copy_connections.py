"""The builds' COPY connections (activities/builder.py's `copy_connections`, store/db.py's `RawConnections`),
reaching PostgreSQL through tests/helpers/faults.py's proxy, which counts the connections it forwards and those
still open: a finished build's connection serves the next build; one whose COPY was abandoned midway is
terminated, never handed to the next; a kept one whose server went silent is not waited on; an idle one closes
after its idle time; and closing them leaves none."""

from __future__ import annotations

import asyncio
import contextlib
import os

import pytest

from activities.builder import build_contacts_csv, copy_connections, partial_path
from store.db import Bounds, RawConnections, asyncpg_dsn
from tests.helpers.support import eventually, seed_tenant

CONTACTS = 2000
BOUND = 20.0
CONNECT = 1.5  # the bound under test: a kept connection's question, and a connect


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
        await eventually(lambda: asyncio.sleep(0, proxy.open_connections), lambda n: n == 0, timeout=BOUND,
                         what="the abandoned COPY's connection terminated")

        assert await build_contacts_csv(connections, tenant_id, tmp_path / "after.csv") in whole
        assert proxy.accepted == 2, "the build after the abandoned one got a new connection"
    finally:
        await connections.close()
    await eventually(lambda: asyncio.sleep(0, proxy.open_connections), lambda n: n == 0, timeout=BOUND,
                     what="every connection closed")


@pytest.mark.spec("LD1")
async def test_an_idle_copy_connection_closes_after_its_idle_time(db, proxy, tmp_path):
    tenant_id, _ = await seed_tenant(db.admin, contacts=10)
    connections = RawConnections("COPY", proxy.url("exports_app", db.name), most=1, idle_seconds=1.0)
    try:
        await build_contacts_csv(connections, tenant_id, tmp_path / "build.csv")
        assert proxy.open_connections == 1
        await eventually(lambda: asyncio.sleep(0, proxy.open_connections), lambda n: n == 0, timeout=BOUND,
                         what="the idle connection closed")
        await build_contacts_csv(connections, tenant_id, tmp_path / "later.csv")
        assert proxy.accepted == 2
    finally:
        await connections.close()


@pytest.mark.spec("PT6")
async def test_a_kept_connection_whose_server_went_silent_is_left_for_a_new_one_within_a_connects_bound(
        db, proxy, tmp_path):
    """The server behind a kept connection stops answering while the connection stays open (a failed-over primary
    whose host still takes packets: the kernel's keepalives see nothing wrong, and a COPY has no statement bound).
    The next build asks the kept connection first, gives up on it within a connect's bound, and builds on a new
    connection, made as a first one is (here to the promoted server, as the URL's next host would be)."""
    tenant_id, _ = await seed_tenant(db.admin, contacts=CONTACTS)
    connections = copy_connections(proxy.url("exports_app", db.name),
                                   Bounds(statement_seconds=None, connect_seconds=CONNECT, tcp_user_timeout_seconds=4),
                                   most=2)
    try:
        whole = await build_contacts_csv(connections, tenant_id, tmp_path / "before.csv")
        assert proxy.open_connections == 1  # kept
        proxy.go_silent()
        connections.dsn = asyncpg_dsn(db.url("app"))  # the next host
        started = asyncio.get_running_loop().time()
        after = await asyncio.wait_for(build_contacts_csv(connections, tenant_id, tmp_path / "after.csv"), BOUND)
        took = asyncio.get_running_loop().time() - started
    finally:
        proxy.heal()
        await connections.close()
    print(f"\nbuilt {took:.2f} s after the server went silent (the kept connection's bound: {CONNECT:g} s)")
    assert after == whole
    assert CONNECT <= took < CONNECT + 3.0, took  # the question was asked, and bounded
    assert proxy.accepted == 1  # the new connection did not go to the silent server


@pytest.mark.spec("LD1")
async def test_a_build_asks_its_server_nothing_but_the_copy(db, tmp_path):
    """COPY takes no parameters; asyncpg's copy_from_query, given the tenant's ID as one, asks the server to quote
    it first: a round trip per build that writing a UUID's text in needs no server for."""
    tenant_id, _ = await seed_tenant(db.admin, contacts=10)
    await seed_tenant(db.admin, contacts=3)
    asked: list[str] = []

    class Watched(RawConnections):
        @contextlib.asynccontextmanager
        async def connection(self):  # type: ignore[override]
            async with super().connection() as conn:
                conn.add_query_logger(lambda record: asked.append(record.query))
                yield conn

    connections = Watched("COPY", db.url("app"), most=1)
    try:
        size, _ = await build_contacts_csv(connections, tenant_id, tmp_path / "build.csv")
    finally:
        await connections.close()
    assert asked == [], asked
    lines = (tmp_path / "build.csv").read_text().splitlines()
    assert len(lines) == 1 + 10 and size > 0, "the header and the tenant's own contacts, none of the other's"


async def test_a_build_whose_disk_stalls_at_its_sync_leaves_the_event_loop_running(db, proxy, tmp_path, monkeypatch):
    """A build syncs its file before it renames it. The sync used to run on the worker's event loop: on a disk that
    stalls (a network volume, a failing device) the whole worker stood still with it, every heartbeat, renewal
    and stop unheard. The sync now runs in a thread; a stop meanwhile waits for it (the file stays open until it
    returns), then ends the build with nothing left behind."""
    import threading

    import activities.builder as builder

    tenant_id, _ = await seed_tenant(db.admin, contacts=CONTACTS)
    connections = copy_connections(proxy.url("exports_app", db.name), most=1)
    stalled, released = threading.Event(), threading.Event()
    synced: list[BaseException | None] = []
    real_fsync = os.fsync

    def stalling_fsync(fd: int) -> None:
        stalled.set()
        # Released by the test once it saw the loop run; else, after 5 s, by this fallback (the loop was stuck).
        released.wait(5.0)
        try:
            real_fsync(fd)
            synced.append(None)
        except OSError as exc:  # the file closed under the sync
            synced.append(exc)

    monkeypatch.setattr(builder.os, "fsync", stalling_fsync)
    try:
        for stop in (False, True):
            stalled.clear()
            released.clear()
            path = tmp_path / f"stall-{stop}.csv"
            build = asyncio.create_task(build_contacts_csv(connections, tenant_id, path))
            ticks = 0
            while not stalled.is_set():
                await asyncio.sleep(0.01)
            for _ in range(10):  # the loop goes on while the sync waits
                await asyncio.sleep(0.01)
                ticks += 1 if stalled.is_set() and not released.is_set() else 0
            assert ticks == 10 and not build.done(), "the event loop stood still during the sync"
            if stop:
                build.cancel()
                await asyncio.sleep(0.1)
                assert not build.done(), "the stop did not wait for the sync"
            released.set()
            if stop:
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait_for(build, BOUND)
                assert build.cancelled()
                assert not path.exists() and not partial_path(path).exists()
            else:
                size, _ = await asyncio.wait_for(build, BOUND)
                assert path.stat().st_size == size > 0
        assert synced == [None, None], synced
    finally:
        released.set()
        await connections.close()
