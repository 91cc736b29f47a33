"""The migrations produce exactly the tables, columns and nullability that store/schema.py declares."""

from __future__ import annotations

from store.schema import metadata


async def test_migrations_produce_the_declared_schema(db):
    rows = await db.admin.fetch(
        "SELECT table_name, column_name, is_nullable FROM information_schema.columns "
        "WHERE table_schema = 'public' ORDER BY table_name, ordinal_position")
    actual: dict[str, list[tuple[str, bool]]] = {}
    for r in rows:
        if r["table_name"] != "alembic_version":
            actual.setdefault(r["table_name"], []).append((r["column_name"], r["is_nullable"] == "YES"))
    declared = {name: [(c.name, bool(c.nullable) and not c.primary_key) for c in table.columns]
                for name, table in metadata.tables.items()}
    assert actual == declared


async def test_migrations_are_at_head_and_applying_them_again_changes_nothing(db):
    from store.db import migrate

    before = await db.admin.fetchval("SELECT version_num FROM alembic_version")
    await migrate(db.url("owner"))
    assert await db.admin.fetchval("SELECT version_num FROM alembic_version") == before == "0012"


async def test_a_destination_contract_names_only_known_hash_evidence(db):
    import asyncpg
    import pytest

    from tests.helpers.support import seed_tenant

    _, destination_id = await seed_tenant(db.admin)
    for known in ("none", "read_back", "check_file"):
        await db.admin.execute("UPDATE destinations SET hash_evidence = $1 WHERE id = $2", known, destination_id)
    with pytest.raises(asyncpg.CheckViolationError, match="ck_destinations_hash_evidence"):
        await db.admin.execute("UPDATE destinations SET hash_evidence = 'md5' WHERE id = $1", destination_id)
    assert await db.admin.fetchval("SELECT hash_evidence FROM destinations WHERE id = $1",
                                   destination_id) == "check_file"
