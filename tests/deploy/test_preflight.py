"""Case UP4: what a release needs of Temporal and the database is checked when a worker starts, before it polls.
Each missing piece is one line naming it and the command that adds it, and the worker exits with status 2
having taken no task.

Real components: worker processes (`python -m worker`, `exports worker`), a Temporal dev server of each test's own
with only the search attributes the test registers (the session's server has them all), and a fresh migrated
database per test, changed as an upgrade would find it (a revision behind, a newer one, a revoked grant)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.service import RPCError, RPCStatusCode

from activities.contracts import ExportInput
from starter import preflight
from store.db import head_revision, known_revisions
from store.settings import Settings
from tests.helpers.faults import fault_proxy
from tests.helpers.harness import WorkerProcess
from tests.helpers.namespaces import all_but, namespace_with, worker_settings
from tests.helpers.support import create_job, eventually, exports_command, seed_tenant
from workflows.identity import export_workflow_id

ROOT = Path(__file__).resolve().parents[2]
# A worker that refuses to start does so within seconds of its start; the bound only catches one that polls.
EXIT_BOUND = 60.0
PREVIOUS = known_revisions()[-2]


async def worker_exit(settings: Settings) -> tuple[int | None, str]:
    """`python -m worker` run to its end; its exit status and its log. Stopped by its PID whatever happens."""
    worker = await WorkerProcess(settings).start()
    try:
        try:
            code = await asyncio.wait_for(worker.process.wait(), EXIT_BOUND)
        except TimeoutError:
            raise AssertionError(f"the worker did not exit within {EXIT_BOUND} s:\n"
                                 f"{worker.log_path.read_text()[-3000:]}") from None
    finally:
        await worker.stop()
    return code, worker.log_path.read_text()


def problem_lines(log: str) -> list[str]:
    """The preflight's problem lines (not its closing line)."""
    return [line for line in log.splitlines() if "preflight: " in line and "problem(s) above" not in line]


@pytest.mark.spec("UP4")
async def test_a_worker_on_a_namespace_lacking_a_search_attribute_says_how_to_add_it_and_takes_no_task(
        db, store, tmp_path):
    async with namespace_with(all_but("ExportConfirmedBy")) as env:
        settings = worker_settings(db, env, tmp_path)
        tenant_id, destination_id = await seed_tenant(db.admin)
        # An export as the dispatcher would have started it: its row Queued and its workflow waiting on the queue.
        job_id = await create_job(store, tenant_id, destination_id)
        handle = await env.client.start_workflow("ExportWorkflow", ExportInput(job_id=job_id),
                                                 id=export_workflow_id(job_id), task_queue=settings.task_queue)

        code, log = await worker_exit(settings)

        assert code == 2, log
        lines = problem_lines(log)
        assert len(lines) == 1, log
        assert "ExportConfirmedBy" in lines[0] and "Traceback" not in log, log
        assert ("`temporal operator search-attribute create --namespace default --name ExportConfirmedBy "
                "--type Keyword`") in lines[0], lines[0]
        assert "tcld namespace search-attributes add --namespace default --search-attribute ExportConfirmedBy=" \
               "Keyword" in lines[0] and "exports setup" in lines[0], lines[0]
        assert "polling" not in log, log
        # No task taken: the workflow task was never started, the row never claimed, the wake-up never sent.
        events = (await handle.fetch_history()).events
        assert not [e for e in events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED], events
        row = await db.admin.fetchrow("SELECT status, attempt_count FROM export_jobs WHERE id = $1", job_id)
        assert (row["status"], row["attempt_count"]) == ("Queued", 0)
        assert await db.admin.fetchval("SELECT published_at FROM outbox WHERE job_id = $1", job_id) is None
        await handle.terminate("test over")


@pytest.mark.spec("UP4")
async def test_a_search_attribute_of_another_type_is_named_with_the_type_found(db, tmp_path):
    async with namespace_with(all_but("", ExportAttempts="Keyword")) as env:
        code, log = await worker_exit(worker_settings(db, env, tmp_path))
    assert code == 2, log
    lines = problem_lines(log)
    assert len(lines) == 1 and "ExportAttempts as Keyword, this release sets it as Int" in lines[0], log


