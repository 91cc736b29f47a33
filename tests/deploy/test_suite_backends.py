"""The suite's opt-in backends: asking for containers where no Docker engine answers, or for a backend that does
not exist, is one clear line before any test or server starts."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.helpers.support import run_command

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
