"""Fixtures for the real components: PostgreSQL (embedded, or EXPORTS_TEST_DATABASE_URL), the Temporal dev
server (or EXPORTS_TEST_TEMPORAL_ADDRESS), and an SFTP partner. Each test gets a fresh database copied from a
migrated template.

EXPORTS_TEST_DATABASE_URL (a superuser's postgresql+asyncpg:// URL of an existing server) runs the suite there
instead of the embedded server: the session creates its own template database and drops it at the end, each test
its own copy, and the roles exports_app, exports_dispatcher and exports_reconciler when missing (with the URL's
password, if it has one). The roles connect as the URL says, with its password: roles that already exist must
accept it, or be trusted by pg_hba.conf. The tests that cut connections with tests/helpers/faults.py reach the server
through its Unix socket when the URL's host is the socket's directory (`?host=/run/postgresql`), else through its
TCP port.

EXPORTS_TEST_BACKEND=testcontainers (tests/helpers/containers.py) puts PostgreSQL and the Temporal dev server in Docker
containers instead of the embedded servers; the EXPORTS_TEST_* URLs above still win for what they name."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from starter.localstack.partner import LocalPartner
from starter.localstack.postgres import ROLES, LocalPostgres, role_urls
from starter.localstack.temporal import TEMPORAL_FAIRNESS, temporal_binary
from store.db import asyncpg_dsn, make_engine, migrate
from store.jobs import JobStore
from store.settings import Settings
from tests.helpers import containers
from tests.helpers.support import temporary_postgres
from workflows.identity import SEARCH_ATTRIBUTES

TEMPLATE = "exports_template"
APP_ROLES = ("app", "dispatcher", "reconciler")


class ExternalPostgres:
    """An existing server, reached with a superuser's URL (EXPORTS_TEST_DATABASE_URL); the same URLs per role
    as LocalPostgres gives. Nothing to start or stop."""

    def __init__(self, url: str) -> None:
        if url.startswith("postgresql://"):
            url = "postgresql+asyncpg://" + url[len("postgresql://"):]
        if not url.startswith("postgresql+asyncpg://"):
            raise pytest.UsageError("EXPORTS_TEST_DATABASE_URL must be a postgresql+asyncpg:// (or postgresql://) URL")
        self._url = make_url(url)
        host = self._url.query.get("host")
        # The fault proxy (tests/helpers/faults.py) needs the server's socket directory; a TCP-only URL has none.
        self.socket_dir = host if isinstance(host, str) and host.startswith("/") else ""
        self.pid: int | None = None

    @property
    def password(self) -> str | None:
        return self._url.password

    def url(self, role: str = "owner", database: str | None = None) -> str:
        url = self._url if database is None else self._url.set(database=database)
        if role != "owner":
            url = url.set(username=ROLES[role])
        return url.render_as_string(hide_password=False)

    def urls(self, database: str) -> dict[str, str]:
        return role_urls(self.url, database)

    def stop(self) -> None:
        pass  # not ours to stop


PgServer = LocalPostgres | ExternalPostgres


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    external = os.environ.get("EXPORTS_TEST_DATABASE_URL", "").strip()
    if external:
        yield ExternalPostgres(external)
        return
    if containers.wanted():
        with containers.postgres_url() as url:
            yield ExternalPostgres(url)
        return
    with temporary_postgres() as server:
        yield server


async def _create_missing_roles(admin: asyncpg.Connection, password: str | None) -> None:
    """On an existing server, the application roles the migration would otherwise create without a password."""
    for role in APP_ROLES:
        name = ROLES[role]
        if await admin.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", name):
            continue
        clause = "" if password is None else " PASSWORD " + await admin.fetchval("SELECT quote_literal($1)", password)
        await admin.execute(f'CREATE ROLE "{name}" LOGIN{clause}')


@pytest.fixture(scope="session")
async def template_db(pg_server: PgServer) -> AsyncIterator[str]:
    # On a shared server, a name of this session's own: another run may be using its template at the same time.
    name = f"{TEMPLATE}_{uuid.uuid4().hex[:8]}" if isinstance(pg_server, ExternalPostgres) else TEMPLATE
    admin = await asyncpg.connect(asyncpg_dsn(pg_server.url("owner")))
    try:
        await admin.execute(f"DROP DATABASE IF EXISTS {name}")
        await admin.execute(f"CREATE DATABASE {name}")
        if isinstance(pg_server, ExternalPostgres):
            await _create_missing_roles(admin, pg_server.password)
    finally:
        await admin.close()
    await migrate(pg_server.url("owner", name))
    yield name
    if isinstance(pg_server, ExternalPostgres):
        admin = await asyncpg.connect(asyncpg_dsn(pg_server.url("owner")))
        try:
            await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        finally:
            await admin.close()


@dataclass
class TestDatabase:
    __test__ = False  # a fixture's value, not a test class, where a test module imports it

    name: str
    server: PgServer
    admin: asyncpg.Connection  # superuser, for arranging and asserting; never how the application connects

    def url(self, role: str) -> str:
        return self.server.url(role, self.name)

    def settings(self, **overrides: object) -> Settings:
        values: dict[str, object] = {
            **self.server.urls(self.name),
            "lease_seconds": 5.0,
            "renew_every_seconds": 1.0,
            "dispatcher_poll_seconds": 0.5,
            "reread_timeout_seconds": 2.0,
            "lock_timeout_ms": 500,
            # No HTTP port unless a test asks for one: many workers run at once, and one fixed port fits one.
            "http_port": 0,
        }
        values.update(overrides)
        return Settings(_env_file=None, **values)

    async def connect(self, role: str) -> asyncpg.Connection:
        return await asyncpg.connect(asyncpg_dsn(self.url(role)))


@pytest.fixture
async def db(pg_server: PgServer, template_db: str) -> AsyncIterator[TestDatabase]:
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(asyncpg_dsn(pg_server.url("owner")))
    await admin.execute(f"CREATE DATABASE {name} TEMPLATE {template_db}")
    await admin.close()
    conn = await asyncpg.connect(asyncpg_dsn(pg_server.url("owner", name)))
    try:
        yield TestDatabase(name=name, server=pg_server, admin=conn)
    finally:
        await conn.close()
        admin = await asyncpg.connect(asyncpg_dsn(pg_server.url("owner")))
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await admin.close()


@pytest.fixture
async def app_engine(db: TestDatabase) -> AsyncIterator[AsyncEngine]:
    engine = make_engine(db.url("app"))
    try:
        yield engine
    finally:
        await engine.dispose()


@pytest.fixture
async def reconciler(db: TestDatabase) -> AsyncIterator[AsyncEngine]:
    """The reconciliation role's engine: reconciliations and corrections run as it, and only as it."""
    engine = make_engine(db.url("reconciler"))
    try:
        yield engine
    finally:
        await engine.dispose()


