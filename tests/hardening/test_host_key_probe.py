"""A host-key probe after cut connections never turns a transient network error into HostKeyMismatch (matrix FG3).

When a handshake is cut, `connect` asks the server again to tell a server that refuses the pinned key's type (sshd
ends such a handshake by cutting it) from a connection that merely failed. Here a real TCP proxy cuts the first
connections (as sshd's MaxStartups or a flaky link does) in front of a real SFTP server, asyncssh's or OpenSSH's,
that holds a key of the pinned type (ed25519) and an RSA key, the type asyncssh's client prefers when any type is
allowed. Such a server has the pinned type: the cuts are transient, never a host key mismatch. A server that
really lacks the pinned type is still one, with or without a cut before it."""

from __future__ import annotations

import asyncio
import getpass
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import asyncssh
import pytest

from activities.destination import DestinationConfig
from activities.partner_connection import HostKeyMismatch, connect, server_host_key
from starter.localstack import processes
from starter.localstack.ports import free_port, wait_for_port
from tests.helpers.openssh_partner import SSHD, require_sshd
from tests.helpers.partner import bounded
from tests.helpers.tcp_cut import Cut, TcpCutProxy

pytestmark = pytest.mark.spec("FG3")

TIMEOUT = 10.0


class Server:
    """A real SFTP server on 127.0.0.1 with the given host keys: asyncssh's in this process, or OpenSSH's sshd
    (which refuses a handshake allowing no host key type it holds by cutting the connection)."""

    def __init__(self, kind: str, folder: Path, host_keys: list[asyncssh.SSHKey]) -> None:
        self.kind, self.folder, self.host_keys = kind, folder, host_keys
        self.client_key = asyncssh.generate_private_key("ssh-ed25519")
        self.port = 0
        self._acceptor: asyncssh.SSHAcceptor | None = None
        self._process: asyncio.subprocess.Process | None = None

    async def start(self) -> Server:
        self.folder.mkdir(parents=True, exist_ok=True)
        client_key_path = self.folder / "client_key"
        client_key_path.write_bytes(self.client_key.export_private_key())
        client_key_path.chmod(0o600)
        if self.kind == "asyncssh":
            self._acceptor = await asyncssh.listen(
                "127.0.0.1", 0, server_host_keys=self.host_keys, config=[], allow_scp=False,
                authorized_client_keys=asyncssh.import_authorized_keys(self.client_key.export_public_key().decode()),
                sftp_factory=lambda chan: asyncssh.SFTPServer(chan, chroot=str(self.folder).encode()))
            self.port = self._acceptor.get_port()
            return self
        require_sshd()
        self.port = free_port()
        host_key_lines = []
        for i, key in enumerate(self.host_keys):
            path = self.folder / f"host_key_{i}"
            path.write_bytes(key.export_private_key())
            path.chmod(0o600)
            host_key_lines.append(f"HostKey {path}")
        (self.folder / "authorized_keys").write_bytes(self.client_key.export_public_key())
        (self.folder / "authorized_keys").chmod(0o600)
        config = self.folder / "sshd_config"
        config.write_text("\n".join([
            f"Port {self.port}", "ListenAddress 127.0.0.1", *host_key_lines, f"PidFile {self.folder / 'sshd.pid'}",
            f"AuthorizedKeysFile {self.folder / 'authorized_keys'}", "PubkeyAuthentication yes",
            "PasswordAuthentication no", "KbdInteractiveAuthentication no", "StrictModes no",
            "PermitRootLogin prohibit-password", "UsePAM no", "AllowTcpForwarding no", "X11Forwarding no",
            "Subsystem sftp internal-sftp", f"ForceCommand internal-sftp -d {self.folder}", "LogLevel ERROR", "",
        ]))
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)
        self._process = await processes.spawn(SSHD, "-D", "-e", "-f", str(config), log_path=self.folder / "sshd.log")
        await wait_for_port(self.port, timeout=10)
        return self

    async def stop(self) -> None:
        if self._acceptor is not None:
            self._acceptor.close()
            await self._acceptor.wait_closed()
        await processes.stop(self._process)

    def destination(self, pinned: asyncssh.SSHKey, port: int | None = None) -> DestinationConfig:
        return DestinationConfig(
            host="127.0.0.1", port=port or self.port,
            username="partner" if self.kind == "asyncssh" else getpass.getuser(),
            final_dir="/outbound", temp_dir="/incoming-tmp", host_key=pinned.export_public_key().decode().strip(),
            credential_ref=f"file:{self.folder / 'client_key'}")


