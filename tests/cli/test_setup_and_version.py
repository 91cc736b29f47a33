"""`exports setup` (the search attributes a release sets, registered once per namespace), `exports --version`,
and `exports migrate --to` (a rollback's step: the database to the revision the previous release needs).

Real processes of the installed `exports` command, against a Temporal dev server of each test's own with only the
search attributes the test registers, and a fresh migrated database per test."""

from __future__ import annotations

import asyncio
import tomllib
from pathlib import Path

import pytest
from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest

from starter import preflight
from store.db import head_revision, known_revisions
from store.settings import Settings
from tests.helpers.harness import WorkerProcess
from tests.helpers.namespaces import all_but, namespace_with, worker_settings
from tests.helpers.support import EXPORTS, eventually, exports_command

ROOT = Path(__file__).resolve().parents[2]
BOUND = 60.0
PREVIOUS = known_revisions()[-2]


async def registered(client) -> dict[str, str]:
    listed = await client.operator_service.list_search_attributes(
        ListSearchAttributesRequest(namespace=client.namespace))
    return {name: preflight.kind_name(kind) for name, kind in listed.custom_attributes.items()}


@pytest.mark.spec("UP6")
def test_version_is_the_installed_packages():
    import subprocess

    done = subprocess.run([str(EXPORTS), "--version"], capture_output=True, text=True, timeout=BOUND)
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert (done.returncode, done.stdout, done.stderr) == (0, f"exports {version}\n", ""), done


@pytest.mark.spec("UP4")
async def test_setup_adds_the_missing_search_attribute_then_the_worker_polls_and_a_second_setup_adds_nothing(
        db, tmp_path):
    async with namespace_with(all_but("ExportConfirmedBy")) as env:
        settings = worker_settings(db, env, tmp_path)
        first = await exports_command(settings, "setup", cwd=tmp_path)
        assert first.code == 0 and first.stderr == "", first
        others = ", ".join(f"{name} ({kind})" for name, kind in all_but("ExportConfirmedBy").items())
        assert first.stdout.splitlines() == [
            "added ExportConfirmedBy (Keyword) to namespace default",
            f"already registered on namespace default: {others}",
        ], first
        assert await registered(env.client) == preflight.expected_search_attributes()

        # The worker that refused this namespace before (tests/deploy/test_preflight.py) now starts and polls.
        worker = await WorkerProcess(settings).start()
        try:
            await eventually(lambda: asyncio.sleep(0, worker.log_path.read_text()), lambda text: "polling" in text,
                             timeout=BOUND, interval=0.2, what="the worker polling")
            assert worker.process.returncode is None
        finally:
            await worker.stop()
        assert "preflight" not in worker.log_path.read_text()

        second = await exports_command(settings, "setup", cwd=tmp_path)
        assert second.code == 0 and second.stderr == "", second
        everything = ", ".join(f"{name} ({kind})" for name, kind in preflight.expected_search_attributes().items())
        assert second.stdout.splitlines() == [
            f"nothing to add, already registered on namespace default: {everything}"], second


@pytest.mark.spec("UP4")
async def test_setup_adds_what_is_missing_and_refuses_an_attribute_of_another_type_in_one_line(db, tmp_path):
    async with namespace_with(all_but("DeliveryKey", ExportAttempts="Keyword")) as env:
        ran = await exports_command(worker_settings(db, env, tmp_path), "setup", cwd=tmp_path)
        assert ran.code == 4, ran
        assert "added DeliveryKey (Keyword) to namespace default" in ran.stdout.splitlines(), ran
        lines = ran.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("refused: Temporal namespace default has the search "
                                                       "attribute ExportAttempts as Keyword"), ran
        assert (await registered(env.client))["ExportAttempts"] == "Keyword"  # never changed behind one's back


async def test_migrate_to_the_previous_revision_and_back(db, tmp_path):
    settings = db.settings()

    async def head_migration_in_place() -> bool:
        """Whether the head's migration is in place (0023: the rename fence's rule asks for the holder's evidence)."""
        return "with the evidence of the attempt" in await db.admin.fetchval(
            "SELECT pg_get_functiondef('exports_job_change_has_its_event'::regproc)")

    down = await exports_command(settings, "migrate", "--to", PREVIOUS, cwd=tmp_path)
    assert down.code == 0 and f"at {PREVIOUS} (was {head_revision()})" in down.stdout, down
    assert await db.admin.fetchval("SELECT version_num FROM alembic_version") == PREVIOUS
    assert not await head_migration_in_place()  # the head's migration, undone

    up = await exports_command(settings, "migrate", "--to", head_revision(), cwd=tmp_path)
    assert up.code == 0 and f"at {head_revision()} (was {PREVIOUS})" in up.stdout, up
    assert await db.admin.fetchval("SELECT version_num FROM alembic_version") == head_revision()
    assert await head_migration_in_place()
    # The worker's checks pass again, grants included.
    assert await preflight.check_database(settings) == preflight.DatabaseCheck([])

    again = await exports_command(settings, "migrate", cwd=tmp_path)
    assert again.code == 0 and f"already at {head_revision()}" in again.stdout, again


async def test_migrate_to_an_unknown_revision_or_from_a_newer_one_is_one_line_and_changes_nothing(db, tmp_path):
    settings = db.settings()
    unknown = await exports_command(settings, "migrate", "--to", "0099", cwd=tmp_path)
    assert unknown.code == 2 and unknown.stdout == "", unknown
    assert unknown.stderr.splitlines() == [
        f"error: unknown revision '0099': this release knows {', '.join(known_revisions())} (or head)"], unknown
    assert await db.admin.fetchval("SELECT version_num FROM alembic_version") == head_revision()

    await db.admin.execute("UPDATE alembic_version SET version_num = '0099'")  # as a newer release leaves it
    newer = await exports_command(settings, "migrate", "--to", PREVIOUS, cwd=tmp_path)
    assert newer.code == 2 and len(newer.stderr.splitlines()) == 1, newer
    assert "database at revision 0099, which this release does not know" in newer.stderr, newer
    assert await db.admin.fetchval("SELECT version_num FROM alembic_version") == "0099"
    assert await db.admin.fetchval("SELECT count(*) FROM information_schema.columns WHERE "
                                   "table_name = 'export_jobs' AND column_name = 'final_name'") == 1


async def test_migrate_sql_writes_a_downgrade_that_applies(db, tmp_path):
    printed = await exports_command(Settings(_env_file=None), "migrate", "--sql", "--from", head_revision(), "--to",
                            PREVIOUS, cwd=tmp_path)
    assert printed.code == 0, printed
    assert f"Running downgrade {head_revision()} -> {PREVIOUS}" in printed.stdout, printed
    # The session's preamble (the migration lock, the lock bound), then one transaction.
    preamble, begin, _ = printed.stdout.partition("\nBEGIN;\n")
    assert begin and "pg_advisory_lock" in preamble and "SET lock_timeout" in preamble, printed
    assert printed.stdout.count("BEGIN;") == 1 and printed.stdout.rstrip().endswith("COMMIT;"), printed
    applying = await db.connect("owner")  # a session of its own, as psql's: the lock and the bound end with it
    try:
        await applying.execute(printed.stdout)
    finally:
        await applying.close()
    assert await db.admin.fetchval("SELECT version_num FROM alembic_version") == PREVIOUS
    # The read the worker's preflight needs, granted inside the script as the online migration grants it.
    assert await db.admin.fetchval("SELECT has_table_privilege('exports_app', 'alembic_version', 'SELECT')")
