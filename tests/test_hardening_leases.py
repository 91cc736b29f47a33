"""Hardening of leases and builds through the real worker, the Temporal dev server, PostgreSQL and the SFTP partner
(matrix "Hardening: leases, evidence and builds": LK1, LK2).

Each test walks a path the original matrix never walked, and each failed on the code before its fix.
"""

from __future__ import annotations

import uuid
from contextlib import AsyncExitStack

import pytest

from activities.checkpoints import AFTER_CLAIM, Checkpoints
from store.models import ClaimResult, Status
from tests.support import eventually
from tests.test_lease_workflow import BOUND, assert_partner_holds_only, events, history, kinds, start, wait_expired
from tests.workflow_support import Harness, run_recovery


class LoseClaimResponseOnce(Checkpoints):
    """After the first claim commits, recovery requeues the job and then the claim activity fails, as when its
    worker dies after the commit: Temporal retries the claim with the same attempt ID."""

    def __init__(self) -> None:
        self.h: Harness | None = None
        self.fired = False

    async def reached(self, name: str, job_id: uuid.UUID) -> None:
        if name != AFTER_CLAIM or self.fired:
            return
        self.fired = True
        assert self.h is not None
        await wait_expired(self.h.db, job_id)
        report = await run_recovery(self.h.client, self.h.settings)
        assert [t.recorded for t in report.taken_over if t.job_id == job_id] == ["RequeuedByRecovery"]
        raise RuntimeError("the claim's worker died after its commit (injected)")


@pytest.mark.spec("LK2")
async def test_claim_retried_after_a_requeue_is_lost_and_the_next_attempt_delivers_once(db, store, client, tmp_path):
    async with AsyncExitStack() as stack:
        lose = LoseClaimResponseOnce()
        h = await start(stack, db, store, client, tmp_path, hold=None)
        lose.h = h
        h.activities.checkpoints = lose
        job_id = await h.create()
        # Bounded well below the harness's own wait: a claim that retries without end fails here.
        row = await eventually(lambda: h.store.read_job(job_id), lambda r: r is not None and r.status.is_settled,
                               timeout=BOUND, interval=0.2, what="the export settled")
        assert lose.fired
        row = await h.settled(job_id)
        assert row.status is Status.COMPLETED and row.attempt_count == 2
        found = await events(db, job_id)
        first = next(e["attempt_id"] for e in found if e["kind"] == "Claimed")
        assert first != row.attempt_id
        # The spent attempt holds its claim and the requeue, and nothing else was ever written for it.
        assert [k for k in kinds(found, first) if k != "DeliveryEvidence"] == ["Claimed", "RequeuedByRecovery"]
        assert kinds(found, row.attempt_id)[0] == "Claimed" and kinds(found, row.attempt_id)[-1] == "Finished"
        claims = [result for name, result in await history(h, job_id) if name == "claim"]
        assert [c["result"] for c in claims] == [ClaimResult.LOST.value, ClaimResult.CLAIMED.value]
        assert_partner_holds_only(h, row)
