"""A local SFTP partner for demos and tests: a real asyncssh server chrooted at a directory, with fault hooks.

The partner processes files that appear in /outbound and ignores /incoming-tmp. Hooks are awaited inside the
server's request handling, so a hook can block the request (an asyncio.Event the test controls), act as
another party (a second client writing a file), or drop every connection (`close_connections`).

It offers the SFTP hash extension `check-file-name` (SHA-256 of a whole file) unless started with
`offers_check_file=False`, as a partner without it (OpenSSH, for one) answers: OP_UNSUPPORTED.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import posixpath
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import asyncssh
from asyncssh.constants import FXP_EXTENDED_REPLY
from asyncssh.packet import SSHPacket
from asyncssh.sftp import SFTPServerHandler
from asyncssh.stream import SSHReader, SSHServerStreamSession, SSHWriter

from activities.destination import DestinationConfig
from activities.sftp_check_file import ALGORITHM, CHECK_FILE_NAME, CheckFileReply, CheckFileRequest

logger = logging.getLogger(__name__)

FINAL_DIR = "outbound"
TEMP_DIR = "incoming-tmp"
USERNAME = "partner"


@dataclass
class PartnerHooks:
    """Fault hooks, each awaited at its point when set. Paths as the client sees them, e.g. "/outbound/x"."""

    before_rename: Callable[[str, str], Awaitable[None]] | None = None  # (old_path, new_path)
    after_rename: Callable[[str, str], Awaitable[None]] | None = None  # the rename is done, not yet answered
    on_write: Callable[[str, int], Awaitable[None]] | None = None  # (path, offset), before writing the data
    on_session: Callable[[], Awaitable[None]] | None = None  # a client asked for its SFTP session, not yet opened


def _client_path(path: bytes) -> str:
    # Hooks compare paths, so give them one spelling: absolute and normalized, as inside the chroot.
    return posixpath.normpath(posixpath.join("/", os.fsdecode(path)))


class _PartnerSFTPServer(asyncssh.SFTPServer):
    def __init__(self, chan: asyncssh.SSHServerChannel[bytes], *, root: Path, hooks: PartnerHooks,
                 offers_check_file: bool) -> None:
        super().__init__(chan, chroot=os.fsencode(root))
        self._hooks = hooks
        self._offers_check_file = offers_check_file
        # Client-visible path of each open file, for the on_write hook.
        self._paths: dict[int, str] = {}

    def open(self, path: bytes, pflags: int, attrs: asyncssh.SFTPAttrs) -> object:
        file_obj = super().open(path, pflags, attrs)
        self._paths[id(file_obj)] = _client_path(path)
        return file_obj

    def close(self, file_obj: object) -> None:
        self._paths.pop(id(file_obj), None)
        super().close(file_obj)

    async def write(self, file_obj: object, offset: int, data: bytes) -> int:
        if self._hooks.on_write is not None:
            await self._hooks.on_write(self._paths.get(id(file_obj), "?"), offset)
        # The base class writes the local file there and then: a count, never an awaitable.
        return cast(int, super().write(file_obj, offset, data))

    async def rename(self, oldpath: bytes, newpath: bytes) -> None:
        old, new = _client_path(oldpath), _client_path(newpath)
        if self._hooks.before_rename is not None:
            await self._hooks.before_rename(old, new)
        # The base class refuses an existing new name (SFTP v3: FX_FAILURE), as real servers do for rename.
        super().rename(oldpath, newpath)
        if self._hooks.after_rename is not None:
            await self._hooks.after_rename(old, new)


    async def check_file(self, request: CheckFileRequest) -> CheckFileReply:
        if not self._offers_check_file:
            raise asyncssh.SFTPOpUnsupported("check-file-name is not offered")
        if ALGORITHM not in request.algorithms or request.block_size != 0:
            raise asyncssh.SFTPOpUnsupported(f"only one {ALGORITHM} of a range is offered")
        path = self.map_path(request.path)
        return CheckFileReply(ALGORITHM, await asyncio.to_thread(_sha256_range, path, request.start_offset,
                                                                 request.length))


def _sha256_range(path: bytes, offset: int, length: int) -> bytes:
    digest = hashlib.sha256()
    remaining = length or None  # 0: to the end
    with open(path, "rb") as fh:
        fh.seek(offset)
        while remaining is None or remaining > 0:
            chunk = fh.read(256 * 1024 if remaining is None else min(remaining, 256 * 1024))
            if not chunk:
                break
            digest.update(chunk)
            if remaining is not None:
                remaining -= len(chunk)
    return digest.digest()


async def _process_check_file_name(handler: SFTPServerHandler, packet: SSHPacket) -> CheckFileReply:
    server = cast(_PartnerSFTPServer, handler._server)  # noqa: SLF001 - the handler serves the partner's server
    return await server.check_file(CheckFileRequest.decode(packet))


class _PartnerSFTPHandler(SFTPServerHandler):
    """asyncssh's SFTP server protocol, with the partner's one extended request added (class tables of this
    subclass; asyncssh's own are untouched)."""

    _packet_handlers = {**SFTPServerHandler._packet_handlers, CHECK_FILE_NAME: _process_check_file_name}
    _return_types = {**SFTPServerHandler._return_types, CHECK_FILE_NAME: FXP_EXTENDED_REPLY}


class _PartnerSession(SSHServerStreamSession[bytes]):
    """A session that serves SFTP only (no shell, exec or scp), through `_PartnerSFTPHandler`: asyncssh's own
    session would start its stock handler."""

    def session_started(self) -> None:
        assert self._chan is not None and self._conn is not None
        # Also switches the channel to bytes. The partner's factory returns the server itself, never an awaitable.
        server = cast(asyncssh.SFTPServer, self._init_sftp_server())
        handler = _PartnerSFTPHandler(server, SSHReader(self, self._chan), SSHWriter(self, self._chan),
                                      self._sftp_version)
        self._conn.create_task(handler.run())


class _ConnectionTracker(asyncssh.SSHServer):
    """Keeps the partner's set of open connections current, so faults can drop them, and opens its sessions."""

    def __init__(self, connections: set[asyncssh.SSHServerConnection],
                 sftp_factory: Callable[[asyncssh.SSHServerChannel[bytes]], _PartnerSFTPServer],
                 hooks: PartnerHooks, on_accepted: Callable[[], None]) -> None:
        self._connections = connections
        self._on_accepted = on_accepted
        self._sftp_factory = sftp_factory
        self._hooks = hooks
        self._conn: asyncssh.SSHServerConnection | None = None

    def session_requested(self) -> _PartnerSession | Awaitable[_PartnerSession]:
        # With the hook set, an awaitable (asyncssh awaits it): the hook may drop the connection meanwhile. Without
        # it, the session at once, as asyncssh opens most sessions.
        if self._hooks.on_session is not None:
            return self._session_after(self._hooks.on_session)
        return self._session()

    async def _session_after(self, hook: Callable[[], Awaitable[None]]) -> _PartnerSession:
        await hook()
        return self._session()

    def _session(self) -> _PartnerSession:
        # asyncssh hands an SFTP factory the session's server channel, but types it as any SSHChannel (and types
        # SFTPServer's own channel as a server channel): the factory's type cannot satisfy both.
        return _PartnerSession(None, self._sftp_factory, sftp_version=3)  # type: ignore[arg-type]

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self._conn = conn
        self._connections.add(conn)
        self._on_accepted()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._conn is not None:
            self._connections.discard(self._conn)


def _load_or_create_key(path: Path) -> asyncssh.SSHKey:
    if path.exists():
        return asyncssh.read_private_key(path)
    key = asyncssh.generate_private_key("ssh-ed25519")
    path.parent.mkdir(parents=True, exist_ok=True)
    # Created 0600 from the start, so the private key is never readable by others, not even briefly.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(key.export_private_key())
    return key


class LocalPartner:
    def __init__(
        self,
        root: Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        host_key_path: Path | None = None,
        client_key_path: Path | None = None,
        offers_check_file: bool = True,
    ) -> None:
        self.root = Path(root)
        self.host = host
        self.port = port
        self.host_key_path = Path(host_key_path) if host_key_path else self.root.parent / "partner_host_key"
        self.client_key_path = (
            Path(client_key_path) if client_key_path else self.root.parent / "partner_client_key"
        )
        self.hooks = PartnerHooks()
        self.offers_check_file = offers_check_file
        self.host_key_line = ""
        self._server: asyncssh.SSHAcceptor | None = None
        self._connections: set[asyncssh.SSHServerConnection] = set()
        self.accepted_connections = 0  # since start, however each ended

    @property
    def final_dir(self) -> Path:
        return self.root / FINAL_DIR

    @property
    def temp_dir(self) -> Path:
        return self.root / TEMP_DIR

    async def start(self) -> None:
        host_key = _load_or_create_key(self.host_key_path)
        client_key = _load_or_create_key(self.client_key_path)
        self.host_key_line = host_key.export_public_key().decode().strip()
        self.final_dir.mkdir(parents=True, exist_ok=True)
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        root = self.root.resolve()
        hooks = self.hooks
        self._server = await asyncssh.listen(
            host=self.host,
            port=self.port,
            server_host_keys=[host_key],
            # Only the generated client key gets in, under any user name.
            authorized_client_keys=asyncssh.import_authorized_keys(client_key.export_public_key().decode()),
            server_factory=lambda: _ConnectionTracker(
                self._connections,
                lambda chan: _PartnerSFTPServer(chan, root=root, hooks=hooks,
                                                offers_check_file=self.offers_check_file), hooks,
                self._accepted),
            allow_scp=False,
            config=[],
        )
        self.port = self._server.get_port()
        logger.info("local partner listening on %s:%d, root %s", self.host, self.port, root)

    async def stop(self) -> None:
        self.close_connections()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    def _accepted(self) -> None:
        self.accepted_connections += 1

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    def close_connections(self) -> None:
        """Abort every open client connection now, without a goodbye: a dropped network, to the client."""
        for conn in list(self._connections):
            conn.abort()
        self._connections.clear()

    def destination(self, **overrides: Any) -> DestinationConfig:
        """The DestinationConfig that reaches this partner; `overrides` replace fields (a wrong host_key)."""
        fields: dict[str, Any] = {
            "host": self.host,
            "port": self.port,
            "username": USERNAME,
            "final_dir": "/" + FINAL_DIR,
            "temp_dir": "/" + TEMP_DIR,
            "host_key": self.host_key_line,
            "credential_ref": f"file:{self.client_key_path}",
        }
        fields.update(overrides)
        return DestinationConfig(**fields)

    async def __aenter__(self) -> LocalPartner:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()
