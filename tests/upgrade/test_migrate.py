"""`exports migrate` during a deploy: a migration never queues the workers' statements behind a long transaction."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import asyncpg
import pytest

from starter.localstack.postgres import LocalPostgres
from store.db import asyncpg_dsn, migration_sql
from tests.helpers.faults import fault_proxy
from tests.helpers.support import Ran, create_job, eventually, exports_command, seed_tenant


async def exports(db, *args: str, **overrides: object) -> Ran:
    return await exports_command(db.settings(**overrides), *args, cwd=Path(__file__).parent)


@asynccontextmanager
async def held(db, table: str, mode: str) -> AsyncIterator[None]:
    """`table` locked in `mode` by another session's open transaction (a long transaction, a create in flight)."""
    holder = await db.connect("owner")
    try:
        await holder.execute("BEGIN")
        await holder.execute(f"LOCK TABLE {table} IN {mode} MODE")
        yield
    finally:
        await holder.execute("ROLLBACK")
        await holder.close()


async def applied_with_psql(db, script: str) -> tuple[int | None, bytes]:
    """The script applied as a DBA would, with psql stopping at the first error: its exit status and stderr."""
    dsn = asyncpg_dsn(db.url("owner")).replace("postgresql+asyncpg://", "postgresql://")
    psql = await asyncio.create_subprocess_exec(
        str(LocalPostgres.program("psql")), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", dsn, "-f", "-",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PGCONNECT_TIMEOUT": "10"})
    try:
        _, stderr = await asyncio.wait_for(psql.communicate(script.encode()), 30)
    finally:
        if psql.returncode is None:
            psql.kill()
            await psql.wait()
    return psql.returncode, stderr


@pytest.mark.spec("UP1")
async def test_migrate__a_lock_held_elsewhere_is_waited_for_a_bound_then_nothing_changed(db):
    """export_jobs held by a long transaction (a row locked FOR UPDATE): the migration that alters the table waits
    its bound, rolls back and says so (exit 3, nothing changed); once the lock is gone, the same command migrates."""
    ran = await exports(db, "migrate", "--to", "0006")
    assert ran.code == 0, ran
    async with held(db, "export_jobs", "ROW SHARE"):  # what SELECT ... FOR UPDATE holds
        blocked = await exports(db, "migrate", migration_lock_timeout_seconds=1)
    assert blocked.code == 3, blocked
    assert blocked.stderr.count("\n") == 1 and "waited 1 s for a lock" in blocked.stderr, blocked
    assert blocked.seconds < 20, blocked
    assert await db.admin.fetchval("SELECT version_num FROM alembic_version") == "0006"
    ran = await exports(db, "migrate", migration_lock_timeout_seconds=1)
    assert ran.code == 0, ran
    assert await db.admin.fetchval("SELECT version_num FROM alembic_version") == "0023"


async def _waits_for_the_outbox(db) -> bool:
    return bool(await db.admin.fetchval(
        "SELECT count(*) FROM pg_locks WHERE relation = 'outbox'::regclass AND NOT granted"))


@pytest.mark.spec("UP1")
async def test_an_upgrade_holds_each_tables_lock_only_while_its_own_migration_runs(db, store):
    """From 0007, 0010 and later alter export_jobs (ACCESS EXCLUSIVE) and 0019 indexes the outbox. Run in one
    transaction, those locks were held to the end: while 0019 waited for an insert into the outbox, nobody could
    read export_jobs (`exports show`, the reconciler, a client's start). Each migration commits on its own now,
    so export_jobs is readable while 0019 waits, and the waiting shows the revision already reached."""
    tenant, destination = await seed_tenant(db.admin)
    job = await create_job(store, tenant, destination)
    down = await exports(db, "migrate", "--to", "0007")
    assert down.code == 0, down
    reader = await asyncpg.connect(db.url("app").replace("postgresql+asyncpg://", "postgresql://"))
    try:
        async with held(db, "outbox", "ROW EXCLUSIVE"):  # a create in flight: it has inserted, not committed
            migrating = asyncio.create_task(exports(db, "migrate", migration_lock_timeout_seconds=20))
            await eventually(lambda: _waits_for_the_outbox(db), bool, timeout=20, what="0019 waiting for the outbox")
            await reader.execute("SET statement_timeout = '1s'")
            status = await reader.fetchval("SELECT status FROM export_jobs WHERE id = $1", job)
            reached = await reader.fetchval("SELECT version_num FROM alembic_version")
    finally:
        await reader.close()
    ran = await migrating
    assert (status, reached) == ("Queued", "0018")
    assert ran.code == 0, ran
    assert await db.admin.fetchval("SELECT version_num FROM alembic_version") == "0023"


