"""Evidence that cannot lie at the partner (matrix DV2, DV3, DV4), against a real SFTP server (the local asyncssh
partner, whose hooks hold a request inside the server exactly as a slow or stuck server would), PostgreSQL and
Temporal."""

from __future__ import annotations

import asyncio
from pathlib import Path

import asyncssh
import pytest

from activities.partner_delivery import deliver
from starter.localstack.partner import LocalPartner
from store.models import Status
from tests.helpers.events import events, kinds
from tests.helpers.partner import Evidence, bounded, make_file
from tests.helpers.support import eventually


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


# --- DV2: how each Completed was confirmed, in the row and filterable -----------------------------------------------


@pytest.mark.spec("DV2")
@pytest.mark.parametrize("hash_evidence,confirmed_by", [("check_file", "sha256"), ("read_back", "sha256"),
                                                        ("none", "size")])
async def test_each_completed_records_how_it_was_confirmed_and_operators_filter_on_it(
        harness, hash_evidence: str, confirmed_by: str):
    h = harness
    await h.db.admin.execute("UPDATE destinations SET hash_evidence = $1 WHERE id = $2", hash_evidence,
                             h.destination_id)
    job_id = await h.create()
    row = await h.settled(job_id)
    assert row.status is Status.COMPLETED and row.confirmed_by == confirmed_by

    async def found() -> bool:
        query = f"WorkflowId = 'export-{job_id}' AND ExportConfirmedBy = '{confirmed_by}'"
        return bool([w async for w in h.client.list_workflows(query)])

    assert await eventually(found, bool, timeout=10, interval=0.2, what=f"ExportConfirmedBy = '{confirmed_by}'")


# --- DV4: classification is consistent and early; reasons name what failed -----------------------------------------


@pytest.mark.spec("DV4")
@pytest.mark.parametrize("refusal", [asyncssh.SFTPNoSuchFile, asyncssh.SFTPPermissionDenied, asyncssh.SFTPFailure])
async def test_a_rename_the_server_refused_is_not_delivered_whatever_the_code(partner: LocalPartner, tmp_path: Path,
                                                                              refusal):
    local = tmp_path / "contacts.csv"
    make_file(local, 32 * 1024)

    async def refuse(old: str, new: str) -> None:
        raise refusal("refused by the partner's server")

    partner.hooks.before_rename = refuse
    result = await bounded(deliver(partner.destination(), str(local), "contacts-k.csv", ".contacts-k.csv.a.part",
                                   record_evidence=Evidence()))
    assert (result.outcome, result.failure_reason) == ("Failed", "NotDelivered"), result
    assert refusal.__name__ in result.summary
    assert list((partner.root / "outbound").iterdir()) == []


@pytest.mark.spec("DV4")
async def test_a_missing_final_directory_ends_the_delivery_before_any_upload(partner: LocalPartner, tmp_path: Path):
    local = tmp_path / "contacts.csv"
    make_file(local, 32 * 1024)
    dest = partner.destination().model_copy(update={"final_dir": "/no-such-dir"})
    written: list[str] = []

    async def on_write(path: str, offset: int) -> None:
        written.append(path)

    partner.hooks.on_write = on_write
    evidence = Evidence()
    result = await bounded(deliver(dest, str(local), "contacts-k.csv", ".contacts-k.csv.a.part",
                                   record_evidence=evidence))
    assert (result.outcome, result.failure_reason) == ("Failed", "NotDelivered"), result
    assert "/no-such-dir" in result.summary and "does not exist" in result.summary
    assert written == [] and list((partner.root / "incoming-tmp").iterdir()) == []


@pytest.mark.spec("DV4")
async def test_a_timeout_says_which_step_timed_out(partner: LocalPartner, tmp_path: Path):
    local = tmp_path / "contacts.csv"
    make_file(local, 32 * 1024)
    stuck = asyncio.Event()

    async def hang(path: str, offset: int) -> None:
        await stuck.wait()

    partner.hooks.on_write = hang
    try:
        result = await bounded(deliver(partner.destination(), str(local), "contacts-k.csv",
                                       ".contacts-k.csv.a.part", record_evidence=Evidence(), operation_timeout=0.5,
                                       after_failure_timeout=5.0))
    finally:
        stuck.set()
    assert (result.outcome, result.failure_reason) == ("Failed", "NotDelivered"), result
    assert "TimeoutError: no answer from the partner within 0.5 s" in result.summary, result.summary


@pytest.mark.spec("DV4")
async def test_an_unusable_host_key_found_while_preparing_ends_the_attempt_before_the_build(harness):
    h = harness
    other = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()
    await h.db.admin.execute("UPDATE destinations SET host_key = $1 WHERE id = $2", other, h.destination_id)
    job_id = await h.create()
    row = await h.settled(job_id)
    assert (row.status, row.failure_reason) == (Status.FAILED, "NotDelivered")
    # No cutoff 2: the key spent nothing.
    assert kinds(await events(h.db, job_id)) == ["Claimed", "BuildStarted", "Failed"]
    detail = await h.db.admin.fetchval("SELECT detail FROM export_attempt_events WHERE job_id = $1 "
                                       "AND kind = 'Failed'", job_id)
    assert "host key" in detail and "ssh-ed25519" in detail, detail
    assert list(Path(h.settings.work_dir).glob("*.csv*")) == []


@pytest.mark.spec("DV4")
async def test_a_missing_final_directory_found_while_preparing_ends_the_attempt_before_the_build(harness):
    """The destination names a final directory the partner does not have: the preparation's look finds it, and the
    attempt ends Failed/NotDelivered before cutoff 2, with nothing built or sent."""
    h = harness
    await h.db.admin.execute("UPDATE destinations SET final_dir = '/no-such-dir' WHERE id = $1", h.destination_id)
    job_id = await h.create()
    row = await h.settled(job_id)
    assert (row.status, row.failure_reason) == (Status.FAILED, "NotDelivered")
    assert kinds(await events(h.db, job_id)) == ["Claimed", "BuildStarted", "Failed"]
    detail = await h.db.admin.fetchval("SELECT detail FROM export_attempt_events WHERE job_id = $1 "
                                       "AND kind = 'Failed'", job_id)
    assert "preparation" in detail and "/no-such-dir" in detail and "does not exist" in detail, detail
    assert list(Path(h.settings.work_dir).glob("*.csv*")) == []
    assert list((h.partner.root / "incoming-tmp").iterdir()) == []
