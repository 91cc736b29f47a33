"""The `exports` command line. Whatever goes wrong is one line on stderr and a documented exit status (README,
"Bad input ..."), never a traceback; text that operators typed is printed literally, control characters escaped."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import sys
import traceback
from collections.abc import Awaitable, Callable, Sequence
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table
from rich.text import Text
from temporalio.service import RPCError
from typer.core import TyperGroup

from activities.contracts import CancelRequest
from activities.process.temporal import CONNECT_TIMEOUT_SECONDS, Unreachable, connect_temporal, exit_now
from starter.client import (
    ExportsClient,
    ExportView,
    InputError,
    SignalNotSent,
    check_database,
    database_engine,
    parse_id,
)
from starter.destinations import destinations_app
from starter.exits import (
    EXIT_BAD_INPUT,
    EXIT_NOT_DONE,
    EXIT_REFUSED,
    EXIT_UNEXPECTED,
    EXIT_UNREACHABLE,
    NoArgsIsHelpError,
    answer,
)
from starter.preflight import (
    NOT_ALLOWED,
    CannotList,
    Registered,
    create_commands,
    expected_search_attributes,
    register_search_attributes,
    registered_search_attributes,
    wrong_type_line,
)
from store.models import CancellationOutcome, CancellationResult
from store.settings import Settings, get_settings, setting_problem
from store.statements import RoleStore

T = TypeVar("T")

MAX_LINE = 1000


def literal(value: object) -> str:
    """Text exactly as typed, safe for a terminal: every character that is not printable (ESC and the other
    control characters, bidirectional overrides, line separators, undecodable bytes) shown as its escape, e.g.
    \\x1b, \\n, \\u202e."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def cell(value: object) -> Text:
    """A table cell that rich prints as it is: no markup, no emoji codes, no highlighting."""
    return Text(literal(value))


def say(message: str) -> None:
    """One line on stderr, never wrapped, never markup, control characters escaped."""
    line = literal(message)
    print(line if len(line) <= MAX_LINE else line[:MAX_LINE] + "...(cut)", file=sys.stderr)


