"""Case PT6 for Temporal: a worker process whose way to the Temporal server goes silent (tests/helpers/tcp_cut.py's
proxy stops forwarding either way and closes nothing, as a network dropping packets does), while its way to
PostgreSQL and the partner stays up. Shorter than the lease, nothing notices: the upload goes on and its export
completes on its one attempt. Longer than the lease, Temporal takes the worker for lost and resumes the build on
another worker; the first worker's lease keeper still renews (PostgreSQL answers it), so recovery takes nothing over,
and the resumed build fences the first one: one file at the partner, one attempt, two builds."""

from __future__ import annotations

import asyncio
import time

import pytest

from activities import checkpoints
from store.models import Status
from tests.helpers.crash import crash_world, processes, start_worker
from tests.helpers.events import events, kinds
from tests.helpers.harness import held_at, release_held
from tests.helpers.lease import LEASE
from tests.helpers.partner import assert_partner_holds
from tests.helpers.support import eventually
from tests.helpers.tcp_cut import TcpCutProxy, temporal_upstream

BOUND = 60.0  # no single wait of this test may take longer


@pytest.mark.spec("PT6")
async def test_temporal_silent_for_less_than_the_lease_during_an_upload__nothing_notices(db, store, client, tmp_path):
    async with crash_world(db, store, client, tmp_path, upload_throttle_bytes_per_second=20_000) as h, \
            processes(h) as started, TcpCutProxy(*temporal_upstream(h.client)) as temporal:
        silences: list[float] = []
        loop = asyncio.get_running_loop()

        async def silent_on_first_write(path: str, offset: int) -> None:
            if not silences:  # the upload has begun: Temporal goes silent for half a lease
                silences.append(time.monotonic())
                temporal.go_silent()
                loop.call_later(LEASE / 2, temporal.heal)

        h.partner.hooks.on_write = silent_on_first_write
        await start_worker(started, h, temporal_address=f"127.0.0.1:{temporal.port}")
        job_id = await h.create()
        row = await asyncio.wait_for(h.settled(job_id), timeout=BOUND)

    assert silences and temporal.passed >= 1  # the silence was injected, on the worker's own connection
    assert row.status is Status.COMPLETED and row.attempt_count == 1
    assert_partner_holds(h.partner, row, only=True)
    found = await events(db, job_id)
    assert kinds(found, evidence_once=True) == [
        "Claimed", "BuildStarted", "DeliveryAuthorized", "DeliveryEvidence", "Finished"]


@pytest.mark.spec("PT6")
async def test_temporal_silent_for_longer_than_the_lease_during_a_build__resumed_elsewhere_and_fenced(
        db, store, client, tmp_path):
    async with crash_world(db, store, client, tmp_path) as h, processes(h) as started, \
            TcpCutProxy(*temporal_upstream(h.client)) as temporal:
        cut_off = await start_worker(started, h, temporal_address=f"127.0.0.1:{temporal.port}",
                                     hold_at=checkpoints.BUILD_STARTED)
        job_id = await h.create()
        await held_at(h.settings, checkpoints.BUILD_STARTED, job_id)
        first = await h.store.read_job(job_id)
        temporal.go_silent()
        try:
            await start_worker(started, h)  # the healthy worker, on Temporal directly
            # Temporal gives the quiet build up after a lease and resumes it on the healthy worker, whose build start
            # fences the first (the cut-off worker's keeper renews until then: recovery has nothing to take over).
            resumed = await eventually(
                lambda: events(db, job_id), lambda found: kinds(found).count("BuildStarted") == 2,
                timeout=BOUND, interval=0.2, what="the build resumed on the healthy worker")
            assert "RequeuedByRecovery" not in kinds(resumed)
        finally:
            release_held(h.settings, checkpoints.BUILD_STARTED, job_id)
        row = await asyncio.wait_for(h.settled(job_id), timeout=BOUND)
        temporal.heal()  # the cut-off worker's late answers are refused by Temporal, and change nothing
        await asyncio.sleep(LEASE)
        final = await h.store.read_job(job_id)
        assert cut_off.process is not None and cut_off.process.returncode is None  # it lived through it

    assert temporal.passed >= 1  # the cut-off worker's way to Temporal did go through the silenced proxy
    assert row.status is Status.COMPLETED and row.attempt_id == first.attempt_id and row.attempt_count == 1
    assert final == row
    assert_partner_holds(h.partner, row, only=True)
    found = await events(db, job_id)
    builds = [e["worker_id"] for e in found if e["kind"] == "BuildStarted"]
    assert len(builds) == 2 and builds[0] != builds[1]  # two builds, by two holders
    assert kinds(found, evidence_once=True) == [
        "Claimed", "BuildStarted", "BuildStarted", "DeliveryAuthorized", "DeliveryEvidence", "Finished"]
