"""The `exports` command line. Bad input is one clear line on stderr, exit status 2, and changes nothing."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, Optional, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from starter.client import ExportsClient, ExportView, InputError
from starter.temporal import connect_temporal
from store.errors import StoreError
from store.models import CancellationOutcome
from store.settings import get_settings

app = typer.Typer(help="Partner exports on Temporal.", no_args_is_help=True, add_completion=False)
console = Console()
T = TypeVar("T")

EXIT_BAD_INPUT = 2
EXIT_NOT_DONE = 3  # nothing changed (Busy, or the row moved on): read it again, retry with the same request ID
EXIT_REFUSED = 4


def fail(message: str, code: int = 2) -> NoReturn:
    """One line on stderr, never wrapped, and the exit status."""
    print(message, file=sys.stderr)
    raise typer.Exit(code)


def _run(body: Callable[[ExportsClient], Awaitable[T]], *, temporal: bool = False) -> T:
    async def main() -> T:
        settings = get_settings()
        client = ExportsClient.from_settings(settings, await connect_temporal(settings) if temporal else None)
        try:
            return await body(client)
        finally:
            await client.close()

    try:
        return asyncio.run(main())
    except InputError as exc:
        fail(f"error: {exc}", EXIT_BAD_INPUT)
    except StoreError as exc:  # a definite refusal from the database, e.g. a role that may not do this
        fail(f"refused: {exc}", EXIT_REFUSED)


@app.command()
def migrate() -> None:
    """Apply the database migrations as the owner role (EXPORTS_OWNER_DATABASE_URL)."""
    from store.db import migrate as run_migrations

    asyncio.run(run_migrations(get_settings().owner_database_url))
    console.print("migrations applied")


@app.command()
def create(
    tenant: str = typer.Option(..., help="tenant ID"),
    destination: str = typer.Option(..., help="destination ID, of this tenant"),
    created_by: str = typer.Option(..., "--created-by", help="the operator or client creating the export"),
    delivery_key: Optional[str] = typer.Option(None, help="partner-facing identity; minted when omitted"),
    job_id: Optional[str] = typer.Option(None, help="client-chosen export ID; minted when omitted"),
) -> None:
    """Create an export. Its workflow starts when the dispatcher publishes the wake-up."""
    created = _run(lambda c: c.create(tenant_id=tenant, destination_id=destination, created_by=created_by,
                                      delivery_key=delivery_key, job_id=job_id))
    console.print(str(created))


@app.command()
def cancel(
    job_id: str = typer.Argument(..., help="export ID"),
    tenant: str = typer.Option(..., help="tenant ID"),
    operator: str = typer.Option(..., help="who asks"),
    reason: Optional[str] = typer.Option(None, help="why"),
    request_id: Optional[str] = typer.Option(None, help="reuse it to retry the same click after Busy"),
) -> None:
    """Cancel an export: recorded under the row lock, then signalled to its workflow."""
    result = _run(lambda c: c.cancel(tenant_id=tenant, job_id=job_id, requested_by=operator, reason=reason,
                                     request_id=request_id), temporal=True)
    if result.outcome is CancellationOutcome.NOT_FOUND:
        fail(f"error: export {job_id} not found for tenant {tenant}", EXIT_BAD_INPUT)
    if result.outcome is CancellationOutcome.REQUEST_ID_REUSED:
        fail(f"error: request ID {result.request_id} was already used for another export or operator",
             EXIT_BAD_INPUT)
    if result.outcome is CancellationOutcome.BUSY:
        fail(f"could not tell: the export is busy and nothing was recorded; retry with "
             f"--request-id {result.request_id}", EXIT_NOT_DONE)
    console.print(f"{result.outcome.value} (request {result.request_id}, found {result.found_status.value})")


@app.command()
def replace(
    original: str = typer.Argument(..., help="the original export (a replacement's ID resolves to its original)"),
    tenant: str = typer.Option(..., help="tenant ID"),
    created_by: str = typer.Option(..., "--created-by", help="the named person creating the replacement"),
    reason: str = typer.Option(..., help="why, in the creator's words"),
    overwrite_agreement: Optional[str] = typer.Option(
        None, help="reference to the partner's recorded agreement to an overwrite; without it, none happens"),
) -> None:
    """Create a replacement for an original that did not deliver, or whose outcome is unknown."""
    created = _run(lambda c: c.replace(tenant_id=tenant, original_job_id=original, created_by=created_by,
                                       reason=reason, overwrite_agreement_ref=overwrite_agreement))
    console.print(str(created))


@app.command()
def edit(
    job_id: str = typer.Argument(..., help="export ID"),
    tenant: str = typer.Option(..., help="tenant ID"),
    version: int = typer.Option(..., help="the version you read (exports show)"),
    destination: str = typer.Option(..., help="the new destination, of this tenant"),
) -> None:
    """Change the destination of an export that has not started."""
    changed = _run(lambda c: c.edit(tenant_id=tenant, job_id=job_id, expected_version=version,
                                    destination_id=destination))
    if not changed:
        fail(f"not changed: export {job_id} has started, ended, or is no longer at version {version}",
             EXIT_NOT_DONE)
    console.print(f"changed; now at version {version + 1}")


@app.command("reconcile")
def reconcile_command(
    job_id: str = typer.Argument(..., help="export ID"),
    tenant: str = typer.Option(..., help="tenant ID"),
    attempt: str = typer.Option(..., help="the attempt recovery resolved to OutcomeUnknown"),
    outcome: str = typer.Option(..., help="Completed, or Failed (recorded as NotDelivered)"),
    by: str = typer.Option(..., help="who reconciles"),
    evidence: str = typer.Option(..., help="what the evidence shows"),
) -> None:
    """Settle an OutcomeUnknown export once, from evidence."""
    done = _run(lambda c: c.reconcile(tenant_id=tenant, job_id=job_id, attempt_id=attempt, outcome=outcome,
                                      reconciled_by=by, evidence=evidence))
    if not done:
        fail(f"not reconciled: export {job_id} is not OutcomeUnknown for attempt {attempt}", EXIT_NOT_DONE)
    console.print(f"reconciled as {outcome}")


@app.command("correct")
def correct_command(
    job_id: str = typer.Argument(..., help="export ID"),
    tenant: str = typer.Option(..., help="tenant ID"),
    attempt: str = typer.Option(..., help="the attempt whose outcome is corrected"),
    recorded: str = typer.Option(..., "--from", help="the recorded status you saw: Completed or Failed"),
    corrected: str = typer.Option(..., "--to", help="Completed or Failed"),
    failure_reason: Optional[str] = typer.Option(None, help="with --to Failed: the failure code"),
    by: str = typer.Option(..., help="the reconciliation operator"),
    evidence: str = typer.Option(..., help="reference to the evidence"),
    why: str = typer.Option(..., help="why the recorded outcome was wrong"),
) -> None:
    """Correct a recorded Completed or Failed, once per attempt (reconciliation role only)."""
    done = _run(lambda c: c.correct(tenant_id=tenant, job_id=job_id, attempt_id=attempt, recorded=recorded,
                                    corrected=corrected, failure_reason=failure_reason, corrected_by=by,
                                    evidence_ref=evidence, why=why))
    if not done:
        fail(f"not corrected: export {job_id} is not {recorded} for attempt {attempt}", EXIT_NOT_DONE)
    console.print(f"corrected from {recorded} to {corrected}")


@app.command()
def show(
    job_id: str = typer.Argument(..., help="export ID"),
    tenant: Optional[str] = typer.Option(None, help="tenant ID; another tenant's export is not found"),
    as_json: bool = typer.Option(False, "--json", help="print the row and its history as JSON"),
) -> None:
    """Show an export's row, its attempt events and its cancellation requests."""
    view = _run(lambda c: c.show(job_id, tenant_id=tenant))
    if as_json:
        print(json.dumps(_view_json(view), indent=2, default=str))
        return
    table = Table(show_header=False, box=None)
    for name, value in view.row.model_dump().items():
        if value is not None:
            table.add_row(name, value.hex() if isinstance(value, bytes) else str(value))
    console.print(table)
    if view.events:
        events = Table("event", "attempt", "by", "detail", "at", title="attempt events")
        for e in view.events:
            events.add_row(e["kind"], str(e["attempt_id"])[:8], e["worker_id"] or e["observed_by"] or "",
                           (e["detail"] or "")[:80], str(e["recorded_at"]))
        console.print(events)
    if view.cancellation_requests:
        requests = Table("request", "by", "outcome", "found", "at", title="cancellation requests")
        for r in view.cancellation_requests:
            requests.add_row(str(r["id"]), r["requested_by"], r["outcome"], r["found_status"], str(r["recorded_at"]))
        console.print(requests)