@pytest.mark.spec("UP1")
async def test_an_upgrade_that_gives_up_on_a_lock_keeps_the_migrations_before_it_and_says_where_it_stopped(db):
    """A lock not had within the bound rolls back only the migration that waited for it; the line says which
    revision the database is at, and the same command then goes on from there."""
    down = await exports(db, "migrate", "--to", "0007")
    assert down.code == 0, down
    async with held(db, "outbox", "ROW EXCLUSIVE"):
        blocked = await exports(db, "migrate", migration_lock_timeout_seconds=1)
    assert blocked.code == 3, blocked
    assert blocked.stderr.count("\n") == 1 and "waited 1 s for a lock" in blocked.stderr, blocked
    assert "at revision 0018 (from 0007)" in blocked.stderr, blocked
    assert await db.admin.fetchval("SELECT version_num FROM alembic_version") == "0018"
    ran = await exports(db, "migrate")
    assert ran.code == 0, ran
    assert await db.admin.fetchval("SELECT version_num FROM alembic_version") == "0023"


@pytest.mark.spec("UP3")
async def test_a_downgrade_that_one_migration_refuses_changes_nothing(db):
    """A rollback is all or nothing: 0003's downgrade refuses while a destination relies on check_file, and the
    downgrades of 0023 to 0004 before it are rolled back with it, so the database stays at a revision the
    running release knows."""
    _, destination = await seed_tenant(db.admin)
    await db.admin.execute("UPDATE destinations SET hash_evidence = 'check_file' WHERE id = $1", destination)
    refused = await exports(db, "migrate", "--to", "0002")
    assert refused.code != 0, refused
    assert "ck_destinations_hash_evidence" in refused.stderr, refused
    assert await db.admin.fetchval("SELECT version_num FROM alembic_version") == "0023"
    assert await db.admin.fetchval("SELECT to_regclass('partner_session_waits') IS NOT NULL")


async def revision(db) -> str:
    return await db.admin.fetchval("SELECT version_num FROM alembic_version")


@pytest.mark.spec("UP1")
async def test_a_migration_that_fails_on_a_statement_says_which_revision_the_database_is_at(db):
    """0019 fails on a statement (its index is there already: a DBA built it CONCURRENTLY ahead of the upgrade, to
    spare the outbox 0019's SHARE lock). 0008 to 0018 are committed and kept, and the one line says so; it used
    to say only "refused by PostgreSQL", as if nothing had changed (found by review)."""
    down = await exports(db, "migrate", "--to", "0007")
    assert down.code == 0, down
    await db.admin.execute(
        "CREATE INDEX CONCURRENTLY ix_outbox_unpublished_job ON outbox (job_id) WHERE published_at IS NULL")
    failed = await exports(db, "migrate")
    assert failed.code == 4, failed
    assert await revision(db) == "0018"
    assert failed.stderr.count("\n") == 1, failed
    assert failed.stderr.startswith("refused: the migration to 0019 failed and rolled back"), failed
    assert "already exists" in failed.stderr and "at revision 0018 (from 0007)" in failed.stderr, failed
    await db.admin.execute("DROP INDEX ix_outbox_unpublished_job")
    ran = await exports(db, "migrate")
    assert ran.code == 0 and await revision(db) == "0023", ran