def fail(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    """One line on stderr and the exit status."""
    say(message)
    raise typer.Exit(code)


class ExportsGroup(TyperGroup):
    """The root command: turns every way a command can end into one line and an exit status."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, windows_expand_args: bool = True, **extra: Any) -> Any:
        code = self._exit_status(args, prog_name, complete_var, windows_expand_args=windows_expand_args, **extra)
        if standalone_mode:
            sys.exit(code)
        return code

    def _exit_status(self, args: Sequence[str] | None, prog_name: str | None, complete_var: str | None,
                     **extra: Any) -> int:
        try:
            result = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            return result if isinstance(result, int) else 0  # typer.Exit(code) comes back as its code
        except NoArgsIsHelpError as exc:  # a bare `exports`: its help, as --help prints it
            text = exc.ctx.get_help()
            if text:
                print(text)
            return 0
        except Exception as exc:  # a usage error, Ctrl-C (click's Abort), or whatever ended the command
            code, line = answer(exc)
            if code == EXIT_UNEXPECTED and os.environ.get("EXPORTS_TRACEBACK") == "1":
                traceback.print_exc()
            say(line)
            return code


app = typer.Typer(help="Partner exports on Temporal.", no_args_is_help=True, add_completion=False,
                  cls=ExportsGroup, pretty_exceptions_enable=False)
# Markup, emoji codes and highlighting off: what operators typed is printed as they typed it.
console = Console(markup=False, emoji=False, highlight=False)


def _print_version(asked: bool) -> None:
    if not asked:
        return
    try:
        version = importlib.metadata.version("partner-exports")
    except importlib.metadata.PackageNotFoundError:
        fail("error: the partner-exports package is not installed (pip install .), so its version is unknown",
             EXIT_UNEXPECTED)
    print(f"exports {version}")
    raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                 help="print the installed version and exit"),
) -> None:
    """Partner exports on Temporal."""


def _settings() -> Settings:
    """The settings, or one line naming the EXPORTS_* variable that does not parse."""
    try:
        return get_settings()
    except ValidationError as exc:
        raise InputError(setting_problem(exc)) from None


async def _reach_database(url: str, setting: str) -> None:
    """Unreachable unless PostgreSQL at this URL answers a connection within the bound."""
    role = RoleStore(database_engine(url, setting, pool_size=1))
    try:
        await check_database(role, setting)
    finally:
        await role.aclose()


def _run(body: Callable[[ExportsClient], Awaitable[T]], *, temporal: bool = False, database: bool = True) -> T:
    """Connects (Temporal first when the command needs it, then PostgreSQL), each within the bound, before
    anything is written; the command's answer, or its exception for ExportsGroup to put in one line. Commands
    that run as the reconciliation role (database=False) check that role's connection instead."""

    async def main() -> T:
        settings = _settings()
        temporal_client = await connect_temporal(settings, timeout=CONNECT_TIMEOUT_SECONDS) if temporal else None
        client = ExportsClient.from_settings(settings, temporal_client)
        try:
            if database:
                await client.check_database()
            return await body(client)
        finally:
            await client.close()

    return asyncio.run(main())


@app.command()
def migrate(
    sql: bool = typer.Option(False, "--sql", help="print the migration SQL for review (psql can apply it); "
                                                  "connects to nothing"),
    from_revision: str | None = typer.Option(None, "--from", help="with --sql: the revision the database "
                                                                      "is at (its alembic_version); default: empty"),
    to_revision: str | None = typer.Option(None, "--to", help="the revision to bring the database to, up or down "
                                                                  "(a rollback: the revision the previous release "
                                                                  "needs); default: this release's newest"),
) -> None:
    """Apply the database migrations as the owner role (EXPORTS_OWNER_DATABASE_URL), and the grants the worker
    checks at start. With --to, migrate up or down to that revision. An upgrade commits each migration on its
    own (a failed one keeps those before it); a downgrade is one transaction."""
    from starter.preflight import grant_statements
    from store.db import (
        MigrationLocked,
        MigrationStopped,
        UnknownRevision,
        head_revision,
        migration_sql,
        resolve_revision,
    )
    from store.db import migrate as run_migrations

    if from_revision is not None and not sql:
        fail("error: --from goes with --sql (a migration against the database reads its own revision)")
    try:  # before anything connects: an unknown target changes nothing
        target = resolve_revision("head" if to_revision is None else to_revision)  # `--to ""` is no revision
    except UnknownRevision as exc:
        fail(f"error: {exc}")
    if sql:
        try:
            text = migration_sql(from_revision, target, lock_timeout_seconds=_settings().migration_lock_timeout_seconds)
        except ValueError as exc:
            fail(f"error: {exc}")
        sys.stdout.write(text)  # not through rich: the SQL exactly as written, never wrapped
        return

    async def main() -> tuple[str | None, str]:
        settings = _settings()
        url = settings.owner_database_url
        await _reach_database(url, "EXPORTS_OWNER_DATABASE_URL")
        # The grants the worker checks at start, again: the migrations gave them, a restore without privileges or a
        # REVOKE may have taken them, and this is what the worker's line tells the operator to run.
        grants = grant_statements() if target == head_revision() else []
        return await run_migrations(url, target, lock_timeout_seconds=settings.migration_lock_timeout_seconds,
                                    then=grants)

    try:
        before, after = asyncio.run(main())
    except UnknownRevision as exc:  # before any change
        fail(f"error: {exc}")
    except MigrationLocked as exc:
        fail(f"not done: {exc}", EXIT_NOT_DONE)
    except MigrationStopped as exc:  # refused by PostgreSQL, or PostgreSQL lost, part way
        code, _ = answer(exc.cause)
        fail(f"{'unreachable' if code == EXIT_UNREACHABLE else 'refused'}: {exc}", code)
    if before == after:
        console.print(f"migrations applied: the database was already at {after}")
    else:
        console.print(f"migrations applied: the database is at {after} (was {before or 'empty'})")


@app.command()
def create(
    tenant: str = typer.Option(..., help="tenant ID"),
    destination: str = typer.Option(..., help="destination ID, of this tenant"),
    created_by: str = typer.Option(..., "--created-by", help="the operator or client creating the export"),
    delivery_key: str | None = typer.Option(None, help="partner-facing identity; minted when omitted"),
    job_id: str | None = typer.Option(None, help="client-chosen export ID; minted when omitted"),
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
    reason: str | None = typer.Option(None, help="why"),
    request_id: str | None = typer.Option(None, help="reuse it to retry the same click after Busy"),
) -> None:
    """Cancel an export: recorded under the row lock, then signalled to its workflow. The row is written first,
    whether or not Temporal answers: the signal only makes the stop faster, and the line says if it went out."""

    async def record_then_signal(c: ExportsClient) -> CancellationResult:
        result = await c.cancel(tenant_id=tenant, job_id=job_id, requested_by=operator, reason=reason,
                                request_id=request_id)  # no Temporal client yet: the row only
        if result.recorded:
            request = CancelRequest(request_id=result.request_id, tenant_id=parse_id(tenant, "tenant ID"),
                                    requested_by=operator, reason=reason)
            try:
                c.temporal = await connect_temporal(_settings(), timeout=CONNECT_TIMEOUT_SECONDS)
                await c.signal_cancellation(parse_id(job_id, "job ID"), request, result)
            except (Unreachable, SignalNotSent) as exc:
                print(literal(f"warning: {result.outcome.value} is recorded, but the workflow was not signalled "
                              f"({exc}); the row decides, and a build still stops"), file=sys.stderr)
        return result

    result = _run(record_then_signal)
    if result.outcome is CancellationOutcome.NOT_FOUND:
        fail(f"error: export {job_id} not found for tenant {tenant}", EXIT_BAD_INPUT)
    if result.outcome is CancellationOutcome.REQUEST_ID_REUSED:
        fail(f"error: request ID {result.request_id} was already used for another export or operator",
             EXIT_BAD_INPUT)
    if result.outcome is CancellationOutcome.BUSY:
        fail(f"could not tell: the export is busy and nothing was recorded; retry with "
             f"--request-id {result.request_id}", EXIT_NOT_DONE)
    assert result.found_status is not None  # a recorded request names the state it found the export in
    console.print(f"{result.outcome.value} (request {result.request_id}, found {result.found_status.value})")


@app.command()
def replace(
    original: str = typer.Argument(..., help="the original export (a replacement's ID resolves to its original)"),
    tenant: str = typer.Option(..., help="tenant ID"),
    created_by: str = typer.Option(..., "--created-by", help="the named person creating the replacement"),
    reason: str = typer.Option(..., help="why, in the creator's words"),
    overwrite_agreement: str | None = typer.Option(
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
                                      reconciled_by=by, evidence=evidence), database=False)
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
    failure_reason: str | None = typer.Option(None, help="with --to Failed: the failure code"),
    by: str = typer.Option(..., help="the reconciliation operator"),
    evidence: str = typer.Option(..., help="reference to the evidence"),
    why: str = typer.Option(..., help="why the recorded outcome was wrong"),
) -> None:
    """Correct a recorded Completed or Failed, once per attempt (reconciliation role only)."""
    done = _run(lambda c: c.correct(tenant_id=tenant, job_id=job_id, attempt_id=attempt, recorded=recorded,
                                    corrected=corrected, failure_reason=failure_reason, corrected_by=by,
                                    evidence_ref=evidence, why=why), database=False)
    if not done:
        fail(f"not corrected: export {job_id} is not {recorded} for attempt {attempt}", EXIT_NOT_DONE)
    console.print(f"corrected from {recorded} to {corrected}")


