"""The real components a measure runs on, started in a folder of their own and stopped by PID afterwards:
PostgreSQL alone, or PostgreSQL, the Temporal dev server and the SFTP partner with a seeded tenant."""

from __future__ import annotations

import asyncio
import atexit
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg

from starter.localstack import processes
from starter.localstack.partner import LocalPartner
from starter.localstack.ports import free_port
from starter.localstack.postgres import LocalPostgres
from starter.localstack.seed import seed_contacts, seed_destination
from starter.localstack.temporal import LocalTemporal
from store.db import asyncpg_dsn, migrate
from store.settings import Settings, as_env

ROOT = Path(__file__).resolve().parents[1]
_RUN_FOLDER: Path | None = None
# Alembic's migration context is the process's own: measures that run at once (a smoke run) migrate in turn.
_ONE_MIGRATION_AT_ONCE = asyncio.Lock()


def bench_folder(name: str) -> Path:
    """A folder of its own for one measure, inside one folder for the whole run, removed when the process ends
    (and each measure's when it ends)."""
    global _RUN_FOLDER
    if _RUN_FOLDER is None:
        _RUN_FOLDER = Path(tempfile.mkdtemp(prefix="exports-bench-"))
        atexit.register(shutil.rmtree, _RUN_FOLDER, True)
    return Path(tempfile.mkdtemp(prefix=f"{name}-", dir=_RUN_FOLDER))


@asynccontextmanager
async def postgres_only(name: str) -> AsyncIterator[tuple[Path, LocalPostgres]]:
    """A migrated PostgreSQL in a temporary folder, removed afterwards."""
    folder = bench_folder(name)
    postgres = LocalPostgres(folder / "data")
    postgres.start()
    try:
        async with _ONE_MIGRATION_AT_ONCE:
            await migrate(postgres.url("owner"))
        yield folder, postgres
    finally:
        postgres.stop()
        shutil.rmtree(folder, ignore_errors=True)


@dataclass
class Stack:
    folder: Path
    postgres: LocalPostgres
    temporal: LocalTemporal
    partner: LocalPartner
    admin: asyncpg.Connection  # the owner's connection
    tenant: uuid.UUID
    destination: uuid.UUID  # at the partner
    processes: list[asyncio.subprocess.Process] = field(default_factory=list)

    def settings(self, **overrides: object) -> Settings:
        return Settings(**{"http_port": 0, **self.postgres.urls("postgres"), "temporal_address": self.temporal.address,
                           "work_dir": self.folder / "work", **overrides})

    async def spawn(self, *module_and_args: str, settings: Settings | None = None) -> None:
        """`python -m <module> <args>` in a process of its own, with the settings as its environment."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("EXPORTS_")}
        log_path = self.folder / f"{module_and_args[0].replace('.', '-')}-{len(self.processes)}.log"
        self.processes.append(await processes.spawn(
            sys.executable, "-m", *module_and_args, log_path=log_path,
            env={**env, **(as_env(settings) if settings else {})}, cwd=str(ROOT)))


@asynccontextmanager
async def full_stack(name: str, *, contacts: int) -> AsyncIterator[Stack]:
    """PostgreSQL, a Temporal dev server and the SFTP partner, with a tenant of `contacts` contacts and a
    destination at the partner; processes the measure spawns are stopped first."""
    async with postgres_only(name) as (folder, postgres):
        temporal = LocalTemporal(folder / "temporal", ui_port=free_port())
        partner = LocalPartner(folder / "partner")
        stack = None
        try:
            await temporal.start()
            await partner.start()
            admin = await asyncpg.connect(asyncpg_dsn(postgres.url("owner")))
            tenant = uuid.uuid4()
            await seed_contacts(admin, tenant, contacts)
            d = partner.destination()
            destination = await seed_destination(admin, tenant, name="bench", host=d.host, port=d.port,
                                                 username=d.username, final_dir=d.final_dir, temp_dir=d.temp_dir,
                                                 host_key=d.host_key, credential_ref=d.credential_ref)
            stack = Stack(folder, postgres, temporal, partner, admin, tenant, destination)
            yield stack
        finally:
            for process in stack.processes if stack else []:
                await processes.stop(process)
            if stack is not None:
                await stack.admin.close()
            await partner.stop()
            await temporal.stop()
