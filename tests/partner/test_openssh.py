"""The delivery rules against OpenSSH's sshd and sftp-server, through the real worker (issue 5, interop)."""

from __future__ import annotations

import hashlib
import uuid

import asyncssh
import pytest

from activities.delivery_connections import DeliveryConnections
from activities.partner_connection import HostKeyMismatch, connect
from activities.partner_delivery import deliver
from activities.sftp_check_file import check_file_sha256
from starter.localstack.seed import seed_destination
from store.models import FailureCode, Status
from tests.helpers.harness import Harness
from tests.helpers.openssh_partner import OpenSshPartner
from tests.helpers.partner import Evidence, bounded, make_file
from tests.helpers.store_states import drive
from tests.helpers.support import delivery_evidence


async def openssh_destination(h: Harness, server: OpenSshPartner, **contract: object) -> uuid.UUID:
    d = server.destination()
    return await seed_destination(h.db.admin, h.tenant_id, name="openssh partner", host=d.host, port=d.port,
                                  username=d.username, final_dir=d.final_dir, temp_dir=d.temp_dir,
                                  host_key=d.host_key, credential_ref=d.credential_ref, **contract)


async def run_export(h: Harness, destination_id: uuid.UUID, **kwargs: object):
    job_id = await h.exports.create(tenant_id=h.tenant_id, destination_id=destination_id, created_by="tests",
                                    **kwargs)
    return await h.settled(job_id)


async def test_openssh__delivery_completes_and_matches(harness: Harness, openssh: OpenSshPartner):
    row = await run_export(harness, await openssh_destination(harness, openssh, hash_evidence="read_back"))
    assert row.status is Status.COMPLETED
    data = (openssh.root / "outbound" / row.final_name).read_bytes()
    assert hashlib.sha256(data).digest() == row.expected_file_sha256
    assert list((openssh.root / "incoming-tmp").iterdir()) == []


@pytest.mark.spec("IU2")
async def test_openssh__occupied_final_name_fails_with_nothing_uploaded(harness: Harness, openssh: OpenSshPartner):
    key = f"k{uuid.uuid4().hex[:10]}"
    squatter = openssh.root / "outbound" / f"contacts-{harness.tenant_id}-{key}.csv"
    squatter.write_bytes(b"already here\n")
    row = await run_export(harness, await openssh_destination(harness, openssh), delivery_key=key)
    assert (row.status, row.failure_reason) == (Status.FAILED, FailureCode.FINAL_NAME_OCCUPIED)
    assert squatter.read_bytes() == b"already here\n"


async def test_openssh__no_overwrite_rename_refuses_an_existing_name(openssh: OpenSshPartner):
    """The SFTP v3 rename that every original uses fails on OpenSSH when the final name exists."""
    dest = openssh.destination()
    async with connect(dest) as sftp:
        for name, data in (("a.part", b"new"), ("../outbound/a.csv", b"old")):
            async with sftp.open(f"{dest.temp_dir}/{name}", "wb") as f:
                await f.write(data)
        with pytest.raises(asyncssh.SFTPFailure):
            await sftp.rename(f"{dest.temp_dir}/a.part", f"{dest.final_dir}/a.csv")
    assert (openssh.root / "outbound" / "a.csv").read_bytes() == b"old"


async def test_openssh__a_delivery_writes_as_much_as_sftp_server_announces(openssh: OpenSshPartner, tmp_path):
    """sftp-server announces 255 KiB writes (limits@openssh.com): four of them are in flight at once."""
    async with connect(openssh.destination()) as sftp:
        announced = sftp.limits.max_write_len
    assert announced == 255 * 1024
    path = tmp_path / "large.csv"
    data = make_file(path, 10 * announced + 7)
    progress: list[int] = []
    result = await bounded(deliver(openssh.destination(), str(path), "large.csv", "large.part",
                                   record_evidence=Evidence(), on_progress=lambda sent, _: progress.append(sent)))
    assert result.outcome == "Completed" and (openssh.root / "outbound" / "large.csv").read_bytes() == data
    assert progress == [4 * announced, 8 * announced, len(data)]


