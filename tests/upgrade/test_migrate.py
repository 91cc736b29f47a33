"""`exports migrate` during a deploy: a migration never queues the workers' statements behind a long transaction."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.support import Ran, exports_command


async def exports(db, *args: str, **overrides: object) -> Ran:
    return await exports_command(db.settings(**overrides), *args, cwd=Path(__file__).parent)


@pytest.mark.spec("UP1")
async def test_migrate__a_lock_held_elsewhere_is_waited_for_a_bound_then_nothing_changed(db):
    """export_jobs held by a long transaction (a row locked FOR UPDATE): the migration that alters the table waits
    its bound, rolls back and says so (exit 3, nothing changed); once the lock is gone, the same command migrates."""
    ran = await exports(db, "migrate", "--to", "0006")
    assert ran.code == 0, ran
    holder = await db.connect("owner")
    try:
        await holder.execute("BEGIN")
        await holder.execute("LOCK TABLE export_jobs IN ROW SHARE MODE")  # what SELECT ... FOR UPDATE holds
        blocked = await exports(db, "migrate", migration_lock_timeout_seconds=1)
    finally:
        await holder.execute("ROLLBACK")
        await holder.close()
    assert blocked.code == 3, blocked
    assert blocked.stderr.count("\n") == 1 and "waited 1 s for a lock" in blocked.stderr, blocked
    assert blocked.seconds < 20, blocked
    assert await db.admin.fetchval("SELECT version_num FROM alembic_version") == "0006"
    ran = await exports(db, "migrate", migration_lock_timeout_seconds=1)
    assert ran.code == 0, ran
    assert await db.admin.fetchval("SELECT version_num FROM alembic_version") == "0020"
