"""Fixtures of the store tests only."""

from __future__ import annotations

import uuid

import pytest

from tests.helpers.support import seed_tenant


@pytest.fixture
async def tenant(db) -> tuple[uuid.UUID, uuid.UUID]:
    """A seeded tenant and its destination: (tenant ID, destination ID)."""
    return await seed_tenant(db.admin)