@pytest.mark.spec("UP1")
async def test_a_migration_whose_connection_is_lost_midway_says_the_revision_reached(db, pg_server):
    """The connection is cut while 0019 waits for the outbox, 0008 to 0018 committed: the line names 0018, and
    does not send the operator to read an export, as the client commands' line for a lost connection does
    (found by review)."""
    down = await exports(db, "migrate", "--to", "0007")
    assert down.code == 0, down
    async with fault_proxy(pg_server) as proxy, held(db, "outbox", "ROW EXCLUSIVE"):
        migrating = asyncio.create_task(exports(
            db, "migrate", migration_lock_timeout_seconds=30, owner_database_url=proxy.url("postgres", db.name)))
        await eventually(lambda: _waits_for_the_outbox(db), bool, timeout=30, what="0019 waiting for the outbox")
        proxy.cut_all()
        ran = await asyncio.wait_for(migrating, 60)
    assert ran.code == 5, ran
    assert ran.stderr.startswith("unreachable: the connection to PostgreSQL was lost during the migration to 0019"), ran
    assert "at revision 0018 (from 0007)" in ran.stderr and "exports show" not in ran.stderr, ran
    # The server ends the cut session once 0019's statement returns: its transaction rolls back, 0018 stays.
    await eventually(lambda: revision(db), lambda r: r == "0018", timeout=30, what="the database at 0018")


@pytest.mark.spec("UP1")
async def test_the_printed_upgrade_bounds_its_lock_waits_as_exports_migrate_does(db):
    """Applied with psql while a transaction holds a row of export_jobs (what SELECT ... FOR UPDATE holds), the
    printed script's ALTER TABLE of 0010 waited for good, and every reader of export_jobs queued behind it. It now
    sets the same bound as `exports migrate` and stops there, keeping 0009 (found by review)."""
    down = await exports(db, "migrate", "--to", "0009")
    assert down.code == 0, down
    script = migration_sql("0009", lock_timeout_seconds=1)
    async with held(db, "export_jobs", "ROW SHARE"):
        code, stderr = await applied_with_psql(db, script)
    assert code == 3 and b"lock timeout" in stderr, (code, stderr)
    assert await revision(db) == "0009"


@pytest.mark.spec("UP1")
async def test_a_migration_that_cannot_read_the_revision_in_time_says_not_done_nothing_changed(db):
    """The revision's own read waits for a lock too (a DBA's transaction on alembic_version): past the bound it is
    the same one line as any lock not had in time, not PostgreSQL's raw error (found by review)."""
    async with held(db, "alembic_version", "ACCESS EXCLUSIVE"):
        blocked = await exports(db, "migrate", migration_lock_timeout_seconds=1)
    assert blocked.code == 3, blocked
    assert blocked.stderr.count("\n") == 1 and "waited 1 s for a lock" in blocked.stderr, blocked
    assert "nothing changed" in blocked.stderr, blocked


@pytest.mark.spec("UP1")
async def test_a_printed_script_applied_to_a_database_at_another_revision_changes_nothing(db):
    """Printed --from 0017 and applied where the database is at 0015 (a DBA's slip): it applied 0018 to 0020 onto
    0015's schema, its revision updates matched nothing, and the database was left at 0015 with later objects in
    it, which the next `exports migrate` then collided with. It now checks the revision first and stops."""
    down = await exports(db, "migrate", "--to", "0015")
    assert down.code == 0, down
    script = migration_sql("0017")
    code, stderr = await applied_with_psql(db, script)
    assert code == 3, (code, stderr)
    assert b"the database is at revision 0015, and this script was printed for 0017" in stderr, stderr
    assert await revision(db) == "0015"
    assert not await db.admin.fetchval("SELECT to_regclass('partner_session_waits') IS NOT NULL")
    ran = await exports(db, "migrate")
    assert ran.code == 0, ran