@pytest.fixture
def store(app_engine: AsyncEngine, db: TestDatabase) -> JobStore:
    settings = db.settings()
    return JobStore(
        app_engine,
        lease_seconds=settings.lease_seconds,
        lock_timeout_ms=settings.lock_timeout_ms,
        reread_timeout_seconds=settings.reread_timeout_seconds,
    )


@pytest.fixture
async def partner(tmp_path: Path) -> AsyncIterator[LocalPartner]:
    """A real SFTP partner of the test's own (an asyncssh server with fault hooks), started and stopped in bounds."""
    p = LocalPartner(tmp_path / "partner")
    await asyncio.wait_for(p.start(), 30)
    try:
        yield p
    finally:
        await asyncio.wait_for(p.stop(), 30)


async def _existing_temporal(address: str, namespace: str) -> WorkflowEnvironment:
    """A Temporal service that runs already (EXPORTS_TEST_TEMPORAL_ADDRESS), with the search attributes the
    workflows set registered on it if they are missing."""
    from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest

    client = await asyncio.wait_for(Client.connect(address, namespace=namespace,
                                                   data_converter=pydantic_data_converter), 30)
    listed = await client.operator_service.list_search_attributes(ListSearchAttributesRequest(namespace=namespace))
    missing = {key.name: int(key.indexed_value_type)
               for key in SEARCH_ATTRIBUTES if key.name not in listed.custom_attributes}
    if missing:
        await client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(namespace=namespace, search_attributes=missing))
    return WorkflowEnvironment.from_client(client)


