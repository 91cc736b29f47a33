"""Bad input gets a clear error and changes nothing (found by review): another tenant's export looks like none, a
request that asks for nothing is bad input, an empty revision is no revision, and a host is a host."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from typer.testing import CliRunner

from starter import cli
from store.db import head_revision, known_revisions
from store.models import FailureCode, Status
from store.settings import get_settings
from tests.helpers.store_states import drive
from tests.helpers.support import create_job, exports_command, seed_tenant

TABLES = ("export_jobs", "deliveries", "outbox", "cancellation_requests", "export_attempt_events", "destinations")


def _invoke(env: dict[str, str], *args: str):
    get_settings.cache_clear()
    try:
        return CliRunner().invoke(cli.app, list(args), env=env)
    finally:
        get_settings.cache_clear()


async def run(env: dict[str, str], *args: str):
    """The root `exports` command object, in a thread (it runs its own event loop)."""
    return await asyncio.to_thread(_invoke, env, *args)


def environment(db, temporal_env=None) -> dict[str, str]:
    env = {f"EXPORTS_{k.upper()}": v for k, v in db.server.urls(db.name).items()}
    if temporal_env is not None:
        env["EXPORTS_TEMPORAL_ADDRESS"] = temporal_env.client.service_client.config.target_host
    return env


async def snapshot(db) -> dict[str, object]:
    counts = {t: await db.admin.fetchval(f"SELECT count(*) FROM {t}") for t in TABLES}
    jobs = [tuple(r) for r in await db.admin.fetch("SELECT * FROM export_jobs ORDER BY id")]
    dests = [tuple(r) for r in await db.admin.fetch("SELECT * FROM destinations ORDER BY id")]
    return {**counts, "jobs": jobs, "destinations": dests}


# --- show: a prefix must not reveal another tenant's export ID -------------------------------------------------


@pytest.mark.spec("HI6")
async def test_show_by_prefix_never_reveals_another_tenants_export_id(db, store):
    """`exports show <prefix> --tenant T`: the prefix is resolved over every tenant's exports, then the tenant is
    checked, and the refusal prints the other tenant's whole export ID. Another tenant's export must look exactly
    like no export at all."""
    mine, my_destination = await seed_tenant(db.admin)
    theirs, their_destination = await seed_tenant(db.admin)
    await create_job(store, mine, my_destination)
    their_job = await create_job(store, theirs, their_destination)
    prefix = str(their_job)[:8]

    result = await run(environment(db), "show", prefix, "--tenant", str(mine))

    assert result.exit_code == 2, result.output
    assert str(their_job) not in result.stderr, f"another tenant's export ID leaked: {result.stderr!r}"
    assert "no export ID starts with" in result.stderr, result.stderr


# --- correct: a correction to the status already recorded --------------------------------------------------------


@pytest.mark.spec("HI6")
async def test_correct_to_the_recorded_status_itself_is_bad_input_not_a_false_not_done(db, store):
    """`correct --from Failed --to Failed`: nothing to correct. The client sends it to the database, whose
    statement requires the two to differ, and the command says, falsely, that the export 'is not Failed' (it is),
    with exit status 3 (read it again, retry) instead of 2 (bad input)."""
    tenant, destination = await seed_tenant(db.admin)
    job = await create_job(store, tenant, destination)
    attempt = await drive(store, job, Status.FAILED, FailureCode.BUILD_FAILED)
    before = await snapshot(db)

    result = await run(environment(db), "correct", str(job), "--tenant", str(tenant), "--attempt", str(attempt),
                       "--from", "Failed", "--to", "Failed", "--failure-reason", "NotDelivered",
                       "--by", "rec@example", "--evidence", "ticket 1", "--why", "same")

    assert await snapshot(db) == before
    assert await db.admin.fetchval("SELECT status FROM export_jobs WHERE id = $1", job) == "Failed"
    assert result.exit_code == 2 and result.stderr.startswith("error: "), (result.exit_code, result.stderr)
    assert "is not Failed" not in result.stderr, result.stderr


# --- reconcile: another tenant's export --------------------------------------------------------------------------


@pytest.mark.spec("HI6")
async def test_reconcile_of_another_tenants_export_says_not_found_not_a_false_state(db, store):
    """Another tenant's OutcomeUnknown export, named with my tenant: nothing changes (good), but the line says the
    export 'is not OutcomeUnknown for attempt ...' (false: it is), exit 3, where cancel and edit say 'not found for
    tenant', exit 2."""
    mine, _ = await seed_tenant(db.admin)
    theirs, their_destination = await seed_tenant(db.admin)
    their_job = await create_job(store, theirs, their_destination)
    attempt = await drive(store, their_job, Status.OUTCOME_UNKNOWN)
    assert await db.admin.fetchval("SELECT status FROM export_jobs WHERE id = $1", their_job) == "OutcomeUnknown"
    before = await snapshot(db)

    result = await run(environment(db), "reconcile", str(their_job), "--tenant", str(mine), "--attempt",
                       str(attempt), "--outcome", "Completed", "--by", "op", "--evidence", "seen")

    assert await snapshot(db) == before
    assert "is not OutcomeUnknown" not in result.stderr, result.stderr
    assert result.exit_code == 2 and "not found" in result.stderr, (result.exit_code, result.stderr)


