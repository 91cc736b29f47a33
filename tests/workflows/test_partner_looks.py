"""What an export costs its partner in SSH connections: its delivery's own, and a share of one for the
preparation's look. Each build used to open a connection of its own for the look and close it at once: two SSH
handshakes per export, each about 6 ms of CPU at the worker and as much at the partner (P1 in `make bench`). A
worker's looks at one destination now share one connection while they overlap or follow each other closely
(activities/partner_looks.py); a delivery opens its own, or takes the one an earlier delivery left
(activities/delivery_connections.py)."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

from store.models import Status
from tests.helpers.harness import open_harness

EXPORTS = 6


async def test_exports_at_once_share_the_connection_of_their_preparations_look(db, store, client, tmp_path):
    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path)
        jobs = await asyncio.gather(*(h.create() for _ in range(EXPORTS)))
        rows = await asyncio.gather(*(h.settled(job) for job in jobs))
        opened = h.partner.accepted_connections
    assert [row.status for row in rows] == [Status.COMPLETED] * EXPORTS
    print(f"\nSSH connections the partner accepted for {EXPORTS} exports at once: {opened}")
    # At most one per delivery; the looks share at most two (a second once a look finds the first cut or too old).
    assert opened <= EXPORTS + 2, f"{opened} SSH connections for {EXPORTS} exports"


async def test_exports_one_after_another_deliver_on_one_connection(db, store, client, tmp_path):
    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path)
        assert h.activities is not None
        kept = h.activities.delivery_connections
        # Long enough that the next export's delivery comes before the connection's linger ends, on any machine.
        kept.linger_seconds, kept.max_age_seconds = 60.0, 120.0
        rows = [await h.settled(await h.create()) for _ in range(3)]
        deliveries = h.partner.accepted_connections - h.activities.partner_looks.opened
    assert [row.status for row in rows] == [Status.COMPLETED] * 3
    assert (kept.opened, kept.reused, deliveries) == (1, 2, 1)