@pytest.fixture(scope="session")
async def temporal_env() -> AsyncIterator[WorkflowEnvironment]:
    """The Temporal dev server from the wheel, or, with EXPORTS_TEST_TEMPORAL_ADDRESS, a service that runs already
    (its namespace EXPORTS_TEST_TEMPORAL_NAMESPACE, `default` when unset): each test's task queue and workflow IDs
    are its own, so a shared service is fine. A few tests start dev servers of their own regardless (the chaos
    run restarts its server; the connection tests need one they can stop)."""
    address = os.environ.get("EXPORTS_TEST_TEMPORAL_ADDRESS", "")
    if address:
        yield await _existing_temporal(address, os.environ.get("EXPORTS_TEST_TEMPORAL_NAMESPACE") or "default")
        return
    if containers.wanted():
        async with containers.temporal_address() as address:
            yield await _existing_temporal(address, "default")
        return
    env = await WorkflowEnvironment.start_local(
        data_converter=pydantic_data_converter,
        dev_server_existing_path=temporal_binary(),
        search_attributes=SEARCH_ATTRIBUTES,
        dev_server_extra_args=list(TEMPORAL_FAIRNESS),
        dev_server_log_level="error",
    )
    try:
        yield env
    finally:
        await env.shutdown()


@pytest.fixture
def client(temporal_env: WorkflowEnvironment) -> Client:
    return temporal_env.client


def pytest_configure(config: pytest.Config) -> None:
    if containers.wanted():
        containers.require_docker()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    from tests.helpers.support import CHAOS_REPORT

    for reports in terminalreporter.stats.values():
        for report in reports:
            for name, value in getattr(report, "user_properties", ()):
                if name == CHAOS_REPORT and getattr(report, "when", "") == "call":
                    terminalreporter.write_sep("=", "chaos report")
                    terminalreporter.write_line(value)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("EXPORTS_CHAOS") == "1":
        return
    skip = pytest.mark.skip(reason="chaos run: set EXPORTS_CHAOS=1 to include it")
    for item in items:
        # The marker, not the keyword: every test under tests/chaos/ has "chaos" among its keywords (its package's
        # name), and the checker's own tests there run in the default suite.
        if item.get_closest_marker("chaos") is not None:
            item.add_marker(skip)


# --- one export's world: worker, partner, tenant ------------------------------------------------------------------

from contextlib import AsyncExitStack  # noqa: E402

from tests.helpers.harness import Harness, open_harness  # noqa: E402


@pytest.fixture
async def harness(db, store, client, tmp_path) -> AsyncIterator[Harness]:
    async with AsyncExitStack() as stack:
        yield await open_harness(stack, db, store, client, tmp_path)


@pytest.fixture
async def quiet_harness(db, store, client, tmp_path) -> AsyncIterator[Harness]:
    async with AsyncExitStack() as stack:
        yield await open_harness(stack, db, store, client, tmp_path, dispatcher=False)


@pytest.fixture
async def slow_build_harness(db, store, client, tmp_path) -> AsyncIterator[Harness]:
    # About 180 kB of contacts at 40 kB/s: several seconds of building to stop.
    async with AsyncExitStack() as stack:
        yield await open_harness(stack, db, store, client, tmp_path, contacts=2000,
                                 build_throttle_bytes_per_second=40_000)


@pytest.fixture
async def slow_upload_harness(db, store, client, tmp_path) -> AsyncIterator[Harness]:
    async with AsyncExitStack() as stack:
        yield await open_harness(stack, db, store, client, tmp_path, contacts=2000,
                                 upload_throttle_bytes_per_second=40_000)
