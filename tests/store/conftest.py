"""Fixtures of the store tests only."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from tests.helpers.faults import PgFaultProxy, fault_proxy
from tests.helpers.support import seed_tenant


@pytest.fixture
async def tenant(db) -> tuple[uuid.UUID, uuid.UUID]:
    """A seeded tenant and its destination: (tenant ID, destination ID)."""
    return await seed_tenant(db.admin)


@pytest.fixture
async def proxy(db) -> AsyncIterator[PgFaultProxy]:
    """tests/helpers/faults.py's proxy in front of the test's PostgreSQL, for the faults a test injects."""
    async with fault_proxy(db.server) as running:
        yield running
