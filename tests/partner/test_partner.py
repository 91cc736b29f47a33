"""The partner client against a real in-process SFTP server: deliveries, refusals and faults at each step."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from pathlib import Path
from typing import Any

import asyncssh
import pytest

from activities.destination import PartnerContract
from activities.outcomes import DeliveryResult, RemoteFile
from activities.partner_connection import HostKeyMismatch, connect, load_client_key
from activities.partner_delivery import MAX_WRITE_BYTES, THROTTLED_WRITE_BYTES, deliver, piece_size
from activities.sftp_check_file import check_file_sha256
from starter.localstack.partner import LocalPartner
from tests.helpers.partner import Evidence, bounded, make_file, write_as_other_party

CHUNK = 16 * 1024


@pytest.fixture
def local(tmp_path: Path) -> tuple[Path, bytes]:
    path = tmp_path / "contacts.csv"
    return path, make_file(path, 10 * CHUNK + 123)


def listdir(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


async def deliver_local(partner: LocalPartner, local: tuple[Path, bytes], name: str,
                        evidence: Evidence | None = None, **options: Any) -> tuple[DeliveryResult, Evidence]:
    """The local file delivered to the partner as `contacts-<name>.csv` through `<name>.part`, within the tests'
    bound; its result and the evidence it recorded."""
    evidence = Evidence() if evidence is None else evidence
    result = await bounded(deliver(partner.destination(), str(local[0]), f"contacts-{name}.csv", f"{name}.part",
                                   record_evidence=evidence, **options))
    return result, evidence


async def test_delivery_completes_byte_for_byte(partner: LocalPartner, local: tuple[Path, bytes]) -> None:
    path, data = local
    evidence, progress = Evidence(), []
    result = await bounded(deliver(partner.destination(), str(path), "contacts-k.csv", "k.part",
                                   record_evidence=evidence, on_progress=lambda s, t: progress.append((s, t)),
                                   chunk_size=CHUNK))
    assert result.outcome == "Completed" and result.failure_reason is None
    assert result.receipt == RemoteFile(path="/outbound/contacts-k.csv", exists=True, size=len(data),
                                        mtime=result.receipt.mtime)
    assert (partner.final_dir / "contacts-k.csv").read_bytes() == data
    assert listdir(partner.temp_dir) == []
    # Progress after each piece (the chunks in flight at once), rising to the whole file.
    sizes = [0] + [sent for sent, _ in progress]
    assert progress[-1] == (len(data), len(data)) and len(progress) == -(-len(data) // piece_size(CHUNK))
    assert all(0 < b - a <= piece_size(CHUNK) for a, b in itertools.pairwise(sizes))
    assert evidence.steps == ["baseline", "rename", "receipt"]
    assert evidence.first("baseline")["final"] == {"path": "/outbound/contacts-k.csv", "exists": False,
                                                   "size": None, "mtime": None}
    assert evidence.first("receipt")["expected_bytes"] == len(data)


async def test_a_large_file_goes_out_in_pipelined_pieces_and_a_throttled_one_in_small_ones(
    partner: LocalPartner, tmp_path: Path
) -> None:
    path = tmp_path / "large.csv"
    data = make_file(path, 3 * piece_size(CHUNK) + 5)
    for throttle, piece in ((0, piece_size(CHUNK)), (32 * CHUNK * 4, 32 * CHUNK)):
        progress: list[int] = []
        (partner.final_dir / "contacts-k.csv").unlink(missing_ok=True)
        result = await bounded(deliver(partner.destination(), str(path), "contacts-k.csv", "k.part",
                                       record_evidence=Evidence(), on_progress=lambda s, t: progress.append(s),
                                       chunk_size=CHUNK, throttle_bytes_per_second=throttle))
        assert result.outcome == "Completed" and (partner.final_dir / "contacts-k.csv").read_bytes() == data
        assert progress == [*range(piece, len(data), piece), len(data)], (throttle, progress)


async def test_by_default_a_delivery_writes_as_much_as_the_partner_accepts(partner: LocalPartner,
                                                                           tmp_path: Path) -> None:
    """asyncssh's server announces 4 MiB writes; the client takes up to MAX_WRITE_BYTES, or 64 KiB when throttled."""
    path = tmp_path / "large.csv"
    data = make_file(path, 3 * MAX_WRITE_BYTES + 5)
    for throttle, write in ((0, MAX_WRITE_BYTES), (64 * THROTTLED_WRITE_BYTES, THROTTLED_WRITE_BYTES)):
        offsets: list[int] = []

        async def on_write(_: str, offset: int) -> None:
            offsets.append(offset)

        partner.hooks.on_write = on_write
        (partner.final_dir / "contacts-k.csv").unlink(missing_ok=True)
        result = await bounded(deliver(partner.destination(), str(path), "contacts-k.csv", "k.part",
                                       record_evidence=Evidence(), throttle_bytes_per_second=throttle))
        assert result.outcome == "Completed" and (partner.final_dir / "contacts-k.csv").read_bytes() == data
        assert sorted(offsets) == list(range(0, len(data), write)), throttle