async def test_openssh__deliveries_one_after_another_open_their_sessions_on_one_connection(
        openssh: OpenSshPartner, tmp_path):
    """sshd starts a new sftp-server for each session on a connection: a delivery on a connection that the one
    before it handed on (activities/delivery_connections.py) gets a subsystem of its own and delivers."""
    kept = DeliveryConnections(linger_seconds=30.0, max_age_seconds=60.0)
    try:
        for n in range(3):
            path = tmp_path / f"f{n}.csv"
            data = make_file(path, 70_000 + n)
            evidence = Evidence()
            result = await bounded(deliver(openssh.destination(), str(path), f"f{n}.csv", f"f{n}.part",
                                           record_evidence=evidence, connections=kept))
            assert result.outcome == "Completed", result.summary
            assert evidence.steps == ["baseline", "rename", "receipt"]
            assert (openssh.root / "outbound" / f"f{n}.csv").read_bytes() == data
        assert (kept.opened, kept.reused) == (1, 2)
    finally:
        await bounded(kept.close())


@pytest.mark.spec("RD1")
async def test_openssh__replacement_identifies_the_originals_file_by_checksum(harness: Harness,
                                                                            openssh: OpenSshPartner):
    h = harness
    destination = await openssh_destination(h, openssh, hash_evidence="read_back")
    original = await h.exports.create(tenant_id=h.tenant_id, destination_id=destination, created_by="tests")
    # No worker is told about this original: its row is driven to OutcomeUnknown through the real statements,
    # with an expected file that the partner does hold.
    await h.db.admin.execute("UPDATE outbox SET published_at = clock_timestamp() WHERE job_id = $1", original)
    await drive(h.store, original, Status.OUTCOME_UNKNOWN)
    row = await h.store.read_job(original)
    (openssh.root / "outbound" / row.final_name).write_bytes(b"contacts")  # drive's expected file
    replacement = await h.exports.replace(tenant_id=h.tenant_id, original_job_id=original, created_by="ops",
                                          reason="outcome unknown")
    replaced = await h.settled(replacement)
    assert (replaced.status, replaced.failure_reason) == (Status.FAILED, FailureCode.ORIGINAL_DELIVERED)
    assert (openssh.root / "outbound" / row.final_name).read_bytes() == b"contacts"


@pytest.mark.spec("DV2")
async def test_openssh__offers_no_check_file_so_a_delivery_promised_it_is_outcome_unknown(
        harness: Harness, openssh: OpenSshPartner):
    """OpenSSH's sftp-server answers check-file-name with OP_UNSUPPORTED. A destination whose contract claims
    the extension gets no Completed by size: the evidence it promised is missing, so the outcome is unknown, and
    its receipt says why."""
    async with connect(openssh.destination()) as sftp:
        with pytest.raises(asyncssh.SFTPOpUnsupported):
            await check_file_sha256(sftp, f"{openssh.destination().final_dir}/anything.csv")
    row = await run_export(harness, await openssh_destination(harness, openssh, hash_evidence="check_file"))
    assert row.status is Status.OUTCOME_UNKNOWN
    receipts = await delivery_evidence(harness.db.admin, row.id)
    assert any("SFTPOpUnsupported" in r and '"receipt"' in r for r in receipts), receipts


async def test_openssh__pinned_host_key_mismatch_refuses_to_connect(openssh: OpenSshPartner):
    wrong = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()
    dest = openssh.destination().model_copy(update={"host_key": wrong})
    with pytest.raises(HostKeyMismatch):
        async with connect(dest):
            pass


async def test_openssh__a_pinned_key_of_a_type_the_server_lacks_is_a_host_key_mismatch(openssh: OpenSshPartner):
    """sshd ends a handshake that allows no host key type it holds by cutting the connection (a reset, sometimes a
    plain close), never with a reason. That is still a host key mismatch, not a connection failure to retry."""
    for algorithm in ("ecdsa-sha2-nistp256", "ssh-rsa"):
        wrong = asyncssh.generate_private_key(algorithm).export_public_key().decode().strip()
        dest = openssh.destination().model_copy(update={"host_key": wrong})
        for _ in range(5):
            with pytest.raises(HostKeyMismatch, match="has no host key of the pinned type"):
                async with connect(dest, connect_timeout=10):
                    pass
