"""`make run`: the local stack on embedded defaults, and a demo batch of exports an operator can watch.

Starts PostgreSQL, the Temporal dev server (UI on 127.0.0.1:8233), an SFTP partner writing under
.exports/partner/, and a worker process (workflows, activities, outbox dispatcher). Seeds a demo tenant, runs the
demo, shows progress and final states, and stays up until Ctrl-C; with EXPORTS_RUN_ONCE=1 it exits, 0 only when
every export ended as expected and every file at the partner matches its job. Every process is stopped by PID.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import signal
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

import asyncpg
from rich.console import Console
from rich.live import Live
from rich.table import Table
from temporalio.client import Client

from activities.contracts import ExportResult
from activities.process.temporal import connect_temporal
from starter.client import ExportsClient
from starter.localstack import processes
from starter.localstack.partner import LocalPartner
from starter.localstack.ports import free_port
from starter.localstack.postgres import LocalPostgres
from starter.localstack.seed import seed_contacts, seed_destination
from starter.localstack.temporal import LocalTemporal
from starter.schedules import install_schedules
from store.db import asyncpg_dsn, migrate
from store.models import CancellationOutcome, CancellationResult, JobRow, Status
from store.settings import LOCAL_ENV_FILE, Settings, as_env
from workflows.identity import export_workflow_id, job_id_of

log = logging.getLogger(__name__)
console = Console()

STATE = Path(".exports")
DATABASE = "exports"
DEMO_TENANT = uuid.UUID("00000000-0000-4000-8000-00000000d3e0")
DEMO_DESTINATION = uuid.UUID("00000000-0000-4000-8000-00000000de51")
PAUSED_DESTINATION = uuid.UUID("00000000-0000-4000-8000-00000000de52")
DEMO_CONTACTS = 20_000  # about 1.8 MB of CSV


class Pace(TypedDict):
    """The settings that pace builds and uploads, in bytes per second."""

    build_throttle_bytes_per_second: int
    upload_throttle_bytes_per_second: int


# Paced so that a person (and the demo) can cancel an export while it builds and while it uploads.
DEMO_PACE = Pace(build_throttle_bytes_per_second=400_000, upload_throttle_bytes_per_second=400_000)
TIMEOUT = 120.0


@dataclass
class DemoExport:
    label: str
    expected: Status
    job_id: uuid.UUID
    cancel_outcome: CancellationOutcome | None = None
    expected_cancel: CancellationOutcome | None = None
    row: JobRow | None = None
    result: ExportResult | None = None  # what its workflow returned
    notes: list[str] = field(default_factory=list)


async def run_dev() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    run_once = os.environ.get("EXPORTS_RUN_ONCE") == "1"
    STATE.mkdir(exist_ok=True)
    postgres = LocalPostgres(STATE / "pg")
    temporal = LocalTemporal(STATE / "temporal")
    partner = LocalPartner(STATE / "partner", host_key_path=STATE / "keys" / "partner_host_key",
                           client_key_path=STATE / "keys" / "client_key")
    worker: asyncio.subprocess.Process | None = None
    try:
        console.print("[bold]starting[/] PostgreSQL, the Temporal dev server, the SFTP partner ...")
        postgres.start()
        await _ensure_database(postgres)
        await migrate(postgres.url("owner", DATABASE))
        await temporal.start()
        await partner.start()
        # The worker's metrics and probes on a free loopback port: a fixed one could be taken on a laptop.
        settings = Settings(_env_file=None, temporal_address=temporal.address, **postgres.urls(DATABASE),
                            work_dir=STATE / "work", http_bind_address="127.0.0.1", http_port=free_port(),
                            **DEMO_PACE)
        _write_local_env(settings)
        destinations = await _seed(postgres, partner)
        temporal_client = await connect_temporal(settings)
        client = ExportsClient.from_settings(settings, temporal_client)
        try:
            # Before any worker runs: an export canceled while it is queued, deterministically.
            queued = await _create(client, destinations["enabled"], "cancel while queued", Status.CANCELED)
            queued.expected_cancel = CancellationOutcome.CANCELED_WHILE_QUEUED
            queued.cancel_outcome = (await _cancel(client, queued)).outcome

            worker = await _start_worker(settings)
            await install_schedules(temporal_client, settings)
            console.print(f"worker pid {worker.pid}, metrics http://127.0.0.1:{settings.http_port}/metrics; "
                          f"Temporal UI: [link]{temporal.ui_url}[/link]")
            exports = await _run_demo(client, temporal_client, destinations, [queued])
            ok = await _verify(exports, partner.root)
        finally:
            await client.close()
        _print_summary(exports, temporal.ui_url, ok)
        if not run_once:
            console.print(f"\nThe stack stays up for you: Temporal UI {temporal.ui_url}, partner files in "
                          f"{partner.root}/outbound, `.venv/bin/exports show <id>`. Ctrl-C stops everything.")
            await _wait_for_interrupt()
        return 0 if ok else 1
    finally:
        console.print("stopping ...")
        if worker is not None:
            await processes.stop(worker, timeout=15)
        await partner.stop()
        await temporal.stop()
        postgres.stop()
        LOCAL_ENV_FILE.unlink(missing_ok=True)


async def _ensure_database(postgres: LocalPostgres) -> None:
    admin = await asyncpg.connect(asyncpg_dsn(postgres.url("owner")))
    try:
        if not await admin.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", DATABASE):
            await admin.execute(f"CREATE DATABASE {DATABASE}")
    finally:
        await admin.close()


class _PartnerFields(TypedDict):
    """Where the local partner is and how to reach it, as both demo destinations name it."""

    host: str
    port: int
    username: str
    final_dir: str
    temp_dir: str
    host_key: str
    credential_ref: str


async def _seed(postgres: LocalPostgres, partner: LocalPartner) -> dict[str, uuid.UUID]:
    """The demo tenant's contacts once; its destinations every run, since the partner's port changes."""
    conn = await asyncpg.connect(asyncpg_dsn(postgres.url("owner", DATABASE)))
    try:
        if not await conn.fetchval("SELECT 1 FROM contacts WHERE tenant_id = $1 LIMIT 1", DEMO_TENANT):
            await seed_contacts(conn, DEMO_TENANT, DEMO_CONTACTS)
        dest = partner.destination()
        fields = _PartnerFields(host=dest.host, port=dest.port, username=dest.username, final_dir=dest.final_dir,
                                temp_dir=dest.temp_dir, host_key=dest.host_key, credential_ref=dest.credential_ref)
        return {
            # The local partner offers check-file-name, so the demo's deliveries are confirmed by its SHA-256.
            "enabled": await seed_destination(conn, DEMO_TENANT, name="demo partner", hash_evidence="check_file",
                                              destination_id=DEMO_DESTINATION, **fields),
            "disabled": await seed_destination(conn, DEMO_TENANT, name="paused partner", enabled=False,
                                               destination_id=PAUSED_DESTINATION, **fields),
        }
    finally:
        await conn.close()


def _write_local_env(settings: Settings) -> None:
    """So that `exports show` in another terminal finds this stack."""
    names = ("database_url", "dispatcher_database_url", "reconciliation_database_url", "owner_database_url",
             "temporal_address")
    LOCAL_ENV_FILE.write_text("".join(f"EXPORTS_{n.upper()}={getattr(settings, n)}\n" for n in names))


async def _start_worker(settings: Settings) -> asyncio.subprocess.Process:
    return await processes.spawn(sys.executable, "-m", "worker", log_path=STATE / "worker.log",
                                 env={**os.environ, **as_env(settings)})



async def _create(client: ExportsClient, destination: uuid.UUID, label: str, expected: Status) -> DemoExport:
    """The row and its wake-up only (`exports create`); the dispatcher starts the workflow when a worker runs."""
    job_id = await client.create(tenant_id=DEMO_TENANT, destination_id=destination, created_by="demo@make-run")
    return DemoExport(label=label, expected=expected, job_id=job_id)


async def _start(client: ExportsClient, destination: uuid.UUID, label: str, expected: Status) -> DemoExport:
    """A platform team's way: a plain Temporal client call; the workflow creates the row and returns its state."""
    handle = await client.start(tenant_id=DEMO_TENANT, destination_id=destination, created_by="platform-team@demo")
    return DemoExport(label=label, expected=expected, job_id=uuid.UUID(job_id_of(handle.id)))


