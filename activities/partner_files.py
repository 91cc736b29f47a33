"""What the partner shows: the final name listed (a baseline, a receipt, the preparation's look, recovery's look) and
the evidence by content its contract offers for a file there (a SHA-256 by read-back or check-file, an
acknowledgment), and whether a file under a replacement's name is its original's delivery."""

from __future__ import annotations

import asyncio
import hashlib
import posixpath

import asyncssh

from activities import outcomes
from activities.destination import DestinationConfig, Replacement
from activities.outcomes import RemoteFile
from activities.partner_connection import connect, within
from activities.partner_looks import PartnerLooks
from activities.sftp_check_file import check_file_sha256


class FinalDirMissing(Exception):
    """The partner has no final directory: no rename could ever publish the file."""



async def list_file(sftp: asyncssh.SFTPClient, path: str) -> RemoteFile:
    try:
        attrs = await sftp.stat(path)
    except asyncssh.SFTPNoSuchFile:
        return RemoteFile(path=path, exists=False)
    return RemoteFile(path=path, exists=True, size=attrs.size, mtime=attrs.mtime)


async def require_final_dir(sftp: asyncssh.SFTPClient, dest: DestinationConfig) -> None:
    try:
        await sftp.stat(dest.final_dir)
    except asyncssh.SFTPNoSuchFile:
        raise FinalDirMissing(f"final directory {dest.final_dir} does not exist at the partner") from None


async def preflight(dest: DestinationConfig, final_name: str, *, timeout: float = 10.0,
                    looks: PartnerLooks | None = None) -> RemoteFile:
    """The preparation's look, before the build: connect with the pinned key and the credential, require the final
    directory, and list the final name; on a session `looks` shares with other looks, else on a connection of its
    own. Raises HostKeyMismatch, ValueError (an unusable credential or key), asyncssh.PermissionDenied (the
    credential is refused) or FinalDirMissing for what no retry can mend."""

    async def look(sftp: asyncssh.SFTPClient) -> RemoteFile:
        await require_final_dir(sftp, dest)
        return await list_file(sftp, posixpath.join(dest.final_dir, final_name))

    async with within(timeout * 3):
        if looks is not None:
            return await looks.look(dest, look, connect_timeout=timeout)
        async with connect(dest, connect_timeout=timeout) as sftp:
            return await look(sftp)


async def list_final(dest: DestinationConfig, final_name: str, *, timeout: float = 10.0) -> RemoteFile:
    """The final name as the partner shows it now, on a connection of its own (recovery's evidence)."""
    async with asyncio.timeout(timeout):
        async with connect(dest, connect_timeout=timeout) as sftp:
            return await list_file(sftp, posixpath.join(dest.final_dir, final_name))


async def look_at_final(dest: DestinationConfig, final_name: str, *, timeout: float = 10.0) -> outcomes.FinalLook:
    """The final name with every evidence by content the contract offers (hash, acknowledgment), on a connection
    of its own: recovery's own look. A hash or acknowledgment that cannot be had is recorded, not raised."""
    final_path = posixpath.join(dest.final_dir, final_name)
    async with asyncio.timeout(timeout * 4):
        async with connect(dest, connect_timeout=timeout) as sftp:
            final = await list_file(sftp, final_path)
            if not final.exists:
                return outcomes.FinalLook(exists=False)
            sha256 = acknowledged = error = None
            try:
                sha256 = await content_sha256(sftp, dest, final_path, timeout)
                acknowledged = await acknowledged_sha256(sftp, dest, final_name, timeout)
            except (asyncssh.Error, OSError) as exc:
                error = outcomes.describe(exc)
            return outcomes.FinalLook(exists=True, size=final.size, sha256=sha256, sha256_error=error,
                                      acknowledged_sha256=acknowledged)


