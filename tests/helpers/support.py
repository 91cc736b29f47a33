"""Arranging data and waiting with a bound."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import asyncpg

from starter.localstack.postgres import LocalPostgres
from starter.localstack.seed import seed_contacts, seed_destination
from store.jobs import JobStore
from store.settings import Settings, as_env

# The name of the chaos run's report among its test's user properties, which conftest prints at the end of the
# session whether the run passed or failed: the properties reach the session's own process from any xdist worker.
CHAOS_REPORT = "chaos_report"

T = TypeVar("T")


@contextmanager
def temporary_postgres() -> Iterator[LocalPostgres]:
    """The wheel's PostgreSQL in a temporary folder of its own (short: the server's Unix socket lives under it),
    stopped by its PID afterwards, and the folder removed."""
    root = Path(tempfile.mkdtemp(prefix="exports-pg-"))
    server = LocalPostgres(root / "data")
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


async def seed_tenant(
    admin: asyncpg.Connection, *, contacts: int = 10, destination: dict | None = None
) -> tuple[uuid.UUID, uuid.UUID]:
    """A tenant with contacts and one destination (a placeholder one unless given)."""
    tenant_id = uuid.uuid4()
    await seed_contacts(admin, tenant_id, contacts)
    fields = destination or {
        "host": "127.0.0.1", "port": 22, "username": "exports", "final_dir": "/outbound",
        "temp_dir": "/incoming-tmp", "host_key": "ssh-ed25519 AAAA-placeholder", "credential_ref": "file:/none",
    }
    destination_id = await seed_destination(admin, tenant_id, name="partner", **fields)
    return tenant_id, destination_id


async def create_job(store: JobStore, tenant_id: uuid.UUID, destination_id: uuid.UUID) -> uuid.UUID:
    job_id = uuid.uuid4()
    await store.create_job(
        job_id=job_id, tenant_id=tenant_id, destination_id=destination_id,
        delivery_key=f"k{uuid.uuid4().hex[:12]}", created_by="tests",
    )
    return job_id


async def eventually(
    probe: Callable[[], Awaitable[T]], predicate: Callable[[T], bool], *, timeout: float = 20.0,
    interval: float = 0.05, what: str = "condition",
) -> T:
    """Poll `probe` until `predicate` holds; fail after `timeout` seconds with the last value seen."""
    deadline = time.monotonic() + timeout
    while True:
        value = await probe()
        if predicate(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout} s; last value: {value!r}")
        await asyncio.sleep(interval)


async def lock_row(dsn: str, job_id: uuid.UUID) -> asyncpg.Connection:
    """A connection (as `dsn`) holding the export's row lock in an open transaction, as a long statement elsewhere
    would; `unlock_row` ends it."""
    conn = await asyncpg.connect(dsn)
    await conn.execute("BEGIN")
    await conn.execute("SELECT 1 FROM export_jobs WHERE id = $1 FOR UPDATE", job_id)
    return conn


async def unlock_row(conn: asyncpg.Connection) -> None:
    if not conn.is_closed():
        await conn.execute("ROLLBACK")
        await conn.close()


def built_files(work_dir: object, job_id: uuid.UUID, attempt_id: uuid.UUID) -> list[Path]:
    """The local files the builds of one attempt wrote (one per build: <job>-<attempt>-<build token>.csv, and
    .csv.partial while it is written)."""
    return sorted(Path(str(work_dir)).glob(f"{job_id}-{attempt_id}-*.csv*"))


async def delivery_evidence(admin: asyncpg.Connection, job_id: uuid.UUID) -> list[str]:
    """The details (JSON text) of an export's DeliveryEvidence events, oldest first."""
    rows = await admin.fetch("SELECT detail FROM export_attempt_events WHERE job_id = $1 "
                             "AND kind = 'DeliveryEvidence' ORDER BY id", job_id)
    return [r["detail"] for r in rows]


def process_env(settings: Settings) -> dict[str, str]:
    """The environment of a process that reads exactly these settings (no EXPORTS_* or TEMPORAL_* of this one),
    whichever release it runs; its output unwrapped and uncoloured."""
    kept = {k: v for k, v in os.environ.items() if not k.startswith(("EXPORTS_", "TEMPORAL_"))}
    return {**kept, "TERM": "dumb", "COLUMNS": "250", **as_env(settings)}


class Ran:
    """How a command ended: its exit status, its output, and how long it took."""

    def __init__(self, code: int | None, stdout: str, stderr: str, seconds: float) -> None:
        self.code, self.stdout, self.stderr, self.seconds = code, stdout, stderr, seconds

    def __repr__(self) -> str:
        return f"exit {self.code} after {self.seconds:.1f} s\nstdout: {self.stdout!r}\nstderr: {self.stderr!r}"


async def run_command(*args: str, env: dict[str, str], cwd: Path, bound: float) -> Ran:
    """Run a command to its end, killed (and the test failed) if it has not ended within `bound` seconds."""
    started = time.monotonic()
    process = await asyncio.create_subprocess_exec(*args, env=env, cwd=cwd, stdout=asyncio.subprocess.PIPE,
                                                   stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(process.communicate(), bound)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise AssertionError(f"{args} did not end within {bound} s") from None
    return Ran(process.returncode, out.decode(errors="backslashreplace"), err.decode(errors="backslashreplace"),
               time.monotonic() - started)


# This checkout's `exports` command line.
EXPORTS = Path(sys.executable).parent / "exports"


async def exports_command(settings: Settings, *args: str, cwd: Path, bound: float = 60) -> Ran:
    """This checkout's `exports` with exactly these settings, run to its end within `bound`."""
    return await run_command(str(EXPORTS), *args, env=process_env(settings), cwd=cwd, bound=bound)


class Sampler:
    """A background task that calls `sample()` every `interval` seconds, from `start()` until `stop()`: a test's
    watch on a row or a run while something else happens."""

    interval = 0.05

    async def sample(self) -> None:
        raise NotImplementedError

    async def _run(self) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        self._task: asyncio.Task[None] | None = asyncio.create_task(self._run())

    async def stop(self) -> None:
        task, self._task = getattr(self, "_task", None), None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