async def test_occupied_final_name_uploads_nothing(partner: LocalPartner, local: tuple[Path, bytes]) -> None:
    theirs = b"someone else's file\n"
    (partner.final_dir / "contacts-k.csv").write_bytes(theirs)
    writes: list[tuple[str, int]] = []

    async def on_write(p: str, offset: int) -> None:
        writes.append((p, offset))

    partner.hooks.on_write = on_write
    result, evidence = await deliver_local(partner, local, "k")
    assert (result.outcome, result.failure_reason) == ("Failed", "FinalNameOccupied")
    assert (partner.final_dir / "contacts-k.csv").read_bytes() == theirs
    assert writes == [] and listdir(partner.temp_dir) == []
    assert evidence.steps == ["baseline", "decision"]
    assert evidence.first("baseline")["final"]["size"] == len(theirs)


async def test_wrong_host_key_refuses_to_connect(partner: LocalPartner, local: tuple[Path, bytes]) -> None:
    impostor = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()
    dest = partner.destination(host_key=impostor)
    other_type = asyncssh.generate_private_key("ecdsa-sha2-nistp256").export_public_key().decode()
    for wrong in (dest, partner.destination(host_key=other_type)):
        with pytest.raises(HostKeyMismatch):
            async with connect(wrong, connect_timeout=10):
                pass
    evidence = Evidence()
    result = await bounded(deliver(dest, str(local[0]), "contacts-k.csv", "k.part", record_evidence=evidence))
    assert (result.outcome, result.failure_reason) == ("Failed", "NotDelivered")
    assert "HostKeyMismatch" in result.summary
    assert evidence.steps == ["failure"]
    assert listdir(partner.final_dir) == [] and listdir(partner.temp_dir) == []


async def test_connection_closed_mid_transfer_is_not_delivered(
    partner: LocalPartner, local: tuple[Path, bytes]
) -> None:
    async def drop_on_third_chunk(p: str, offset: int) -> None:
        if offset >= 2 * CHUNK:
            partner.hooks.on_write = None  # once
            partner.close_connections()

    partner.hooks.on_write = drop_on_third_chunk
    result, evidence = await deliver_local(partner, local, "k", chunk_size=CHUNK)
    assert (result.outcome, result.failure_reason) == ("Failed", "NotDelivered"), result.summary
    assert listdir(partner.final_dir) == []
    assert listdir(partner.temp_dir) == []  # removed over a fresh connection
    assert evidence.steps == ["baseline", "fresh_listing"]
    assert evidence.first("fresh_listing")["failed_step"] == "upload"
    assert evidence.first("fresh_listing")["final"]["exists"] is False


@pytest.mark.spec("LV1")
async def test_connection_closed_while_the_session_opens_is_not_delivered_and_safe_to_try_again(
    partner: LocalPartner, local: tuple[Path, bytes]
) -> None:
    """A partner's connections dropped while this client waits for its SFTP session to open (the full chaos
    profile's partner cut met two exports so): asyncssh answers ChannelOpenError, 'SSH connection closed'. Nothing
    was sent, and the fault may pass: another try, or a hand-back, may deliver. Before, it was taken for a refusal by
    the partner and ended the export NotDelivered at once (seen failing)."""
    async def drop_the_connection() -> None:
        partner.hooks.on_session = None  # once
        partner.close_connections()

    partner.hooks.on_session = drop_the_connection
    result, evidence = await deliver_local(partner, local, "s", chunk_size=CHUNK)
    assert (result.outcome, result.failure_reason) == ("Failed", "NotDelivered"), result.summary
    assert evidence.first("failure")["failed_step"] == "connect"
    assert "ChannelOpenError" in evidence.first("failure")["error"]  # the fault was the one meant
    assert result.retry_safe and result.before_rename
    assert listdir(partner.final_dir) == [] and listdir(partner.temp_dir) == []


