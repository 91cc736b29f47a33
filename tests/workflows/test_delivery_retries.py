"""A delivery proven not delivered by a fault that may pass is tried again within its attempt (matrix LV1), against
real PostgreSQL, Temporal and the local SFTP partner: the transfer is cut by closing the partner's connections."""

from __future__ import annotations

import asyncio
import hashlib
import json
from contextlib import AsyncExitStack

import pytest

from activities.checkpoints import BEFORE_UPLOAD
from store.models import Status
from tests.helpers.events import events, kinds
from tests.helpers.harness import Harness, run_recovery, unknown_original
from tests.helpers.lease import Hold, lease_harness, open_proxy
from tests.helpers.partner import outbound, outbound_names
from tests.helpers.support import eventually

SETTLE = 60.0


def evidence_steps(evts: list, attempt_id: object) -> list[str]:
    return [json.loads(e["detail"])["step"] for e in evts
            if e["kind"] == "DeliveryEvidence" and e["attempt_id"] == attempt_id]


@pytest.mark.spec("LV1")
async def test_a_transfer_cut_before_the_rename_is_tried_again_and_completes(harness: Harness):
    """The partner drops the connection at the first write of the first try. The fresh listing proves the final
    name untouched, so the attempt tries again (its lease confirmed first) and the file arrives once: Completed, in
    one attempt, with the failure and the retry in its evidence."""
    h = harness
    cuts, renames = [], []

    async def cut_the_first_transfer(path: str, offset: int) -> None:
        if not cuts:
            cuts.append(path)
            h.partner.close_connections()

    async def count_rename(old: str, new: str) -> None:
        renames.append(new)

    h.partner.hooks.on_write, h.partner.hooks.before_rename = cut_the_first_transfer, count_rename
    job_id = await h.create()
    row = await h.settled(job_id)

    assert len(cuts) == 1, cuts  # the fault was injected, once
    assert (row.status, row.attempt_count) == (Status.COMPLETED, 1), row
    assert len(renames) == 1  # one rename: one file at the final name
    delivered = (h.partner.root / "outbound" / row.final_name).read_bytes()
    assert hashlib.sha256(delivered).digest() == row.expected_file_sha256
    assert list((h.partner.root / "incoming-tmp").iterdir()) == []
    steps = evidence_steps(await events(h.db, job_id), row.attempt_id)
    assert steps == ["baseline", "fresh_listing", "retry", "baseline", "rename", "receipt"], steps


@pytest.mark.spec("LV1", "IU1")
@pytest.mark.parametrize("replacing", [False, True], ids=["original", "replacement"])
async def test_a_transfer_cut_on_every_try_hands_the_attempt_back_and_the_next_attempt_delivers(
        harness: Harness, replacing: bool):
    """Cut on every try of the first attempt: after `delivery_tries` tries, proven not delivered by a fault that may
    pass, the attempt hands itself back (no terminal write, its rename fence open) rather than end the export
    Failed/NotDelivered, a ticket for a person although the partner was only away. Recovery sends the export round
    again, and its next attempt delivers the file, once. A replacement does the same: its attempt never renamed."""
    h = harness
    tries = h.settings.delivery_tries
    cuts, renames = [], []
    original = None
    if replacing:
        # An original whose outcome is unknown, its file since taken away by the partner: the name is free.
        original, _ = await unknown_original(h)
        (outbound(h.partner) / (await h.store.read_job(original)).final_name).unlink()

    async def cut_the_first_attempts_transfers(path: str, offset: int) -> None:
        if offset == 0 and len(cuts) < tries:
            cuts.append(path)
            h.partner.close_connections()

    async def count_rename(old: str, new: str) -> None:
        renames.append(new)

    h.partner.hooks.on_write, h.partner.hooks.before_rename = cut_the_first_attempts_transfers, count_rename
    if original is None:
        job_id = await h.create()
    else:
        job_id = await h.exports.replace(tenant_id=h.tenant_id, original_job_id=original, created_by="ops@example",
                                         reason="the original's outcome is unknown")

    async def settled_after_a_recovery_run() -> Status:
        row = await h.store.read_job(job_id)
        if not row.status.is_settled and row.lease_expires_at is not None \
                and row.lease_expires_at <= await h.db.admin.fetchval("SELECT clock_timestamp()"):
            await run_recovery(h.client, h.settings)  # the hand-back ended the lease: take the attempt back
        return (await h.store.read_job(job_id)).status

    await eventually(settled_after_a_recovery_run, lambda status: status.is_settled, timeout=SETTLE, interval=0.5,
                     what=f"export {job_id} settled, recovery taking back its handed-back attempt")
    row = await h.settled(job_id)

    assert len(cuts) == tries and tries > 1, cuts  # the faults were injected, on every try of the first attempt
    assert (row.status, row.failure_reason, row.attempt_count) == (Status.COMPLETED, None, 2), row
    assert len(renames) == 1  # one rename: one file at the final name
    delivered = (h.partner.root / "outbound" / row.final_name).read_bytes()
    assert hashlib.sha256(delivered).digest() == row.expected_file_sha256
    assert list((h.partner.root / "incoming-tmp").iterdir()) == []
    found = await events(h.db, job_id)
    assert kinds(found).count("RequeuedByRecovery") == 1 and "AttemptsExhausted" not in kinds(found), kinds(found)
    first = next(e["attempt_id"] for e in found if e["kind"] == "RequeuedByRecovery")
    steps = evidence_steps(found, first)
    assert steps.count("retry") == tries - 1 and steps.count("fresh_listing") == tries, steps
    assert steps[-1] == "handed_back", steps
    assert await h.db.admin.fetchval("SELECT handed_back_count FROM export_jobs WHERE id = $1", job_id) == 1


@pytest.mark.spec("LV1")
async def test_database_connections_cut_as_the_delivery_begins_are_waited_out_not_outcome_unknown(
        db, store, client, tmp_path):
    """Cutoff 2 committed; every PostgreSQL connection of the worker is cut as the delivery step begins (pooled
    ones included, so its first reads meet dead connections). Nothing was uploaded yet: the step reads again on
    fresh connections and delivers, Completed in its one attempt, never OutcomeUnknown."""
    async with AsyncExitStack() as stack:
        proxy = await open_proxy(stack, db)
        hold = Hold(BEFORE_UPLOAD)
        h = await lease_harness(stack, db, store, client, tmp_path, hold=hold, proxy=proxy)
        job_id = await h.create()
        await asyncio.wait_for(hold.held.wait(), SETTLE)
        live = len(proxy._conns)
        proxy.cut_all()
        hold.release.set()
        row = await h.settled(job_id)
    assert live > 0  # the fault was injected: live connections were cut
    assert (row.status, row.attempt_count) == (Status.COMPLETED, 1), row
    assert outbound_names(h.partner) == [row.final_name]
