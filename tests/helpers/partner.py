"""Partner test helpers: an evidence recorder, a second party writing at the partner, bounded waits, and what the
local partner holds."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path
from typing import Any

from activities.destination import DestinationConfig
from activities.partner_connection import connect
from starter.localstack.partner import LocalPartner

WAIT_SECONDS = 30.0


async def bounded(awaitable: Any, seconds: float = WAIT_SECONDS) -> Any:
    """Every wait in these tests ends: a hang fails the test instead of stalling the run."""
    return await asyncio.wait_for(awaitable, seconds)


class Evidence:
    """Stands in for the database: keeps records in the order they were appended."""

    def __init__(self, fail: bool = False) -> None:
        self.records: list[dict[str, Any]] = []
        self.fail = fail

    async def __call__(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self.fail:
            raise RuntimeError("database unavailable")

    @property
    def steps(self) -> list[str]:
        return [r["step"] for r in self.records]

    def first(self, step: str) -> dict[str, Any]:
        return next(r for r in self.records if r["step"] == step)


async def write_as_other_party(dest: DestinationConfig, path: str, data: bytes) -> None:
    """Another client of the partner writes a file, over its own real connection."""
    async with connect(dest) as sftp:
        async with sftp.open(path, "wb") as f:
            await f.write(data)


def make_file(path: Path, size: int) -> bytes:
    data = os.urandom(size)
    path.write_bytes(data)
    return data


# --- what a LocalPartner holds ------------------------------------------------------------------------------


def outbound(partner: LocalPartner) -> Path:
    return partner.root / "outbound"


def outbound_names(partner: LocalPartner) -> list[str]:
    return sorted(p.name for p in outbound(partner).iterdir())


def temp_names(partner: LocalPartner) -> list[str]:
    """What is left in the partner's temporary directory."""
    return sorted(p.name for p in (partner.root / "incoming-tmp").iterdir())


def assert_partner_holds(partner: LocalPartner, row, *, only: bool = False) -> None:
    """The partner holds the row's final file with the row's size and sha256, and no temporary file; with `only`,
    no other final file either."""
    if only:
        assert outbound_names(partner) == [row.final_name]
    data = (outbound(partner) / row.final_name).read_bytes()
    assert (len(data), hashlib.sha256(data).digest()) == (row.expected_file_bytes, row.expected_file_sha256)
    assert temp_names(partner) == []
