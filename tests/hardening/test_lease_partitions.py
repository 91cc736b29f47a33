"""Case PT2 through the real worker, the Temporal dev server, PostgreSQL and the SFTP partner: the worker's way to
PostgreSQL goes through tests/helpers/faults.py's proxy, which goes silent (nothing forwarded either way, no socket
closed) while a build runs, and heals as after a NAT table flush: the connections open during the partition never
come back. Only the lease keeper's own clock can tell a renewal that will never answer.

The lease is read from PostgreSQL on a connection of the test's own, outside the partition, every 50 ms."""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import AsyncExitStack
from typing import Any

import asyncpg
import pytest

from activities.checkpoints import BUILD_CANCELLED, BUILD_STARTED
from store.models import Status
from tests.helpers.events import events, kinds
from tests.helpers.harness import run_recovery
from tests.helpers.lease import BOUND, Hold, first_attempt, history, lease_harness, open_proxy, wait_expired
from tests.helpers.partner import assert_partner_holds
from tests.helpers.support import Sampler, eventually

LEASE = 8.0
RENEW = 2.0
SHORT = 4.0  # a partition shorter than LEASE - RENEW
STATE = ("SELECT status, attempt_id, lease_expires_at, lease_expires_at <= clock_timestamp() AS expired "
         "FROM export_jobs WHERE id = $1")


