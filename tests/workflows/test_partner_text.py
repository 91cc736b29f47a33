"""Text a partner sends (an SFTP status message) in what the export's row records: a NUL in it, which PostgreSQL
stores in no text value, left the export Delivering for good (its terminal write refused, then every recovery
run's resolution)."""

from __future__ import annotations

import asyncio

import asyncssh
import pytest

from starter.localstack import partner as local_partner
from store.models import Status
from tests.helpers.crash import wait_lease_expired
from tests.helpers.harness import Harness, run_recovery, set_contract
from tests.helpers.support import eventually

BOUND = 30.0


async def test_a_partner_whose_check_file_refusal_carries_a_nul_byte_leaves_no_export_delivering_forever(
        harness: Harness, monkeypatch: pytest.MonkeyPatch):
    """The contract promises check-file; the partner refuses it with a status message holding a NUL byte (a
    partner that lies, or a buggy one). The upload renamed its file; the evidence by content could not be had:
    OutcomeUnknown. Whatever the partner's message, the export must settle: by its terminal write, or by
    recovery's resolution once its lease lapses."""
    h = harness
    await set_contract(h, hash_evidence="check_file")

    async def refuse(self, request):  # noqa: ANN001
        raise asyncssh.SFTPFailure("check-file\x00unavailable")

    monkeypatch.setattr(local_partner._PartnerSFTPServer, "check_file", refuse)
    job_id = await h.create()
    await eventually(lambda: h.store.read_job(job_id), lambda r: r.status is not Status.QUEUED
                     and r.status is not Status.RUNNING and r.rename_fence == "passed", timeout=BOUND, interval=0.1,
                     what="renamed")
    await asyncio.sleep(3.0)
    row = await h.store.read_job(job_id)
    if not row.status.is_settled:
        await wait_lease_expired(h, job_id)
        for _ in range(2):
            report = await asyncio.wait_for(run_recovery(h.client, h.settings), timeout=BOUND)
        row = await h.store.read_job(job_id)
        assert row.status.is_settled, (
            f"export still {row.status.value} after its upload renamed and two recovery runs: "
            f"{[(t.recorded, t.detail[:200]) for t in report.taken_over]}")