async def _cancel(client: ExportsClient, export: DemoExport) -> CancellationResult:
    return await client.cancel(tenant_id=DEMO_TENANT, job_id=export.job_id, requested_by="operator@make-run",
                               reason=f"demo: {export.label}")


async def _run_demo(
    client: ExportsClient, temporal: Client, destinations: dict[str, uuid.UUID], exports: list[DemoExport]
) -> list[DemoExport]:
    enabled = destinations["enabled"]
    exports += [await _start(client, enabled, f"plain export {n}", Status.COMPLETED) for n in (1, 2, 3)]
    exports.append(await _start(client, destinations["disabled"], "disabled destination", Status.REJECTED))
    building = await _start(client, enabled, "cancel while building", Status.STOPPED)
    building.expected_cancel = CancellationOutcome.STOP_REQUESTED
    late = await _start(client, enabled, "cancel after cutoff 2", Status.COMPLETED)
    late.expected_cancel = CancellationOutcome.TOO_LATE
    exports += [building, late]
    exports.append(await _create(client, enabled, "created with `exports create`", Status.COMPLETED))

    async def cancel_when(export: DemoExport, statuses: set[Status]) -> None:
        row = await _wait_for(client, export.job_id, lambda r: r.status in statuses)
        if row.status in statuses:
            export.cancel_outcome = (await _cancel(client, export)).outcome

    with Live(_table(exports), console=console, refresh_per_second=4) as live:
        async def refresh() -> None:
            while True:
                for export in exports:
                    export.row = await client.store.read_job(export.job_id)
                live.update(_table(exports))
                await asyncio.sleep(0.25)

        refresher = asyncio.create_task(refresh())
        try:
            await asyncio.wait_for(asyncio.gather(
                cancel_when(building, {Status.RUNNING}),
                cancel_when(late, {Status.DELIVERING, Status.COMPLETED}),
            ), timeout=TIMEOUT)
            for export in exports:
                await _wait_for(client, export.job_id, lambda r: r.status.is_settled)
                handle = temporal.get_workflow_handle(export_workflow_id(export.job_id), result_type=ExportResult)
                export.result = await asyncio.wait_for(handle.result(), timeout=TIMEOUT)
        finally:
            refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await refresher
            for export in exports:
                export.row = await client.store.read_job(export.job_id)
            live.update(_table(exports))
    return exports


