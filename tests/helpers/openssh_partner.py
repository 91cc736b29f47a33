"""A partner running OpenSSH's sshd and sftp-server (Debian's openssh-server) on 127.0.0.1, for interoperability.

Its own config, host key and authorized key, in the test's folder. sshd refuses a ChrootDirectory under a
world-writable parent such as /tmp, so `ForceCommand internal-sftp -d` starts each session in the partner's
folder instead; the destination's directories are absolute paths inside it. Stopped by its PID.
"""

from __future__ import annotations

import asyncio
import getpass
import os
import shutil
from pathlib import Path

import asyncssh
import pytest

from activities.destination import DestinationConfig
from starter.localstack import processes
from starter.localstack.ports import free_port, wait_for_port

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def require_sshd() -> None:
    if Path(SSHD).exists():
        return
    if os.environ.get("CI"):
        pytest.fail("sshd is missing in CI: .ci/run installs Debian's openssh-server before the suite")
    pytest.skip("OpenSSH interoperability: install Debian's openssh-server (apt-get install openssh-server) "
                "or run .ci/run, which does")


class OpenSshPartner:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.root = folder / "partner"
        self.port = free_port()
        self.process: asyncio.subprocess.Process | None = None

    async def start(self) -> OpenSshPartner:
        for sub in ("outbound", "incoming-tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        host_key = asyncssh.generate_private_key("ssh-ed25519")
        client_key = asyncssh.generate_private_key("ssh-ed25519")
        self.host_key_line = host_key.export_public_key().decode().strip()
        for name, key in (("host_key", host_key), ("client_key", client_key)):
            path = self.folder / name
            path.write_bytes(key.export_private_key())
            path.chmod(0o600)
        self.client_key_path = self.folder / "client_key"
        (self.folder / "authorized_keys").write_bytes(client_key.export_public_key())
        (self.folder / "authorized_keys").chmod(0o600)
        config = self.folder / "sshd_config"
        config.write_text("\n".join([
            f"Port {self.port}", "ListenAddress 127.0.0.1", f"HostKey {self.folder / 'host_key'}",
            f"PidFile {self.folder / 'sshd.pid'}", f"AuthorizedKeysFile {self.folder / 'authorized_keys'}",
            "PubkeyAuthentication yes", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            # StrictModes refuses key files under /tmp (world-writable); this folder is private to the test.
            "StrictModes no", "PermitRootLogin prohibit-password", "UsePAM no", "AllowTcpForwarding no",
            "X11Forwarding no",
            "Subsystem sftp internal-sftp", f"ForceCommand internal-sftp -d {self.root}", "LogLevel ERROR", "",
        ]))
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege separation directory
        self.process = await processes.spawn(SSHD, "-D", "-e", "-f", str(config),
                                             log_path=self.folder / "sshd.log")
        await wait_for_port(self.port, timeout=10)
        return self

    def destination(self) -> DestinationConfig:
        return DestinationConfig(
            host="127.0.0.1", port=self.port, username=getpass.getuser(), final_dir=str(self.root / "outbound"),
            temp_dir=str(self.root / "incoming-tmp"), host_key=self.host_key_line,
            credential_ref=f"file:{self.client_key_path}")

    async def stop(self) -> None:
        await processes.stop(self.process)