class HeldBuild(Hold):
    """Holds the first build at BUILD_STARTED (running, its lease keeper adopted), and reads the lease from the
    database, on its own connection, the moment that build is cancelled."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        super().__init__(BUILD_STARTED)
        self.conn = conn
        self.cancelled: dict[str, Any] | None = None
        self.cancelled_at: float | None = None

    async def reached(self, name: str, job_id: uuid.UUID) -> None:
        if name == BUILD_CANCELLED and self.cancelled is None:
            self.cancelled_at = time.monotonic()
            self.cancelled = dict(await self.conn.fetchrow(STATE, job_id))
        await super().reached(name, job_id)


class LeaseWatch(Sampler):
    """Samples the row's lease every 50 ms from the database's clock, on its own connection."""

    def __init__(self, conn: asyncpg.Connection, job_id: uuid.UUID) -> None:
        self.conn = conn
        self.job_id = job_id
        self.lapsed: list[dict[str, Any]] = []
        self.last: dict[str, Any] = {}

    async def sample(self) -> None:
        self.last = dict(await self.conn.fetchrow(STATE, self.job_id))
        if self.last["expired"]:
            self.lapsed.append(self.last)


async def own_connection(stack: AsyncExitStack, db) -> asyncpg.Connection:
    conn = await db.connect("owner")
    stack.push_async_callback(conn.close)
    return conn


async def a_scheduled_renewal(conn: asyncpg.Connection, job_id: uuid.UUID) -> dict[str, Any]:
    """Waits for the keeper's next renewal, seen in the row: the partition then begins a whole interval before
    the one after it."""
    seen = (await conn.fetchrow(STATE, job_id))["lease_expires_at"]
    return await eventually(lambda: conn.fetchrow(STATE, job_id), lambda s: s["lease_expires_at"] > seen,
                            timeout=BOUND, interval=0.02, what="a scheduled renewal")


async def held_build_behind_proxy(stack: AsyncExitStack, db, store, client, tmp_path):  # type: ignore[no-untyped-def]
    """A worker whose way to PostgreSQL goes through a fault proxy, its export's build held while the keeper
    renews: (proxy, hold, harness, job ID, attempt ID)."""
    proxy = await open_proxy(stack, db)
    stack.callback(proxy.heal)  # never leave the worker cut off, whatever fails
    hold = HeldBuild(await own_connection(stack, db))
    h = await lease_harness(stack, db, store, client, tmp_path, proxy=proxy, hold=hold, lease_seconds=LEASE,
                            renew_every_seconds=RENEW)
    job_id = await h.create()
    attempt_id = await first_attempt(db, job_id)
    await hold.wait_held()
    return proxy, hold, h, job_id, attempt_id


@pytest.mark.spec("PT2")
async def test_a_silent_partition_shorter_than_the_lease_minus_one_interval_never_lets_a_building_lease_lapse(
        db, store, client, tmp_path):
    """A build runs (held) while the keeper renews its lease of 8 s every 2 s. The worker's way to PostgreSQL goes
    silent for 4 s right after a renewal, and heals without the connections it had. The renewal sent into the
    partition never answers: the keeper abandons it and renews on a new connection before the lease lapses, and
    the build goes on to deliver under its first attempt."""
    async with AsyncExitStack() as stack:
        proxy, hold, h, job_id, attempt_id = await held_build_behind_proxy(stack, db, store, client, tmp_path)
        watch_conn = await own_connection(stack, db)
        renewed = await a_scheduled_renewal(watch_conn, job_id)
        watch = LeaseWatch(watch_conn, job_id)
        watch.start()
        stack.push_async_callback(watch.stop)

        proxy.go_silent()
        await asyncio.sleep(SHORT)
        proxy.heal(keep_open_connections=False)
        healed_at = time.monotonic()
        # A renewal after the heal, and the lease watched until it would have lapsed had nothing renewed it.
        after = await eventually(lambda: asyncio.sleep(0, watch.last), lambda s: s["lease_expires_at"] >
                                 renewed["lease_expires_at"], timeout=LEASE, interval=0.05, what="a renewal")
        print(f"PT2: renewed {time.monotonic() - healed_at:.2f} s after a {SHORT:g} s partition healed")
        await asyncio.sleep(max(0.0, LEASE - (time.monotonic() - healed_at)))
        await watch.stop()

        assert watch.lapsed == [], f"the lease lapsed during a {SHORT:g} s partition: {watch.lapsed[0]}"
        assert after["status"] == "Running" and after["attempt_id"] == attempt_id
        assert hold.cancelled is None  # the build was never stopped
        hold.release.set()
        row = await h.settled(job_id)
        assert row.status is Status.COMPLETED and row.attempt_count == 1 and row.attempt_id == attempt_id
        found = await events(db, job_id)
        assert kinds(found).count("BuildStarted") == 1 and kinds(found).count("Finished") == 1
        assert not {"RequeuedByRecovery", "ResolvedByRecovery"} & set(kinds(found))
        assert_partner_holds(h.partner, row, only=True)


@pytest.mark.spec("PT2")
async def test_a_silent_partition_longer_than_the_lease_stops_the_build_before_its_lease_lapses(
        db, store, client, tmp_path):
    """A build runs (held) while the keeper renews its lease of 8 s every 2 s; the worker's way to PostgreSQL goes
    silent right after a renewal, for longer than the lease. No renewal answers, and before the lease lapses the
    keeper stops the build, which writes nothing: once the partition heals and the lease has lapsed, recovery
    requeues the attempt and the next one delivers, once."""
    async with AsyncExitStack() as stack:
        proxy, hold, h, job_id, attempt_id = await held_build_behind_proxy(stack, db, store, client, tmp_path)
        renewed = await a_scheduled_renewal(await own_connection(stack, db), job_id)
        renewed_at = time.monotonic()

        proxy.go_silent()
        await eventually(lambda: asyncio.sleep(0, hold.cancelled), lambda c: c is not None, timeout=LEASE + 2,
                         interval=0.05, what="the build stopped")
        assert hold.cancelled_at is not None
        print(f"PT2: the build stopped {hold.cancelled_at - renewed_at:.2f} s after the last renewal "
              f"(lease {LEASE:g} s, renewed every {RENEW:g} s)")
        # Stopped before its lease lapsed, with the lease the last renewal before the partition gave.
        assert hold.cancelled["expired"] is False, hold.cancelled
        assert hold.cancelled["lease_expires_at"] == renewed["lease_expires_at"]
        assert hold.cancelled["status"] == "Running" and hold.cancelled["attempt_id"] == attempt_id
        builds = await eventually(lambda: history(h, job_id), lambda found: any(
            name == "build" and result is not None for name, result in found), timeout=BOUND, what="the build ended")
        assert [result["ended"] for name, result in builds if name == "build"] == ["LeaseLapsing"]

        await wait_expired(db, job_id)
        proxy.heal(keep_open_connections=False)
        report = await run_recovery(h.client, h.settings)
        assert [t.recorded for t in report.taken_over if t.job_id == job_id] == ["RequeuedByRecovery"]
        row = await h.settled(job_id)
        assert row.status is Status.COMPLETED and row.attempt_count == 2 and row.attempt_id != attempt_id
        # The stopped build wrote nothing: its attempt holds its claim, its build's start and the requeue.
        assert [k for k in kinds(await events(db, job_id), attempt_id) if k != "DeliveryEvidence"] == [
            "Claimed", "BuildStarted", "RequeuedByRecovery"]
        assert_partner_holds(h.partner, row, only=True)