async def _wait_for(client: ExportsClient, job_id: uuid.UUID, predicate: Callable[[JobRow], bool]) -> JobRow:
    async with asyncio.timeout(TIMEOUT):
        while True:
            row = await client.store.read_job(job_id)
            if row is not None and predicate(row):
                return row
            await asyncio.sleep(0.1)


def _table(exports: list[DemoExport]) -> Table:
    table = Table("export", "job", "status", "attempts", "cancellation", "workflow result", "expected")
    for e in exports:
        row = e.row
        status = row.status.value if row else "?"
        if row and row.failure_reason:
            status += f" ({row.failure_reason.value})"
        table.add_row(e.label, str(e.job_id)[:8], status, str(row.attempt_count if row else ""),
                      e.cancel_outcome.value if e.cancel_outcome else "",
                      e.result.status.value if e.result else "", e.expected.value)
    return table


async def _verify(exports: list[DemoExport], partner_root: Path) -> bool:
    """Every export as expected, and the partner holds exactly the files of the completed ones."""
    ok = True
    for e in exports:
        row = e.row
        if row is None or row.status is not e.expected:
            e.notes.append(f"expected {e.expected.value}, found {row.status.value if row else 'no row'}")
            ok = False
        if e.result is None or e.result.status is not e.expected:
            e.notes.append(f"its workflow returned {e.result.status.value if e.result else 'nothing'}")
            ok = False
        if e.expected_cancel is not None and e.cancel_outcome is not e.expected_cancel:
            e.notes.append(f"cancellation expected {e.expected_cancel.value}, got {e.cancel_outcome}")
            ok = False
        if row is None:
            continue
        assert row.final_name is not None  # written at creation by this release (None only in 0.1.0's rows)
        final = partner_root / "outbound" / row.final_name
        if row.status is Status.COMPLETED:
            if not final.exists():
                e.notes.append("no file at the partner")
                ok = False
            else:
                data = final.read_bytes()
                if (len(data), hashlib.sha256(data).digest()) != (row.expected_file_bytes, row.expected_file_sha256):
                    e.notes.append("the partner's file does not match the job's expected file")
                    ok = False
                if row.confirmed_by != "sha256":  # the row's own record of what confirmed it
                    e.notes.append(f"confirmed by {row.confirmed_by}, not the partner's check-file SHA-256")
                    ok = False
        elif final.exists():
            e.notes.append("a file reached the partner for an export that did not complete")
            ok = False
    leftovers = list((partner_root / "incoming-tmp").glob("*"))
    if leftovers:
        ok = False
        exports[0].notes.append(f"temporary files left at the partner: {[p.name for p in leftovers]}")
    return ok


def _print_summary(exports: list[DemoExport], ui_url: str, ok: bool) -> None:
    console.print()
    for e in exports:
        for note in e.notes:
            console.print(f"  {e.label}: {note}")
    # What the README's commands need, in full: `exports show <job id>`, `--tenant <tenant id>`.
    console.print(f"demo tenant: {DEMO_TENANT}", markup=False)
    for e in exports:
        console.print(f"  {e.job_id}  {e.label}", markup=False)
    verdict = "[green]every export ended as expected[/]" if ok else "[red]some exports did not end as expected[/]"
    console.print(f"{verdict}; inspect them in the Temporal UI: {ui_url}")


async def _wait_for_interrupt() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
