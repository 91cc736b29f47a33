"""An attempt handed back before its rename is not a lost worker (matrix LV8, RI9): real PostgreSQL, Temporal and the
local SFTP partner, which drops every connection at an upload's first write and refuses new ones for a moment, so
the attempt cannot look at the final name and hands itself back (its rename fence open) for recovery to send the
export round again.

Before, each hand-back used up one of the export's `max_attempts`, so a partner that dropped a few uploads in a row
ended the export Failed/AttemptsExhausted, for a person, although no worker was ever lost. Hand-backs are counted
apart (export_jobs.handed_back_count, migration 0013) and capped on their own (`max_hand_backs`), so a partner
that drops every upload still ends the export, at that cap."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import pytest

from store.models import FailureCode, Status
from tests.helpers.events import events, kinds
from tests.helpers.harness import Harness, open_harness, run_recovery
from tests.helpers.support import eventually

BOUND = 120.0
DOWN_SECONDS = 1.5  # the partner refuses connections this long after a drop: the attempt's look finds nothing


@pytest.fixture
async def dropping(db, store, client, tmp_path) -> AsyncIterator[Harness]:
    async with AsyncExitStack() as stack:
        yield await open_harness(stack, db, store, client, tmp_path, delivery_tries=1, max_attempts=2,
                                 max_hand_backs=4)


def drop_uploads(h: Harness, times: int | None) -> tuple[list[str], list[asyncio.Task[None]]]:
    """The partner drops the first `times` uploads (every one when None) at their first write, and is away for
    DOWN_SECONDS each time: the uploads dropped, and the absences (each ends with the partner back)."""
    drops: list[str] = []
    downs: list[asyncio.Task[None]] = []

    async def away_for_a_moment() -> None:
        await h.partner.stop()
        await asyncio.sleep(DOWN_SECONDS)
        await h.partner.start()

    async def on_write(path: str, offset: int) -> None:
        if offset == 0 and (times is None or len(drops) < times):
            drops.append(path)
            downs.append(asyncio.get_running_loop().create_task(away_for_a_moment()))

    h.partner.hooks.on_write = on_write
    return drops, downs


async def settle_with_recovery(h: Harness, job_id, downs: list[asyncio.Task[None]]) -> None:  # type: ignore[no-untyped-def]
    async def settled_after_a_recovery_run() -> Status:
        row = await h.store.read_job(job_id)
        if row.status.is_settled:
            return row.status
        # The partner back first: the next attempt is to meet the next drop at its upload, not a partner away.
        await asyncio.gather(*downs)
        await run_recovery(h.client, h.settings)
        return (await h.store.read_job(job_id)).status

    await eventually(settled_after_a_recovery_run, lambda status: status.is_settled, timeout=BOUND, interval=1.0,
                     what=f"export {job_id} settled, recovery taking back each handed-back attempt")


@pytest.mark.spec("LV8", "RI9")
async def test_attempts_handed_back_by_a_dropping_partner_do_not_use_up_the_attempts(dropping: Harness):
    h = dropping
    drops, downs = drop_uploads(h, times=3)  # more than max_attempts (2)
    job_id = await h.create()
    await settle_with_recovery(h, job_id, downs)
    row = await asyncio.wait_for(h.settled(job_id), BOUND)

    assert (row.status, row.failure_reason, row.attempt_count) == (Status.COMPLETED, None, 4), row
    assert len(drops) == 3, drops  # the faults were injected
    found = await events(h.db, job_id)
    assert kinds(found).count("RequeuedByRecovery") == 3 and "AttemptsExhausted" not in kinds(found)
    assert await h.db.admin.fetchval("SELECT handed_back_count FROM export_jobs WHERE id = $1", job_id) == 3


@pytest.mark.spec("LV8", "RI9")
async def test_a_partner_that_drops_every_upload_still_ends_the_export_at_the_hand_back_cap(dropping: Harness):
    h = dropping
    drops, downs = drop_uploads(h, times=None)
    job_id = await h.create()
    await settle_with_recovery(h, job_id, downs)
    row = await asyncio.wait_for(h.settled(job_id), BOUND)

    assert (row.status, row.failure_reason) == (Status.FAILED, FailureCode.ATTEMPTS_EXHAUSTED), row
    assert row.attempt_count == 4 and len(drops) == 4, (row, drops)  # max_hand_backs: bounded
    assert await h.db.admin.fetchval("SELECT handed_back_count FROM export_jobs WHERE id = $1", job_id) == 4
    assert kinds(await events(h.db, job_id)).count("RequeuedByRecovery") == 3