@pytest.fixture(params=["asyncssh", "openssh"])
async def start_server(request: pytest.FixtureRequest,
                       tmp_path: Path) -> AsyncIterator[Callable[[list[asyncssh.SSHKey]], Awaitable[Server]]]:
    started: list[Server] = []

    async def start(host_keys: list[asyncssh.SSHKey]) -> Server:
        server = Server(request.param, tmp_path / f"server{len(started)}", host_keys)
        started.append(server)
        await bounded(server.start())
        return server

    try:
        yield start
    finally:
        for server in started:
            await bounded(server.stop())


async def connect_once(dest: DestinationConfig) -> BaseException | None:
    """What one connect() through to an SFTP request ends with: None when it got in, else the error."""
    try:
        async with connect(dest, connect_timeout=TIMEOUT) as sftp:
            await sftp.listdir(".")
    except (HostKeyMismatch, asyncssh.Error, OSError) as exc:
        return exc
    return None


@pytest.mark.parametrize("how", ["close", "reset"])
@pytest.mark.parametrize("cut_first", [1, 2])
async def test_cut_connections_to_a_server_with_the_pinned_type_are_never_a_host_key_mismatch(
        start_server: Callable[[list[asyncssh.SSHKey]], Awaitable[Server]], cut_first: int, how: Cut) -> None:
    pinned, rsa = asyncssh.generate_private_key("ssh-ed25519"), asyncssh.generate_private_key("ssh-rsa")
    server = await start_server([pinned, rsa])
    dest = server.destination(pinned)
    # The server holds both types, and asked with any type allowed it answers with RSA, not the pinned type.
    offered = await server_host_key(dest, "default", TIMEOUT)
    assert offered is not None and offered.get_algorithm() == "ssh-rsa"

    async with TcpCutProxy("127.0.0.1", server.port, cut_first=cut_first, how=how) as proxy:
        outcome = await bounded(connect_once(server.destination(pinned, port=proxy.port)))

    # The proxy cut exactly the first `cut_first` connections, the first of them connect's own handshake.
    assert proxy.events[:cut_first] == ["cut"] * cut_first and proxy.cut == cut_first, proxy.events
    assert not isinstance(outcome, HostKeyMismatch), f"{outcome!r} after connections {proxy.events}"
    assert outcome is None or isinstance(outcome, (asyncssh.ConnectionLost, ConnectionResetError)), repr(outcome)
    # It was transient: with nothing cut, the pinned key is presented and the session opens.
    assert await bounded(connect_once(dest)) is None


@pytest.mark.parametrize("cut_first", [0, 1])
async def test_a_server_without_the_pinned_type_is_still_a_host_key_mismatch(
        start_server: Callable[[list[asyncssh.SSHKey]], Awaitable[Server]], cut_first: int) -> None:
    pinned, rsa = asyncssh.generate_private_key("ssh-ed25519"), asyncssh.generate_private_key("ssh-rsa")
    server = await start_server([rsa])
    for _ in range(3):  # sshd's refusal is a cut, a reset or a plain close: each time a mismatch
        async with TcpCutProxy("127.0.0.1", server.port, cut_first=cut_first) as proxy:
            outcome = await bounded(connect_once(server.destination(pinned, port=proxy.port)))
        assert proxy.events[:cut_first] == ["cut"] * cut_first and proxy.cut == cut_first, proxy.events
        assert proxy.passed >= 1, proxy.events  # the server itself was asked
        assert isinstance(outcome, HostKeyMismatch), f"{outcome!r} after connections {proxy.events}"
        assert "has no host key of the pinned type (ssh-ed25519)" in str(outcome)
