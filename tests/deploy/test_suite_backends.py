"""The suite's opt-in backends: asking for containers where no Docker engine answers, or for a backend that does
not exist, is one clear line before any test or server starts."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from tests.helpers.support import run_command, temporary_postgres

ROOT = Path(__file__).resolve().parents[2]


async def run_suite_with(backend: str) -> tuple[int, str]:
    # A socket that cannot exist: the answer is the same on a machine that has a Docker engine.
    env = {**os.environ, "EXPORTS_TEST_BACKEND": backend, "DOCKER_HOST": "unix:///nonexistent/docker.sock"}
    for setting in ("EXPORTS_TEST_DATABASE_URL", "EXPORTS_TEST_TEMPORAL_ADDRESS"):
        env.pop(setting, None)
    ran = await run_command(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "tests/store/test_schema.py", env=env, cwd=ROOT, bound=120)
    return ran.code or 0, ran.stdout + ran.stderr


async def test_containers_without_a_docker_engine_stop_the_run_before_anything_starts():
    status, output = await run_suite_with("testcontainers")
    assert status == 4, output  # pytest's usage error: no test ran, none failed
    assert "EXPORTS_TEST_BACKEND=testcontainers needs a Docker engine, and none answers" in output
    assert "DOCKER_HOST=unix:///nonexistent/docker.sock" in output
    assert "passed" not in output and "failed" not in output


async def test_an_unknown_backend_is_a_usage_error():
    status, output = await run_suite_with("kubernetes")
    assert status == 4, output
    assert "EXPORTS_TEST_BACKEND='kubernetes': expected 'embedded' (the default) or 'testcontainers'" in output


def test_the_suites_own_postgres_is_stopped_and_its_folder_removed():
    """The suite's server (and every other started so) leaves no process and no data folder behind: each was 60 MB
    of /tmp a run, left there."""
    with temporary_postgres() as server:
        root, pid = server.data_dir.parent, server.pid
        assert (server.data_dir / "PG_VERSION").exists() and Path(f"/proc/{pid}").exists()
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    assert not root.exists(), sorted(p.name for p in root.iterdir())


async def test_servers_started_one_after_another_and_removed_leave_no_lock_folder_without_exit_handlers():
    """The wheel keeps an inter-process lock in a runtime folder (XDG_RUNTIME_DIR), read once per process and made
    again as it takes the lock: a process's own, removed when its last server stops, since the command line ends its
    processes without running exit handlers (exit_now), as this one does. Inside the first server's folder, it came
    back after that folder was removed, and stayed."""
    root = Path(tempfile.mkdtemp(prefix="exports-t-"))  # short: the servers' sockets live under it
    script = ("import shutil, sys; from pathlib import Path\n"
              "from activities.process.temporal import exit_now\n"
              "from starter.localstack.postgres import LocalPostgres\n"
              "for name in ('first', 'second'):\n"
              "    server = LocalPostgres(Path(sys.argv[1]) / name / 'data'); server.start(); server.stop()\n"
              "    shutil.rmtree(Path(sys.argv[1]) / name)\n"
              "exit_now(0)\n")
    env = {name: value for name, value in os.environ.items() if name != "XDG_RUNTIME_DIR"} | {"TMPDIR": str(root)}
    try:
        ran = await run_command(sys.executable, "-c", script, str(root), env=env, cwd=ROOT, bound=120)
        assert ran.code == 0, ran.stdout + ran.stderr
        assert sorted(p.name for p in root.rglob("*")) == [], sorted(str(p) for p in root.rglob("*"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
