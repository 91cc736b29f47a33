"""Evidence that cannot lie at the partner (matrix DV3), against a real SFTP server: the local asyncssh partner,
whose hooks hold a request inside the server exactly as a slow or stuck server would."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from activities.partner import deliver
from starter.localstack.partner import LocalPartner
from tests.partner_support import Evidence, bounded, make_file


@pytest.fixture
async def partner(tmp_path: Path):
    p = LocalPartner(tmp_path / "partner")
    await bounded(p.start())
    yield p
    await bounded(p.stop())


@pytest.mark.spec("DV3")
async def test_after_an_uncertain_rename_the_attempt_touches_neither_name(partner: LocalPartner, tmp_path: Path):
    """The server takes the rename but answers late (here: it holds the request before carrying it out); the
    client times out. Whatever the server then does must be its own doing: the attempt removes nothing, so the
    server's late rename publishes the whole file, and the outcome is OutcomeUnknown for reconciliation."""
    local = tmp_path / "contacts.csv"
    data = make_file(local, 64 * 1024)
    release = asyncio.Event()
    renamed = asyncio.Event()

    async def slow_rename(old: str, new: str) -> None:
        await release.wait()

    async def done(old: str, new: str) -> None:
        renamed.set()

    partner.hooks.before_rename = slow_rename
    partner.hooks.after_rename = done
    evidence = Evidence()
    result = await bounded(deliver(partner.destination(), str(local), "contacts-k.csv", ".contacts-k.csv.a.part",
                                   record_evidence=evidence, operation_timeout=1.0, after_failure_timeout=5.0))
    assert result.outcome == "OutcomeUnknown", result
    assert "rename" in result.summary
    # The temporary file is still where the upload left it: nothing was removed after the uncertain rename.
    assert (partner.root / "incoming-tmp" / ".contacts-k.csv.a.part").read_bytes() == data
    release.set()
    await bounded(renamed.wait())
    assert (partner.root / "outbound" / "contacts-k.csv").read_bytes() == data
    assert list((partner.root / "incoming-tmp").iterdir()) == []
    fresh = evidence.first("fresh_listing")
    assert fresh["failed_step"] == "rename" and fresh["outcome"] == "OutcomeUnknown"
    assert fresh.get("temp_left") is True  # and the evidence says why it is still there
