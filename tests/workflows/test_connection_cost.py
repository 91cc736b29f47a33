"""What an export costs PostgreSQL in sessions: once a worker is warm, none of its own. Each build used to open two
connections outside the pools, its stop watcher's LISTEN and its COPY, and close them at its end: two new sessions
per export (about 6 ms of CPU each, client and server, in P1), and under load as many LISTEN connections as builds,
each hearing every export's stops. The worker now listens once for all its builds and keeps its COPY connections
between builds (docs/database.md, "Connection budget").

The worker's every way to PostgreSQL (its pool, the listener, the COPYs) goes through tests/helpers/faults.py's
proxy, which counts the connections it forwards; the dispatcher's role goes straight to the server."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest

from store.models import Status
from tests.helpers.faults import fault_proxy
from tests.helpers.harness import open_harness

WARM_EXPORTS = 2
MEASURED_EXPORTS = 4


@pytest.mark.spec("LD1")
async def test_a_warm_worker_opens_no_postgresql_session_for_an_export(db, store, client, tmp_path):
    async with AsyncExitStack() as stack:
        proxy = await stack.enter_async_context(fault_proxy(db.server))
        h = await open_harness(stack, db, store, client, tmp_path, database_url=proxy.url("exports_app", db.name))
        for _ in range(WARM_EXPORTS):  # the pool's connections, the listener's and a COPY's
            assert (await h.settled(await h.create())).status is Status.COMPLETED
        warm = proxy.accepted
        for _ in range(MEASURED_EXPORTS):
            assert (await h.settled(await h.create())).status is Status.COMPLETED
        opened = proxy.accepted - warm
    print(f"\nsessions opened for {MEASURED_EXPORTS} exports on a warm worker: {opened} ({warm} to warm it)")
    assert warm >= 2, "the worker's connections did not go through the proxy"
    # The pool may still grow by one while the exports' steps overlap with a renewal; never one per export.
    assert opened <= 1, f"{opened} new PostgreSQL sessions for {MEASURED_EXPORTS} exports"
