"""The SFTP `check-file-name` request: the partner hashes a file it holds and answers with the digest, so a
delivery gets evidence by content without reading the file back.

Wire format (draft-ietf-secsh-filexfer-09, section 9.1.2, "Checking File Contents"), inside SSH_FXP_EXTENDED:

    string "check-file-name", string filename, string hash-algorithm-list (comma-separated),
    uint64 start-offset, uint64 length (0: to the end), uint32 block-size (0: one hash of the whole range)

answered by SSH_FXP_EXTENDED_REPLY with string "check-file", string hash-algorithm-used, then the hash bytes;
or by an SSH_FXP_STATUS error (OP_UNSUPPORTED where the server does not offer it).

asyncssh 2.x has no call for it, and OpenSSH's sftp-server does not implement it. The client sends it through
asyncssh's own request machinery; the local partner (starter/localstack/partner.py) answers it. Both ends use
the encoding here, so the format is written once.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import cast

import asyncssh
from asyncssh.constants import FXP_EXTENDED_REPLY
from asyncssh.packet import SSHPacket, String, UInt32, UInt64

CHECK_FILE_NAME = b"check-file-name"
REPLY_NAME = b"check-file"
ALGORITHM = "sha256"


class CheckFileError(Exception):
    """The partner's check-file reply cannot serve as a SHA-256 of the whole file."""


@dataclass(frozen=True)
class CheckFileRequest:
    path: bytes
    algorithms: tuple[str, ...]
    start_offset: int = 0
    length: int = 0
    block_size: int = 0

    def encode(self) -> bytes:
        return (String(self.path) + String(",".join(self.algorithms)) + UInt64(self.start_offset)
                + UInt64(self.length) + UInt32(self.block_size))

    @classmethod
    def decode(cls, packet: SSHPacket) -> CheckFileRequest:
        path = packet.get_string()
        algorithms = tuple(a for a in packet.get_string().decode("ascii").split(",") if a)
        start_offset, length, block_size = packet.get_uint64(), packet.get_uint64(), packet.get_uint32()
        packet.check_end()
        return cls(path, algorithms, start_offset, length, block_size)


@dataclass(frozen=True)
class CheckFileReply:
    algorithm: str
    digest: bytes

    def encode(self, sftp_version: int = 3) -> bytes:
        # The signature asyncssh's server calls on a reply object; the version does not change this format.
        return String(REPLY_NAME) + String(self.algorithm) + self.digest

    @classmethod
    def decode(cls, packet: SSHPacket) -> CheckFileReply:
        if packet.get_string() != REPLY_NAME:
            raise CheckFileError("the reply is not a check-file reply")
        algorithm = packet.get_string().decode("ascii", "replace")
        return cls(algorithm, packet.get_remaining_payload())


async def check_file_sha256(sftp: asyncssh.SFTPClient, path: str) -> str:
    """The SHA-256 (hex) of the partner's whole file at `path`, as the partner computed it.

    Raises asyncssh.SFTPError as the server answers (SFTPOpUnsupported where it does not offer check-file,
    SFTPNoSuchFile), CheckFileError for a reply that is not one SHA-256.
    """
    handler = sftp._handler  # noqa: SLF001 - asyncssh's request machinery; it has no public extended-request call
    # asyncssh checks each reply's type against a table of its own requests. This session learns the type of this
    # one (an instance attribute: nothing global changes).
    if CHECK_FILE_NAME not in handler._return_types:  # noqa: SLF001
        handler._return_types = {**handler._return_types, CHECK_FILE_NAME: FXP_EXTENDED_REPLY}  # noqa: SLF001
    request = CheckFileRequest(sftp.encode(path), (ALGORITHM,))
    # Typed as whatever a reply may be; an extended reply is a packet (asyncssh casts its own the same way).
    packet = cast(SSHPacket, await handler._make_request(CHECK_FILE_NAME, request.encode()))  # noqa: SLF001
    reply = CheckFileReply.decode(packet)
    if reply.algorithm != ALGORITHM or len(reply.digest) != hashlib.sha256().digest_size:
        raise CheckFileError(f"asked for one {ALGORITHM} of the whole file, got {reply.algorithm} "
                             f"({len(reply.digest)} bytes)")
    return reply.digest.hex()
