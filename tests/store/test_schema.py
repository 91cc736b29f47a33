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
    assert await db.admin.fetchval("SELECT version_num FROM alembic_version") == before == "0023"


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


async def test_pods_that_migrate_at_once_all_succeed_and_the_schema_is_migrated_once(pg_server, tmp_path):
    """Each worker pod runs `exports migrate` as an init container, so a first apply or a scale-up migrates from
    several pods at the same moment: one migrates, the others wait for it and find nothing to apply."""
    import asyncio
    import os
    import uuid

    import asyncpg

    from store.db import asyncpg_dsn
    from tests.helpers.support import EXPORTS

    name = f"exports_concurrent_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(asyncpg_dsn(pg_server.url("owner")))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("EXPORTS_")},
           "EXPORTS_OWNER_DATABASE_URL": pg_server.url("owner", name)}
    try:
        await admin.execute(f"CREATE DATABASE {name}")
        pods = [await asyncio.create_subprocess_exec(str(EXPORTS), "migrate", env=env, cwd=tmp_path,
                                                     stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
                for _ in range(4)]
        ends = await asyncio.wait_for(asyncio.gather(*(pod.communicate() for pod in pods)), 120)
        codes = [pod.returncode for pod in pods]
        assert codes == [0, 0, 0, 0], [(code, err.decode()[-600:]) for code, (_, err) in zip(codes, ends, strict=True)]
        db = await asyncpg.connect(asyncpg_dsn(pg_server.url("owner", name)))
        try:
            assert await db.fetchval("SELECT version_num FROM alembic_version") == "0023"
        finally:
            await db.close()
    finally:
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await admin.close()
