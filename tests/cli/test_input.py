"""Bad input to the `exports` commands: one clear line, exit status 2, and nothing written."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from typer.testing import CliRunner

from starter.cli import app
from store.settings import get_settings
from tests.helpers.support import create_job, seed_tenant

TABLES = ("export_jobs", "deliveries", "outbox", "cancellation_requests", "export_attempt_events")


@pytest.fixture
async def world(db, store, temporal_env):
    tenant_id, destination_id = await seed_tenant(db.admin)
    other_tenant, other_destination = await seed_tenant(db.admin)
    job_id = await create_job(store, tenant_id, destination_id)
    env = {f"EXPORTS_{k.upper()}": v for k, v in db.server.urls(db.name).items()}
    env["EXPORTS_TEMPORAL_ADDRESS"] = temporal_env.client.service_client.config.target_host
    return {"db": db, "env": env, "tenant": str(tenant_id), "destination": str(destination_id),
            "other_tenant": str(other_tenant), "other_destination": str(other_destination), "job": str(job_id)}


async def snapshot(db) -> dict[str, int]:
    return {t: await db.admin.fetchval(f"SELECT count(*) FROM {t}") for t in TABLES}


async def run(env: dict[str, str], *args: str):
    """The command in a thread of its own, since it runs its own event loop as it would in its own process."""

    def invoke():
        get_settings.cache_clear()
        try:
            return CliRunner().invoke(app, list(args), env=env)
        finally:
            get_settings.cache_clear()

    return await asyncio.to_thread(invoke)


def assert_refused(result, expected: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert expected in lines[0], lines[0]


CASES = {
    "create, malformed tenant": (
        lambda w: ["create", "--tenant", "nope", "--destination", w["destination"], "--created-by", "op"],
        "tenant ID 'nope' is not a UUID"),
    "create, malformed destination": (
        lambda w: ["create", "--tenant", w["tenant"], "--destination", "12-34", "--created-by", "op"],
        "destination ID '12-34' is not a UUID"),
    "create, unknown destination": (
        lambda w: ["create", "--tenant", w["tenant"], "--destination", str(uuid.uuid4()), "--created-by", "op"],
        "no such destination for this tenant"),
    "create, another tenant's destination": (
        lambda w: ["create", "--tenant", w["tenant"], "--destination", w["other_destination"],
                   "--created-by", "op"],
        "no such destination for this tenant"),
    "create, over-long creator": (
        lambda w: ["create", "--tenant", w["tenant"], "--destination", w["destination"], "--created-by", "x" * 201],
        "created by"),
    "create, delivery key with a path": (
        lambda w: ["create", "--tenant", w["tenant"], "--destination", w["destination"], "--created-by", "op",
                   "--delivery-key", "../etc/passwd"],
        "delivery key"),
    "cancel, malformed job": (
        lambda w: ["cancel", "not-a-job", "--tenant", w["tenant"], "--operator", "op"],
        "job ID 'not-a-job' is not a UUID"),
    "cancel, another tenant's job": (
        lambda w: ["cancel", w["job"], "--tenant", w["other_tenant"], "--operator", "op"],
        "not found for tenant"),
    "cancel, missing job": (
        lambda w: ["cancel", str(uuid.uuid4()), "--tenant", w["tenant"], "--operator", "op"],
        "not found for tenant"),
    "cancel, over-long reason": (
        lambda w: ["cancel", w["job"], "--tenant", w["tenant"], "--operator", "op", "--reason", "r" * 2001],
        "reason"),
    "cancel, malformed request ID": (
        lambda w: ["cancel", w["job"], "--tenant", w["tenant"], "--operator", "op", "--request-id", "7"],
        "request ID '7' is not a UUID"),
    "replace, malformed original": (
        lambda w: ["replace", "orig", "--tenant", w["tenant"], "--created-by", "op", "--reason", "r"],
        "job ID 'orig' is not a UUID"),
    "replace, another tenant's original": (
        lambda w: ["replace", w["job"], "--tenant", w["other_tenant"], "--created-by", "op", "--reason", "r"],
        "not found for this tenant"),
    "replace, an original that may not be replaced": (
        lambda w: ["replace", w["job"], "--tenant", w["tenant"], "--created-by", "op", "--reason", "r"],
        "may not be replaced"),
    "replace, over-long reason": (
        lambda w: ["replace", w["job"], "--tenant", w["tenant"], "--created-by", "op", "--reason", "r" * 2001],
        "replacement reason"),
    "edit, malformed job": (
        lambda w: ["edit", "j", "--tenant", w["tenant"], "--version", "1", "--destination", w["destination"]],
        "job ID 'j' is not a UUID"),
    "edit, another tenant's job": (
        lambda w: ["edit", w["job"], "--tenant", w["other_tenant"], "--version", "1",
                   "--destination", w["other_destination"]],
        "not found for tenant"),
    "edit, unknown destination": (
        lambda w: ["edit", w["job"], "--tenant", w["tenant"], "--version", "1", "--destination", str(uuid.uuid4())],
        "no such destination for this tenant"),
    "edit, version zero": (
        lambda w: ["edit", w["job"], "--tenant", w["tenant"], "--version", "0", "--destination", w["destination"]],
        "expected version"),
    "reconcile, unknown outcome": (
        lambda w: ["reconcile", w["job"], "--tenant", w["tenant"], "--attempt", str(uuid.uuid4()),
                   "--outcome", "Probably", "--by", "op", "--evidence", "e"],
        "must be Completed or Failed"),
    "reconcile, malformed attempt": (
        lambda w: ["reconcile", w["job"], "--tenant", w["tenant"], "--attempt", "a1", "--outcome", "Completed",
                   "--by", "op", "--evidence", "e"],
        "attempt ID 'a1' is not a UUID"),
    "correct, to Failed without a reason": (
        lambda w: ["correct", w["job"], "--tenant", w["tenant"], "--attempt", str(uuid.uuid4()), "--from",
                   "Completed", "--to", "Failed", "--by", "op", "--evidence", "e", "--why", "w"],
        "needs a failure reason"),
    "correct, unknown failure reason": (
        lambda w: ["correct", w["job"], "--tenant", w["tenant"], "--attempt", str(uuid.uuid4()), "--from",
                   "Completed", "--to", "Failed", "--failure-reason", "Gremlins", "--by", "op", "--evidence", "e",
                   "--why", "w"],
        "is not one of"),
    "show, malformed job": (lambda w: ["show", "x"], "job ID 'x' is not a UUID"),
    "show, another tenant's job": (lambda w: ["show", w["job"], "--tenant", w["other_tenant"]], "not found"),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_cli__bad_input_is_one_line_and_changes_nothing(world, case):
    args, expected = CASES[case]
    before = await snapshot(world["db"])
    result = await run(world["env"], *args(world))
    assert_refused(result, expected)
    assert await snapshot(world["db"]) == before


async def test_cli__good_input_creates_shows_and_cancels(world):
    created = await run(world["env"], "create", "--tenant", world["tenant"], "--destination", world["destination"],
                  "--created-by", "op", "--delivery-key", "weekly-1")
    assert created.exit_code == 0, created.output
    job_id = uuid.UUID(created.stdout.strip())
    shown = await run(world["env"], "show", str(job_id), "--json")
    assert shown.exit_code == 0 and '"delivery_key": "weekly-1"' in shown.stdout
    canceled = await run(world["env"], "cancel", str(job_id), "--tenant", world["tenant"], "--operator", "op")
    assert canceled.exit_code == 0 and canceled.stdout.startswith("CanceledWhileQueued"), canceled.output
    assert await world["db"].admin.fetchval("SELECT status FROM export_jobs WHERE id = $1", job_id) == "Canceled"


async def test_cli__edit_replace_reconcile_and_correct_do_their_writes(world, store):
    from store.models import FailureCode, Status
    from tests.helpers.store_states import drive

    env, tenant = world["env"], world["tenant"]
    edited = await run(env, "edit", world["job"], "--tenant", tenant, "--version", "1",
                       "--destination", world["destination"])
    assert edited.exit_code == 0, edited.output
    stale = await run(env, "edit", world["job"], "--tenant", tenant, "--version", "1",
                      "--destination", world["destination"])
    assert stale.exit_code == 3 and stale.stderr.startswith("not changed"), stale.output

    attempt = await drive(store, uuid.UUID(world["job"]), Status.FAILED, FailureCode.BUILD_FAILED)
    replaced = await run(env, "replace", world["job"], "--tenant", tenant, "--created-by", "op",
                         "--reason", "the build failed")
    assert replaced.exit_code == 0, replaced.output
    replacement = uuid.UUID(replaced.stdout.strip())
    assert await world["db"].admin.fetchval("SELECT replaces_job_id FROM export_jobs WHERE id = $1",
                                            replacement) == uuid.UUID(world["job"])

    corrected = await run(env, "correct", world["job"], "--tenant", tenant, "--attempt", str(attempt),
                          "--from", "Failed", "--to", "Completed", "--by", "rec@example", "--evidence", "ticket",
                          "--why", "it arrived")
    assert corrected.exit_code == 0, corrected.output
    assert await world["db"].admin.fetchval(
        "SELECT observed_by FROM export_attempt_events WHERE job_id = $1 AND kind = 'Corrected'",
        uuid.UUID(world["job"])) == "rec@example"
    again = await run(env, "correct", world["job"], "--tenant", tenant, "--attempt", str(attempt),
                      "--from", "Completed", "--to", "Failed", "--failure-reason", "NotDelivered",
                      "--by", "rec@example", "--evidence", "ticket", "--why", "changed my mind")
    assert again.exit_code == 2 and "already corrected" in again.stderr, again.output
