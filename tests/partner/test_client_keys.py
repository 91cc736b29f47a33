"""The client's private key, read for every connection and every look: parsed once while its source is unchanged.

Parsing an RSA private key makes `cryptography` check it, about 110 ms of CPU for 3,072 bits (measured here) on the
worker's event loop, which runs nothing else meanwhile. It was parsed again for each delivery and each look: with an
RSA key, a worker spent some 200 ms of CPU per export on it before anything was sent."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import asyncssh
import pytest

from activities.delivery_connections import DeliveryConnections
from activities.partner_connection import load_client_key
from activities.partner_delivery import deliver
from starter.localstack.partner import LocalPartner
from tests.helpers.partner import Evidence, bounded, make_file


def rsa_key(path: Path) -> asyncssh.SSHKey:
    key = asyncssh.generate_private_key("ssh-rsa", key_size=3072)
    path.write_bytes(key.export_private_key())
    os.chmod(path, 0o600)
    return key


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every private key asyncssh parses from here on, by how it was asked."""
    seen: list[str] = []

    def counted(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def parse(*args: Any, **kwargs: Any) -> Any:
            seen.append(name)
            return real(*args, **kwargs)
        return parse

    for name in ("read_private_key", "import_private_key"):
        monkeypatch.setattr(asyncssh, name, counted(name, getattr(asyncssh, name)))
    return seen


@pytest.fixture
async def rsa_partner(tmp_path: Path) -> AsyncIterator[LocalPartner]:
    """A partner that accepts an RSA client key (its client key file holds one before it starts)."""
    partner = LocalPartner(tmp_path / "partner")
    rsa_key(partner.client_key_path)
    await bounded(partner.start())
    try:
        yield partner
    finally:
        await bounded(partner.stop())


async def test_an_rsa_client_key_is_parsed_once_for_many_deliveries(
        rsa_partner: LocalPartner, parses: list[str], tmp_path: Path) -> None:
    kept = DeliveryConnections(linger_seconds=0.0)  # every delivery connects: each used to parse the key again
    try:
        for n in range(3):
            path = tmp_path / f"f{n}.csv"
            data = make_file(path, 10_000 + n)
            result = await bounded(deliver(rsa_partner.destination(), str(path), f"f{n}.csv", f"f{n}.part",
                                           record_evidence=Evidence(), connections=kept))
            assert result.outcome == "Completed", result.summary
            assert (rsa_partner.final_dir / f"f{n}.csv").read_bytes() == data
    finally:
        await bounded(kept.close())
    assert (kept.opened, len(parses)) == (3, 1), parses


def test_a_key_file_rewritten_is_read_again(tmp_path: Path, parses: list[str]) -> None:
    path = tmp_path / "client_key"
    first = rsa_key(path)
    ref = f"file:{path}"
    assert load_client_key(ref).public_data == first.public_data
    assert load_client_key(ref).public_data == first.public_data
    assert len(parses) == 1
    second = rsa_key(path)  # rotated in place
    assert load_client_key(ref).public_data == second.public_data
    assert len(parses) == 2


def test_a_key_from_the_environment_is_parsed_once_while_its_text_is_unchanged(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, parses: list[str]) -> None:
    first = rsa_key(tmp_path / "a")
    monkeypatch.setenv("EXPORTS_TEST_CLIENT_KEY", first.export_private_key().decode())
    for _ in range(3):
        assert load_client_key("env:EXPORTS_TEST_CLIENT_KEY").public_data == first.public_data
    second = rsa_key(tmp_path / "b")
    monkeypatch.setenv("EXPORTS_TEST_CLIENT_KEY", second.export_private_key().decode())
    assert load_client_key("env:EXPORTS_TEST_CLIENT_KEY").public_data == second.public_data
    assert len(parses) == 2


def test_a_key_file_that_can_no_longer_be_read_is_an_error_even_after_it_was_parsed(tmp_path: Path) -> None:
    path = tmp_path / "client_key"
    rsa_key(path)
    load_client_key(f"file:{path}")
    path.unlink()
    with pytest.raises(OSError):
        load_client_key(f"file:{path}")


def test_a_key_file_under_the_home_directory_is_found_by_tilde(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    """`file:~/...` names a file under the worker's home directory, as asyncssh's own reading of a path does."""
    monkeypatch.setenv("HOME", str(tmp_path))
    key = rsa_key(tmp_path / "id_rsa")
    assert load_client_key("file:~/id_rsa").public_data == key.public_data
