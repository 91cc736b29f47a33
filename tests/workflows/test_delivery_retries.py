"""A delivery proven not delivered by a fault that may pass is tried again within its attempt (matrix LV1), against
real PostgreSQL, Temporal and the local SFTP partner: the transfer is cut by closing the partner's connections."""

from __future__ import annotations

import asyncio
import hashlib
import json
from contextlib import AsyncExitStack

import pytest

from activities.checkpoints import BEFORE_UPLOAD
from store.models import FailureCode, Status
from tests.helpers.events import events
from tests.helpers.harness import Harness
from tests.helpers.lease import Hold, lease_harness, open_proxy
from tests.helpers.partner import outbound_names

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
async def test_a_transfer_cut_on_every_try_ends_not_delivered_after_the_bounded_tries(harness: Harness):
    """Cut on every try: after `delivery_tries` tries, the outcome follows the evidence, Failed/NotDelivered, with
    the final name never written."""
    h = harness
    tries = h.settings.delivery_tries
    cuts, renames = [], []

    async def cut_every_transfer(path: str, offset: int) -> None:
        if offset == 0:
            cuts.append(path)
            h.partner.close_connections()

    async def count_rename(old: str, new: str) -> None:
        renames.append(new)

    h.partner.hooks.on_write, h.partner.hooks.before_rename = cut_every_transfer, count_rename
    job_id = await h.create()
    row = await h.settled(job_id)

    assert len(cuts) == tries and tries > 1, cuts
    assert (row.status, row.failure_reason) == (Status.FAILED, FailureCode.NOT_DELIVERED)
    assert renames == [] and not (h.partner.root / "outbound" / row.final_name).exists()
    assert list((h.partner.root / "incoming-tmp").iterdir()) == []
    steps = evidence_steps(await events(h.db, job_id), row.attempt_id)
    assert steps.count("retry") == tries - 1 and steps.count("fresh_listing") == tries, steps


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
