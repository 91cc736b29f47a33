"""Partner test helpers: an evidence recorder, a second party writing at the partner, bounded waits."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from activities.destination import DestinationConfig
from activities.partner_connection import connect

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