def _view_json(view: ExportView) -> dict[str, Any]:
    return {"row": view.row.model_dump(mode="json"), "events": view.events,
            "cancellation_requests": view.cancellation_requests}


schedules_app = typer.Typer(help="The Temporal Schedules that run recovery and the sweeper.")
app.add_typer(schedules_app, name="schedules")


@schedules_app.command("install")
def schedules_install() -> None:
    """Create the recovery and sweeper schedules, or update them to the current settings."""
    from starter.schedules import install_schedules

    async def main() -> dict[str, str]:
        settings = get_settings()
        return await install_schedules(await connect_temporal(settings), settings)

    for schedule_id, done in asyncio.run(main()).items():
        console.print(f"{schedule_id}: {done}")


@app.command("list")
def list_exports(
    status: Optional[str] = typer.Option(None, help="only exports in this state, as Temporal's search shows it"),
    tenant: Optional[str] = typer.Option(None, help="only this tenant's exports"),
    limit: int = typer.Option(50, min=1, max=1000),
) -> None:
    """Exports as the Temporal UI lists them (search attributes), with the row's state beside each."""
    rows = _run(lambda c: c.list(status=status, tenant_id=tenant, limit=limit), temporal=True)
    table = Table("job", "tenant", "status (Temporal)", "status (row)", "attempts", "delivery key")
    for listed, row in rows:
        table.add_row(str(listed.job_id), str(listed.tenant_id), listed.status,
                      row.status.value if row else "?", str(listed.attempts), listed.delivery_key)
    console.print(table)


@app.command()
def worker() -> None:
    """Run a worker: the workflows, the activities and the outbox dispatcher."""
    import worker as worker_process

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    asyncio.run(worker_process.main())


@app.command()
def dev() -> None:
    """Start the local stack, run the demo, and stay up until Ctrl-C (EXPORTS_RUN_ONCE=1: run it and exit)."""
    from starter.devstack import run_dev

    sys.exit(asyncio.run(run_dev()))


def main() -> None:
    app()
