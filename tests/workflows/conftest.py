"""Fixtures of the workflow tests only."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.helpers.crash import crash_world
from tests.helpers.harness import Harness


@pytest.fixture
async def crash_harness(db, store, client, tmp_path) -> AsyncIterator[Harness]:
    """A tenant and a partner with the crash tests' short lease, and no in-process export worker: the test starts
    (and kills) worker processes."""
    async with crash_world(db, store, client, tmp_path) as h:
        yield h