# --- migrate: an empty --to -----------------------------------------------------------------------------------


@pytest.mark.spec("HI6")
async def test_migrate_to_an_empty_revision_is_bad_input_and_moves_nothing(db, tmp_path):
    """`exports migrate --to "$PREVIOUS"` with the variable unset: `--to ''` is taken as no --to at all, and the
    database is migrated up to head, the opposite of the rollback asked for. An empty revision is not a
    revision: exit status 2, nothing changed."""
    settings = db.settings()
    previous = known_revisions()[-2]
    down = await exports_command(settings, "migrate", "--to", previous, cwd=tmp_path)
    assert down.code == 0, down
    assert await db.admin.fetchval("SELECT version_num FROM alembic_version") == previous

    empty = await exports_command(settings, "migrate", "--to", "", cwd=tmp_path)

    at = await db.admin.fetchval("SELECT version_num FROM alembic_version")
    assert at == previous, f"`migrate --to ''` moved the database from {previous} to {at} (head {head_revision()})"
    assert empty.code == 2 and empty.stderr.startswith("error: "), empty


@pytest.mark.spec("HI6")
async def test_migrate_sql_to_an_empty_revision_is_bad_input(tmp_path):
    """The same, where it connects to nothing: `--sql --to ''` prints the whole upgrade to head, exit 0."""
    get_settings.cache_clear()
    result = await run({}, "migrate", "--sql", "--to", "")
    assert result.exit_code == 2 and result.stdout == "", (result.exit_code, result.stdout[:200], result.stderr)


# --- destinations add: a host that is neither a host name nor an IP address ------------------------------------


@pytest.mark.spec("HI7")
async def test_destinations_add_refuses_a_host_with_a_port_or_no_name(db, partner):
    """`--host` is checked as 'a DNS name or an IP address, nothing else' (activities/destination.py), but the
    pattern lets through '127.0.0.1:2222' (a port typed into the host) and '...' : both are written, exit 0,
    and every export to them fails at connect."""
    tenant = uuid.uuid4()
    env = environment(db)
    for host in ("127.0.0.1:2222", "...", "sftp.partner.example:22"):
        before = await snapshot(db)
        result = await run(env, "destinations", "add", "--tenant", str(tenant), "--name", "p", "--host", host,
                           "--port", str(partner.port), "--username", "partner", "--final-dir", "/outbound",
                           "--temp-dir", "/incoming-tmp", "--host-key", partner.host_key_line,
                           "--credential-ref", f"file:{partner.client_key_path}", "--no-check")
        after = await snapshot(db)
        assert result.exit_code == 2 and after == before, (host, result.exit_code, result.stdout, result.stderr)
        assert "host" in result.stderr, (host, result.stderr)