async def test_a_partner_that_refuses_the_sftp_session_is_not_tried_again(
    partner: LocalPartner, local: tuple[Path, bytes]
) -> None:
    """The other side: a session the partner refuses (administratively prohibited) would be refused again."""
    async def refuse() -> None:
        raise asyncssh.ChannelOpenError(asyncssh.OPEN_ADMINISTRATIVELY_PROHIBITED, "no sftp for you")

    partner.hooks.on_session = refuse
    result, evidence = await deliver_local(partner, local, "r", chunk_size=CHUNK)
    assert (result.outcome, result.failure_reason) == ("Failed", "NotDelivered"), result.summary
    assert "ChannelOpenError" in evidence.first("failure")["error"]
    assert not result.retry_safe


async def test_file_appearing_before_rename_is_never_overwritten(
    partner: LocalPartner, local: tuple[Path, bytes]
) -> None:
    theirs = b"written by a second client between listing and rename\n"
    dest = partner.destination()

    async def second_client_writes(old: str, new: str) -> None:
        partner.hooks.before_rename = None
        await bounded(write_as_other_party(dest, new, theirs))

    partner.hooks.before_rename = second_client_writes
    evidence = Evidence()
    result = await bounded(deliver(dest, str(local[0]), "contacts-k.csv", "k.part", record_evidence=evidence))
    assert result.outcome == "OutcomeUnknown" and result.failure_reason is None, result.summary
    assert (partner.final_dir / "contacts-k.csv").read_bytes() == theirs
    assert listdir(partner.temp_dir) == []
    assert evidence.steps == ["baseline", "rename", "fresh_listing"]
    fresh = evidence.first("fresh_listing")
    assert fresh["failed_step"] == "rename" and "SFTPFailure" in fresh["error"]
    assert fresh["final"]["size"] == len(theirs)


async def test_connection_closed_after_rename_is_outcome_unknown(
    partner: LocalPartner, local: tuple[Path, bytes]
) -> None:
    async def drop(old: str, new: str) -> None:
        partner.close_connections()

    partner.hooks.after_rename = drop
    result, evidence = await deliver_local(partner, local, "k")
    assert result.outcome == "OutcomeUnknown" and result.receipt is None, result.summary
    # It did arrive; only a person (or a later reconciliation) may say so.
    assert (partner.final_dir / "contacts-k.csv").read_bytes() == local[1]
    assert listdir(partner.temp_dir) == []
    assert evidence.steps == ["baseline", "rename", "fresh_listing"]
    assert evidence.first("fresh_listing")["final"]["exists"] is True


async def deliver_under_check_file(partner: LocalPartner, local: tuple[Path, bytes], evidence: Evidence):
    """A delivery to a destination whose contract says the partner answers check-file-name."""
    path, data = local
    return await bounded(deliver(partner.destination(contract=PartnerContract(hash_evidence="check_file")),
                                 str(path), "contacts-k.csv", "k.part", record_evidence=evidence,
                                 expected_sha256=hashlib.sha256(data).hexdigest()))


async def test_check_file__the_partner_hashes_its_own_file(partner: LocalPartner) -> None:
    data = b"email,first_name\n" * 5000
    (partner.final_dir / "x.csv").write_bytes(data)
    async with connect(partner.destination()) as sftp:
        assert await bounded(check_file_sha256(sftp, "/outbound/x.csv")) == hashlib.sha256(data).hexdigest()
        with pytest.raises(asyncssh.SFTPNoSuchFile):
            await bounded(check_file_sha256(sftp, "/outbound/absent.csv"))
    partner.offers_check_file = False
    async with connect(partner.destination()) as sftp:
        with pytest.raises(asyncssh.SFTPOpUnsupported):
            await bounded(check_file_sha256(sftp, "/outbound/x.csv"))