@pytest.mark.spec("UP4")
async def test_a_database_a_revision_behind_is_named_with_both_revisions_through_exports_worker(
        db, client, tmp_path):
    settings = db.settings(temporal_address=client.service_client.config.target_host,
                           task_queue=f"up4-{uuid.uuid4().hex[:8]}", work_dir=tmp_path / "work")
    down = await exports_command(settings, "migrate", "--to", PREVIOUS, cwd=tmp_path,
                             bound=60)
    assert down.code == 0, down
    assert await db.admin.fetchval("SELECT version_num FROM alembic_version") == PREVIOUS

    ran = await exports_command(settings, "worker", cwd=tmp_path, bound=EXIT_BOUND)

    assert ran.code == 2, ran
    lines = problem_lines(ran.stderr)
    assert lines and lines[0].endswith(f"database at revision {PREVIOUS}, this worker needs {head_revision()}: "
                                       f"run `exports migrate` as the owner (EXPORTS_OWNER_DATABASE_URL)"), ran
    assert len(lines) == 1 and "polling" not in ran.stderr, ran


@pytest.mark.spec("UP4")
async def test_a_database_at_a_revision_this_release_does_not_know_points_at_the_newer_release(db, client,
                                                                                             tmp_path):
    await db.admin.execute("UPDATE alembic_version SET version_num = '0099'")
    settings = db.settings(temporal_address=client.service_client.config.target_host,
                           task_queue=f"up4-{uuid.uuid4().hex[:8]}", work_dir=tmp_path / "work")
    code, log = await worker_exit(settings)
    assert code == 2, log
    lines = problem_lines(log)
    head = head_revision()
    assert len(lines) == 1 and lines[0].endswith(
        f"database at revision 0099, which this release does not know (newer than {head}): run the newer "
        f"release's worker, or roll the database back with the newer release's `exports migrate --to {head}`"), log


@pytest.mark.spec("UP4")
async def test_a_revoked_grant_is_named_with_role_table_and_privilege_and_exports_migrate_restores_it(
        db, client, tmp_path):
    await db.admin.execute("REVOKE INSERT ON export_attempt_events FROM exports_app")
    await db.admin.execute("REVOKE UPDATE (published_at) ON outbox FROM exports_dispatcher")
    settings = db.settings(temporal_address=client.service_client.config.target_host,
                           task_queue=f"up4-{uuid.uuid4().hex[:8]}", work_dir=tmp_path / "work")
    code, log = await worker_exit(settings)
    assert code == 2, log
    lines = sorted(line.split("preflight: ", 1)[1] for line in problem_lines(log))
    fix = "run `exports migrate` as the owner (it grants them)"
    assert lines == [
        f"database role exports_app (EXPORTS_DATABASE_URL) lacks INSERT on export_attempt_events: {fix}",
        f"database role exports_dispatcher (EXPORTS_DISPATCHER_DATABASE_URL) lacks UPDATE on outbox (columns "
        f"published_at): {fix}",
    ], log

    migrated = await exports_command(settings, "migrate", cwd=tmp_path, bound=60)
    assert migrated.code == 0, migrated
    assert await preflight.check_database(settings) == preflight.DatabaseCheck([])


@pytest.mark.spec("UP4")
async def test_a_worker_started_while_postgresql_is_away_checks_the_database_once_it_answers(
        db, client, tmp_path):
    """Unreachable is not a problem of the deployment (OU2): the worker starts, and the database checks run as
    soon as PostgreSQL answers; here they find the schema a revision behind, and the worker stops with status 2."""
    await db.admin.execute(f"UPDATE alembic_version SET version_num = '{PREVIOUS}'")
    async with fault_proxy(db.server) as pg:
        pg.refuse_new_connections()
        settings = db.settings(temporal_address=client.service_client.config.target_host,
                               task_queue=f"up4-{uuid.uuid4().hex[:8]}", work_dir=tmp_path / "work",
                               database_url=pg.url("exports_app", db.name))
        worker = await WorkerProcess(settings).start()
        try:
            await eventually(lambda: asyncio.sleep(0, worker.log_path.read_text()), lambda text: "polling" in text,
                             timeout=EXIT_BOUND, interval=0.2, what="the worker polling while PostgreSQL is away")
            assert worker.process.returncode is None
            assert "the schema and grant checks run once it answers" in worker.log_path.read_text()
            pg.accept_new_connections()
            code = await asyncio.wait_for(worker.process.wait(), EXIT_BOUND)
        finally:
            await worker.stop()
    log = worker.log_path.read_text()
    assert code == 2, log
    assert [line.split("preflight: ", 1)[1] for line in problem_lines(log) if "database at" in line] == [
        f"database at revision {PREVIOUS}, this worker needs {head_revision()}: run `exports migrate` as the owner "
        f"(EXPORTS_OWNER_DATABASE_URL)"], log
    assert "Traceback" not in log, log


