"""Case PT6 for the partner: a worker process's SFTP sessions go through tests/helpers/tcp_cut.py's proxy, which goes
silent during an upload (nothing forwarded either way, nothing closed, as a network dropping packets). Shorter than
the session's keepalive bound, nothing notices: the upload goes on and the export completes on its one attempt.
Longer, the keepalives end the session before the rename, and the fresh listing cannot be taken either: the attempt
provably never renamed, so it hands itself back (its rename fence still open) and recovery sends the export round
again, rather than leave an OutcomeUnknown for a person. The partner back, the next attempt delivers, once."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time

import pytest

from store.models import Status
from tests.helpers.crash import crash_world, processes, start_worker
from tests.helpers.events import events, kinds
from tests.helpers.harness import run_recovery, set_contract
from tests.helpers.partner import assert_partner_holds, outbound_names, temp_names
from tests.helpers.support import eventually
from tests.helpers.tcp_cut import TcpCutProxy

BOUND = 90.0  # no single wait of this test may take longer
SESSION = 10.0  # the SFTP session's connect timeout, which paces its keepalives (activities/partner_connection.py)


async def silent_partner(h, proxy: TcpCutProxy, *, for_seconds: float) -> list[float]:
    """The destination reached through `proxy`, which goes silent at the upload's first write for `for_seconds`."""
    await set_contract(h, host="127.0.0.1", port=proxy.port)
    silences: list[float] = []
    loop = asyncio.get_running_loop()

    async def silent_on_first_write(path: str, offset: int) -> None:
        if not silences:
            silences.append(time.monotonic())
            proxy.go_silent()
            loop.call_later(for_seconds, proxy.heal)

    h.partner.hooks.on_write = silent_on_first_write
    return silences


@pytest.mark.spec("PT6")
async def test_a_partner_silent_for_less_than_its_session_bound__the_upload_goes_on(db, store, client, tmp_path):
    async with crash_world(db, store, client, tmp_path, upload_throttle_bytes_per_second=20_000) as h, \
            processes(h) as started, TcpCutProxy(h.partner.host, h.partner.port) as partner:
        silences = await silent_partner(h, partner, for_seconds=SESSION / 4)
        await start_worker(started, h)
        job_id = await h.create()
        row = await asyncio.wait_for(h.settled(job_id), timeout=BOUND)

    assert silences  # the silence was injected, during the upload
    assert row.status is Status.COMPLETED and row.attempt_count == 1
    assert_partner_holds(h.partner, row, only=True)
    assert "fresh_listing" not in [json.loads(e["detail"])["step"] for e in await events(db, job_id)
                                   if e["kind"] == "DeliveryEvidence"]


@pytest.mark.spec("PT6")
async def test_a_partner_silent_for_longer__the_attempt_is_handed_back_and_the_next_one_delivers(
        db, store, client, tmp_path):
    async with crash_world(db, store, client, tmp_path, upload_throttle_bytes_per_second=20_000) as h, \
            processes(h) as started, TcpCutProxy(h.partner.host, h.partner.port) as partner:
        silences = await silent_partner(h, partner, for_seconds=BOUND)  # healed below, once the attempt gave up
        await start_worker(started, h)
        job_id = await h.create()
        first = await eventually(lambda: h.store.read_job(job_id), lambda r: r.status is Status.DELIVERING,
                                 timeout=BOUND, interval=0.2, what="the upload under way")
        gave_up = await eventually(
            lambda: events(db, job_id),
            lambda found: [e for e in found if e["kind"] == "DeliveryEvidence" and e["attempt_id"] == first.attempt_id
                           and json.loads(e["detail"])["step"] in ("handed_back", "receipt")]
            or kinds(found, first.attempt_id)[-1:] == ["Finished"],
            timeout=BOUND, interval=0.2, what="the first attempt ending its delivery")
        partner.heal()

        async def taken_back() -> Status:
            await run_recovery(h.client, h.settings)
            return (await h.store.read_job(job_id)).status

        await eventually(taken_back, lambda status: status is not Status.DELIVERING, timeout=BOUND, interval=1.0,
                         what="recovery taking the handed-back attempt")
        row = await asyncio.wait_for(h.settled(job_id), timeout=BOUND)

    assert silences and gave_up
    assert row.status is Status.COMPLETED and row.attempt_count == 2 and row.attempt_id != first.attempt_id, row
    assert outbound_names(h.partner) == [row.final_name]
    delivered = (h.partner.root / "outbound" / row.final_name).read_bytes()
    assert hashlib.sha256(delivered).digest() == row.expected_file_sha256
    # The first attempt could not remove its temporary file through the silence: the partner sweep does, by age.
    assert all(str(first.attempt_id) in name for name in temp_names(h.partner)), temp_names(h.partner)
    found = await events(db, job_id)
    assert kinds(found, first.attempt_id)[-1] == "RequeuedByRecovery"
    steps = [json.loads(e["detail"])["step"] for e in found
             if e["kind"] == "DeliveryEvidence" and e["attempt_id"] == first.attempt_id]
    assert "rename" not in steps and steps[-1] == "handed_back", steps