async def test_check_file__delivery_confirmed_by_the_partners_hash(
    partner: LocalPartner, local: tuple[Path, bytes]
) -> None:
    data = local[1]
    evidence = Evidence()
    result = await deliver_under_check_file(partner, local, evidence)
    assert result.outcome == "Completed" and "confirmed by sha256" in result.summary, result.summary
    assert evidence.first("receipt")["sha256"] == hashlib.sha256(data).hexdigest()


async def test_check_file__a_file_changed_at_the_partner_is_not_confirmed(
    partner: LocalPartner, local: tuple[Path, bytes]
) -> None:
    data = local[1]
    altered = bytes([data[0] ^ 1]) + data[1:]

    async def partner_rewrites(old: str, new: str) -> None:
        (partner.root / new.lstrip("/")).write_bytes(altered)  # same size, other bytes

    partner.hooks.after_rename = partner_rewrites
    result = await deliver_under_check_file(partner, local, Evidence())
    assert result.outcome == "OutcomeUnknown" and "sha256" in result.summary, result.summary


@pytest.mark.spec("DV2")
async def test_check_file__not_offered_after_all_is_outcome_unknown_never_completed_by_size(
    partner: LocalPartner, local: tuple[Path, bytes]
) -> None:
    partner.offers_check_file = False
    evidence = Evidence()
    result = await deliver_under_check_file(partner, local, evidence)
    assert result.outcome == "OutcomeUnknown" and "confirmed" not in result.summary, result.summary
    assert "the contract promises could not be had" in result.summary and "SFTPOpUnsupported" in result.summary
    receipt = evidence.first("receipt")
    assert receipt["sha256"] is None and "SFTPOpUnsupported" in receipt["sha256_error"]


async def test_cancelled_upload_is_classified_not_raised(
    partner: LocalPartner, local: tuple[Path, bytes]
) -> None:
    entered, release = asyncio.Event(), asyncio.Event()

    async def stall(p: str, offset: int) -> None:
        if offset >= CHUNK:
            entered.set()
            await bounded(release.wait())

    partner.hooks.on_write = stall
    evidence = Evidence()
    task = asyncio.create_task(deliver(partner.destination(), str(local[0]), "contacts-k.csv", "k.part",
                                       record_evidence=evidence, chunk_size=CHUNK))
    try:
        await bounded(entered.wait())
        task.cancel()
        result = await bounded(task)
    finally:
        release.set()
    assert (result.outcome, result.failure_reason) == ("Failed", "NotDelivered"), result.summary
    assert "CancelledError" in result.summary
    assert evidence.steps == ["baseline", "fresh_listing"]
    assert listdir(partner.final_dir) == []


async def test_evidence_failures_do_not_change_the_outcome(
    partner: LocalPartner, local: tuple[Path, bytes]
) -> None:
    result, evidence = await deliver_local(partner, local, "k", evidence=Evidence(fail=True))
    assert result.outcome == "Completed"
    assert evidence.steps == ["baseline", "rename", "receipt"]


async def test_throttle_limits_the_average_rate(partner: LocalPartner, tmp_path: Path) -> None:
    path = tmp_path / "small.csv"
    make_file(path, 4 * CHUNK)
    loop = asyncio.get_running_loop()
    started = loop.time()
    result = await bounded(deliver(partner.destination(), str(path), "small.csv", "small.part",
                                   record_evidence=Evidence(), chunk_size=CHUNK,
                                   throttle_bytes_per_second=8 * CHUNK))
    assert result.outcome == "Completed"
    assert loop.time() - started >= 0.45


def test_credential_ref_schemes(partner: LocalPartner, monkeypatch: pytest.MonkeyPatch) -> None:
    key = load_client_key(f"file:{partner.client_key_path}")
    monkeypatch.setenv("PARTNER_KEY_TEST", key.export_private_key().decode())
    assert load_client_key("env:PARTNER_KEY_TEST").public_data == key.public_data
    with pytest.raises(ValueError, match="unsupported credential_ref scheme"):
        load_client_key("vault:secret/partner")

