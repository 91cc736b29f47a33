"""A tenant's destinations, as the owner role writes them (`exports destinations add` and `update`). The
application role only reads them (JobStore.read_destinations)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import insert, select, update

from store.schema import destinations
from store.statements import RoleStore


class DestinationNotFound(LookupError):
    """No such destination for this tenant (another tenant's looks the same)."""


class Destinations(RoleStore):
    """The owner role's writes. `check` is the caller's rule for a row as it will stand; it runs before the
    write, inside the transaction, and refuses by raising."""

    async def add(self, tenant_id: uuid.UUID, fields: Mapping[str, Any],
                  check: Callable[[Mapping[str, Any]], None]) -> uuid.UUID:
        check(fields)
        destination_id = uuid.uuid4()
        async with self.db.transaction() as conn:
            await conn.execute(insert(destinations).values(id=destination_id, tenant_id=tenant_id, **fields))
        return destination_id

    async def update(self, tenant_id: uuid.UUID, destination_id: uuid.UUID, changes: Mapping[str, Any],
                     check: Callable[[Mapping[str, Any]], None]) -> dict[str, Any]:
        """The row locked from the read to the write, so a concurrent update cannot slip an unchecked
        combination in. Returns the row as it now stands."""
        where = (destinations.c.tenant_id == tenant_id, destinations.c.id == destination_id)
        async with self.db.transaction() as conn:
            row = (await conn.execute(select(destinations).where(*where).with_for_update())).mappings().first()
            if row is None:
                raise DestinationNotFound(f"destination {destination_id} not found for tenant {tenant_id}")
            merged = {**row, **changes}
            check(merged)
            await conn.execute(update(destinations).where(*where).values(**changes))
        return merged
