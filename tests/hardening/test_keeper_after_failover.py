"""The lease keeper (activities/lease.py) past a failover, against the real PostgreSQL through the fault proxies: no
Temporal, the keeper alone, as a step's `_keeper` makes it."""

from __future__ import annotations

import asyncio
import time
import uuid
from urllib.parse import quote

from sqlalchemy.engine import make_url

from activities.lease import LeaseKeeper
from store.db import Bounds, make_engine
from store.jobs import JobStore
from store.models import ClaimResult
from tests.helpers.faults import fault_proxy
from tests.helpers.support import create_job, seed_tenant
from tests.helpers.tcp_cut import TcpCutProxy

HOLDER = "worker-a"


async def claimed(db, store) -> tuple[uuid.UUID, uuid.UUID]:
    tenant_id, destination_id = await seed_tenant(db.admin)
    job_id, attempt_id = await create_job(store, tenant_id, destination_id), uuid.uuid4()
    assert await store.claim(job_id, 1, attempt_id, HOLDER) is ClaimResult.CLAIMED
    return job_id, attempt_id


async def lease_left(db, job_id: uuid.UUID) -> float:
    return float(await db.admin.fetchval(
        "SELECT extract(epoch FROM lease_expires_at - clock_timestamp()) FROM export_jobs WHERE id = $1", job_id))


def two_host_url(db, first: int, second: int) -> str:
    base = make_url(db.url("app"))
    auth = quote(base.username or "", safe="")
    if base.password:
        auth += ":" + quote(base.password, safe="")
    return (f"postgresql+asyncpg://{auth}@127.0.0.1:{first},127.0.0.1:{second}/{base.database}"
            "?target_session_attrs=read-write")


async def test_keeper_renews_past_a_silent_first_host_with_the_default_connect_bound(db, store):
    """The worker's URL names a primary gone silent first (accepts TCP, never answers) and the promoted primary
    second: the layout store/db.py's connect_each_host exists for. A plain statement reaches the second host after
    the first host's own connect bound (5 s by default). The keeper's renewal bound is also 5 s (at most), so a
    renewal that needs a new connection is abandoned just as the first host's bound ends, and every retry the same:
    the keeper alone never renews, and confirm() (before every upload) fails though the database answers. Seen
    failing so; a worker now tries first the host that last answered (an abandoned renewal still finishes in the
    background, and so finds it)."""
    job_id, attempt_id = await claimed(db, store)
    async with fault_proxy(db.server) as live, TcpCutProxy("127.0.0.1", live.port) as silent:
        silent.go_silent()
        bounds = Bounds.defaults()  # statement 15 s, connect 5 s, TCP user timeout 10 s: the production defaults
        assert bounds.connect_seconds == 5.0
        engine = make_engine(two_host_url(db, silent.port, live.port), bounds=bounds)
        lease = 30.0
        worker_store = JobStore(engine, lease_seconds=lease)
        try:
            keeper = LeaseKeeper(worker_store, job_id, attempt_id, HOLDER, renew_every=10.0)
            assert keeper.renewal_timeout == 5.0  # min(5, (lease - renew) / 2): the production value too
            began = time.monotonic()
            confirmed = await keeper.confirm(within=20.0)
            took = time.monotonic() - began
            left = await lease_left(db, job_id)
            # The control: the same store, no keeper bound, reaches the second host.
            began = time.monotonic()
            plain = await asyncio.wait_for(worker_store.renew_lease(job_id, attempt_id, HOLDER), 30)
            plain_took = time.monotonic() - began
            print(f"\nconfirm -> {confirmed} after {took:.1f} s; plain renewal -> {plain} after {plain_took:.1f} s")
            assert plain is True
            assert confirmed is True, (f"the keeper could not renew within 20 s past a silent first host "
                                       f"(a plain renewal took {plain_took:.1f} s); lease left {left:.1f} s")
        finally:
            await engine.dispose()