@app.command()
def show(
    job_id: str = typer.Argument(..., help="export ID, or a prefix of it that only one export has"),
    tenant: str | None = typer.Option(None, help="tenant ID; another tenant's export is not found"),
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
            table.add_row(cell(name), cell(value.hex() if isinstance(value, bytes) else value))
    console.print(table)
    if view.events:
        events = Table("event", "attempt", "by", "detail", "at", title="attempt events")
        for e in view.events:
            events.add_row(cell(e["kind"]), cell(str(e["attempt_id"])[:8]),
                           cell(e["worker_id"] or e["observed_by"] or ""), cell((e["detail"] or "")[:80]),
                           cell(e["recorded_at"]))
        console.print(events)
    if view.cancellation_requests:
        requests = Table("request", "by", "why", "outcome", "found", "at", title="cancellation requests")
        for r in view.cancellation_requests:
            requests.add_row(cell(r["id"]), cell(r["requested_by"]), cell(r.get("reason") or ""), cell(r["outcome"]),
                             cell(r["found_status"]), cell(r["recorded_at"]))
        console.print(requests)


def _view_json(view: ExportView) -> dict[str, Any]:
    return {"row": view.row.model_dump(mode="json"), "events": view.events,
            "cancellation_requests": view.cancellation_requests}


schedules_app = typer.Typer(help="The Temporal Schedules that run recovery and the sweeper.")
app.add_typer(schedules_app, name="schedules")
app.add_typer(destinations_app, name="destinations")


@schedules_app.command("install")
def schedules_install() -> None:
    """Create the recovery and sweeper schedules, or update them to the current settings."""
    from starter.schedules import install_schedules

    async def main() -> dict[str, str]:
        settings = _settings()
        return await install_schedules(await connect_temporal(settings, timeout=CONNECT_TIMEOUT_SECONDS), settings)

    for schedule_id, done in asyncio.run(main()).items():
        console.print(cell(f"{schedule_id}: {done}"))


@schedules_app.command("remove")
def schedules_remove(
    schedule_ids: Annotated[list[str], typer.Argument(help="the schedules to remove, e.g. exports-follow-up")],
) -> None:
    """Delete schedules this release installs, terminating the run each has open: before a rollback to a release
    that does not know their workflow (CHANGELOG.md names them). Safe to run again."""
    from starter.schedules import remove_schedules, schedules

    settings = _settings()
    known = schedules(settings)
    unknown = [i for i in schedule_ids if i not in known]
    if unknown:
        fail(f"error: not a schedule of this release: {', '.join(unknown)} (its schedules: {', '.join(known)})")

    async def main() -> dict[str, str]:
        return await remove_schedules(await connect_temporal(settings, timeout=CONNECT_TIMEOUT_SECONDS), schedule_ids)

    for schedule_id, done in asyncio.run(main()).items():
        console.print(cell(f"{schedule_id}: {done}"))


@app.command()
def setup() -> None:
    """Register the search attributes this release sets on the configured Temporal namespace, those missing only
    (safe to run again), as someone who may administer the namespace; the worker checks them at start. It does not
    install the schedules: run `exports schedules install` after it, as the schedules Job does, with the
    deployment's own settings (their intervals), on every deploy."""

    async def main() -> tuple[str, Registered]:
        client = await connect_temporal(_settings(), timeout=CONNECT_TIMEOUT_SECONDS)
        missing = expected_search_attributes()
        try:
            return client.namespace, await register_search_attributes(client)
        except CannotList as exc:
            fail(f"refused by Temporal: the search attributes of namespace {client.namespace} cannot be read with "
                 f"these credentials ({exc}); an administrator adds them with "
                 f"{create_commands(client.namespace, missing)}", EXIT_REFUSED)
        except RPCError as exc:
            if exc.status not in NOT_ALLOWED:
                raise
            try:  # name only what is missing, if the namespace says
                found = await registered_search_attributes(client)
                missing = {name: kind for name, kind in missing.items() if found.get(name) is None} or missing
            except (RPCError, CannotList):
                pass
            fail(f"refused by Temporal: these credentials may not add search attributes to namespace "
                 f"{client.namespace} ({exc.status.name}: {exc.message}); an administrator adds them with "
                 f"{create_commands(client.namespace, missing)}", EXIT_REFUSED)

    namespace, done = asyncio.run(main())
    for name, kind in done.added.items():
        console.print(cell(f"added {name} ({kind}) to namespace {namespace}"))
    if done.present:
        listed = ", ".join(f"{name} ({kind})" for name, kind in done.present.items())
        console.print(cell(f"{'already registered' if done.added else 'nothing to add, already registered'} on "
                           f"namespace {namespace}: {listed}"))
    expected = expected_search_attributes()
    for name, found in done.conflicting.items():
        say(f"refused: {wrong_type_line(namespace, name, found, expected[name])}")
    if done.conflicting:
        raise typer.Exit(EXIT_REFUSED)


@app.command("list")
def list_exports(
    status: str | None = typer.Option(None, help="only exports in this state, as Temporal's search shows it"),
    tenant: str | None = typer.Option(None, help="only this tenant's exports"),
    limit: int = typer.Option(50, min=1, max=1000),
) -> None:
    """Exports as the Temporal UI lists them (search attributes), with the row's state beside each."""
    rows = _run(lambda c: c.list(status=status, tenant_id=tenant, limit=limit), temporal=True)
    table = Table("job", "tenant", "status (Temporal)", "status (row)", "attempts", "delivery key")
    for listed, row in rows:
        table.add_row(cell(listed.job_id), cell(listed.tenant_id), cell(listed.status),
                      cell(row.status.value if row else "?"), cell(listed.attempts), cell(listed.delivery_key))
    console.print(table)


@app.command("follow-ups")
def follow_ups(
    tenant: str | None = typer.Option(None, help="only this tenant's exports"),
    limit: int = typer.Option(100, min=1, max=1000),
    as_json: bool = typer.Option(False, "--json", help="print them as JSON"),
) -> None:
    """OutcomeUnknown exports the evidence follow-up looks at again (pending), those past its window, left for a
    person, and those it settled by proof (confirmed), each with its last finding."""
    window = _settings().follow_up_window_seconds
    found = _run(lambda c: c.follow_ups(window_seconds=window, tenant_id=tenant, limit=limit))
    if as_json:
        print(json.dumps(found, indent=2, default=str))
        return
    table = Table("job", "state", "since", "looks", "last look", "finding", title="evidence follow-up")
    for f in found:
        table.add_row(cell(f["job_id"]), cell(f["state"]), cell(f["unknown_since"]), cell(f["looks"]),
                      cell(f["last_look_at"] or ""), cell(f["finding"] or ""))
    console.print(table)


@app.command()
def worker() -> None:
    """Run a worker: the workflows, the activities and the outbox dispatcher."""

    async def reachable() -> None:
        # Temporal only: a worker starts while the database is away and keeps trying (worker.py).
        await connect_temporal(_settings(), timeout=CONNECT_TIMEOUT_SECONDS)

    asyncio.run(reachable())
    # Then this process becomes `python -m worker`: one start path (its preflight, its exit statuses), and a fresh
    # Temporal SDK runtime, which the worker installs with its metrics before it connects; the check's client took
    # this interpreter's (the worker then failed with "Runtime default already set").
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.execv(sys.executable, [sys.executable, "-m", "worker"])


@app.command()
def dev() -> None:
    """Start the local stack, run the demo, and stay up until Ctrl-C (EXPORTS_RUN_ONCE=1: run it and exit)."""
    from starter.devstack import run_dev

    sys.exit(asyncio.run(run_dev()))


def main() -> None:
    """The `exports` script: the command's exit status, every time."""
    try:
        code = app(standalone_mode=False)
    except SystemExit as exc:  # `exports dev` ends with its own status
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    exit_now(code)