async def follow_up_look(dest: DestinationConfig, final_name: str, *, timeout: float = 10.0,
                         read_timeout: float = 120.0) -> outcomes.FinalLook:
    """The evidence follow-up's look: the final name's listing, its SHA-256 read back whatever the contract offers
    (reading is what every SFTP server allows), and the partner's acknowledgment, which may outlive the file (a
    partner that took it). A hash or acknowledgment that cannot be had is recorded, not raised."""
    final_path = posixpath.join(dest.final_dir, final_name)
    async with asyncio.timeout(timeout * 3 + read_timeout):
        async with connect(dest, connect_timeout=timeout) as sftp:
            final = await list_file(sftp, final_path)
            sha256 = acknowledged = None
            problems = []
            if final.exists:
                try:
                    sha256 = await read_back_sha256(sftp, final_path, read_timeout)
                except (asyncssh.Error, OSError, TimeoutError) as exc:
                    problems.append(f"read back: {outcomes.describe(exc)}")
            try:
                acknowledged = await acknowledged_sha256(sftp, dest, final_name, timeout)
            except (asyncssh.Error, OSError, TimeoutError, UnicodeError) as exc:
                problems.append(f"acknowledgment: {outcomes.describe(exc)}")
            return outcomes.FinalLook(exists=final.exists, size=final.size if final.exists else None,
                                      sha256=sha256, sha256_error="; ".join(problems) or None,
                                      acknowledged_sha256=acknowledged)


async def content_sha256(sftp: asyncssh.SFTPClient, dest: DestinationConfig, path: str,
                         operation_timeout: float) -> str | None:
    """The SHA-256 (hex) of the partner's file, by the means its contract offers; None where it offers none."""
    if dest.contract.hash_evidence == "check_file":
        async with within(operation_timeout):
            return await check_file_sha256(sftp, path)
    if dest.contract.hash_evidence == "read_back":
        return await read_back_sha256(sftp, path, operation_timeout)
    return None


async def read_back_sha256(sftp: asyncssh.SFTPClient, path: str, timeout: float) -> str:
    """The SHA-256 (hex) of the partner's file, read back whole within `timeout`."""
    digest = hashlib.sha256()
    async with within(timeout):
        async with sftp.open(path, "rb") as remote:
            while chunk := await remote.read(256 * 1024):
                # asyncssh types read() as an unbound AnyStr (str); a file opened "rb" reads bytes.
                digest.update(chunk)  # type: ignore[arg-type]
    return digest.hexdigest()


async def acknowledged_sha256(sftp: asyncssh.SFTPClient, dest: DestinationConfig, final_name: str,
                              operation_timeout: float) -> str | None:
    """The SHA-256 the partner acknowledged for this final name, if it wrote an acknowledgment."""
    if dest.contract.acknowledgment_dir is None:
        return None
    path = posixpath.join(dest.contract.acknowledgment_dir, f"{final_name}.ack")
    try:
        async with within(operation_timeout):
            async with sftp.open(path, "r") as ack:
                text = await ack.read(4096)
    except asyncssh.SFTPNoSuchFile:
        return None
    return text.strip().removeprefix("sha256=").strip().lower() or None


async def identify(sftp: asyncssh.SFTPClient, dest: DestinationConfig, final_path: str, final_name: str,
                   found: RemoteFile, original: Replacement, operation_timeout: float) -> tuple[bool, str]:
    """Whether a file under a replacement's final name is the original's delivery, and on what evidence:
    a matching checksum, an acknowledgment tied to the original, or name and size where the contract says so."""
    if original.original_sha256:
        actual = await content_sha256(sftp, dest, final_path, operation_timeout)
        if actual is not None and actual == original.original_sha256:
            return True, "checksum matches the original's expected file"
    if original.original_sha256:
        acknowledged = await acknowledged_sha256(sftp, dest, final_name, operation_timeout)
        if acknowledged == original.original_sha256:
            return True, "the partner's acknowledgment names the original's file"
    if dest.contract.name_and_size_identify and found.size == original.original_bytes:
        return True, "name and size match the original's, which the contract accepts"
    return False, "not identified as the original's delivery"
