"""Fixtures of the partner tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.helpers.openssh_partner import OpenSshPartner, require_sshd


@pytest.fixture
async def openssh(tmp_path: Path) -> AsyncIterator[OpenSshPartner]:
    """A partner served by OpenSSH's own sshd and sftp-server (skipped where sshd is missing)."""
    require_sshd()
    server = await OpenSshPartner(tmp_path / "openssh").start()
    try:
        yield server
    finally:
        await server.stop()