async def test_the_privileges_checked_are_those_a_migrated_database_grants_the_worker_roles(db):
    """The list in starter/preflight.py against the catalog of a database migrated to the head: a migration that
    grants or revokes something for these roles fails here until the list says the same."""
    granted: set[tuple[str, str, str, str]] = set()
    for row in await db.admin.fetch("""
            SELECT r.rolname, c.relname, '' AS col, a.privilege_type
            FROM pg_class c, aclexplode(c.relacl) a JOIN pg_roles r ON r.oid = a.grantee
            WHERE c.relnamespace = 'public'::regnamespace AND r.rolname IN ('exports_app', 'exports_dispatcher')
            UNION ALL
            SELECT r.rolname, c.relname, att.attname, a.privilege_type
            FROM pg_attribute att JOIN pg_class c ON c.oid = att.attrelid, aclexplode(att.attacl) a
                 JOIN pg_roles r ON r.oid = a.grantee
            WHERE c.relnamespace = 'public'::regnamespace AND r.rolname IN ('exports_app', 'exports_dispatcher')"""):
        granted.add(tuple(row))
    # Granted by `exports migrate` itself, for the preflight to read the revision: not a privilege of the work.
    granted.discard(("exports_app", "alembic_version", "", "SELECT"))
    listed = {(role.name, grant.table, column, grant.privilege) for role in preflight.worker_roles()
              for grant in role.grants for column in (grant.columns or ("",))}
    assert listed == granted
    # And a database at the head passes every check, as each role.
    settings = db.settings()
    assert await preflight.check_database(settings) == preflight.DatabaseCheck([])


@pytest.mark.spec("UP4")
async def test_without_the_listing_a_visibility_query_tells_missing_and_mistyped_attributes(tmp_path):
    """Where the operator service's listing is refused (some Temporal Cloud API keys), the check asks the
    visibility store instead: the real server's answers, as the preflight reads them."""
    async with namespace_with(all_but("ExportConfirmedBy", ExportAttempts="Keyword")) as env:
        refused = RPCError("listing refused", RPCStatusCode.PERMISSION_DENIED, b"")
        found = await preflight._queried(env.client, preflight.expected_search_attributes(), refused)
    assert found == {"ExportStatus": "Keyword", "ExportTenant": "Keyword", "DeliveryKey": "Keyword",
                     "ExportAttempts": "Keyword", "ExportConfirmedBy": None}


@pytest.mark.spec("UP4")
async def test_a_role_whose_database_does_not_answer_waits_while_the_others_are_checked_now(db):
    """The dispatcher's PostgreSQL away does not defer the application role's checks (its steps could commit)."""
    await db.admin.execute("REVOKE SELECT ON contacts FROM exports_app")
    async with fault_proxy(db.server) as pg:
        pg.refuse_new_connections()
        settings = db.settings(dispatcher_database_url=pg.url("exports_dispatcher", db.name))
        checked = await preflight.check_database(settings)
        assert [line.split(": run", 1)[0] for line in checked.problems] == [
            "database role exports_app (EXPORTS_DATABASE_URL) lacks SELECT on contacts"], checked
        await db.admin.execute("GRANT SELECT ON contacts TO exports_app")
        checked = await preflight.check_database(settings)
        assert checked.problems == [] and [role.name for role in checked.waiting] == ["exports_dispatcher"], checked
        pg.accept_new_connections()
        assert await preflight.check_database(settings, checked.waiting) == preflight.DatabaseCheck([])


@pytest.mark.spec("UP4")
@pytest.mark.parametrize("how", ["the owner's URL", "exports_app BYPASSRLS"])
async def test_a_worker_whose_application_login_passes_every_rule_is_refused_with_one_line(db, how):
    """The grants' check accepts any login that holds at least the role's privileges: the tables' owner (exempt
    from the transition rules) or exports_app given BYPASSRLS after roles.sql (past the event-kind policies) started
    a worker that the database enforced nothing on (found by review)."""
    if how == "the owner's URL":
        settings = db.settings(database_url=db.url("owner"))
    else:
        settings = db.settings()
        await db.admin.execute("ALTER ROLE exports_app BYPASSRLS")
    try:
        checked = await preflight.check_database(settings)
    finally:
        await db.admin.execute("ALTER ROLE exports_app NOBYPASSRLS")
    assert len(checked.problems) == 1, checked
    line = checked.problems[0]
    assert "(EXPORTS_DATABASE_URL)" in line and "the database's rules would not hold for it" in line, line
    assert ("owns the tables" if how == "the owner's URL" else "has BYPASSRLS") in line, line
