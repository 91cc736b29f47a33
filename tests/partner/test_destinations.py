"""HI7: a destination is validated when it is written (`exports destinations add` and `update`), `check` connects
with the pinned key and says what it found, and an export to a destination whose contract is not valid is Rejected
before its claim. LV3: the evidence by content a contract names is asked of the partner (writing nothing there)
when it is written and when it is checked, and a method the partner does not offer (check_file on OpenSSH) is
refused in one line."""

from __future__ import annotations

import asyncio
import logging
import uuid
from pathlib import Path

import asyncssh
import pytest
from typer.testing import CliRunner

from starter.localstack.partner import LocalPartner
from starter.localstack.ports import free_port
from store.models import Status
from store.settings import get_settings
from tests.helpers.harness import Harness
from tests.helpers.openssh_partner import OpenSshPartner
from tests.helpers.support import Ran, exports_command
from workflows.identity import export_workflow_id


@pytest.fixture
def env(db) -> dict[str, str]:
    return {f"EXPORTS_{k.upper()}": v for k, v in db.server.urls(db.name).items()}


async def run(env: dict[str, str], *args: str):
    """`exports destinations ...`, in a thread of its own since it runs its own event loop as in its own process."""
    from starter.destinations import destinations_app

    def invoke():
        get_settings.cache_clear()
        try:
            return CliRunner().invoke(destinations_app, list(args), env=env)
        finally:
            get_settings.cache_clear()

    return await asyncio.to_thread(invoke)


def options(partner: LocalPartner, tenant: uuid.UUID, **overrides: str) -> list[str]:
    """The options of an `add` that reaches the local partner; `overrides` by option name (host_key=...)."""
    values = {"tenant": str(tenant), "name": "partner", "host": partner.host, "port": str(partner.port),
              "username": "partner", "final_dir": "/outbound", "temp_dir": "/incoming-tmp",
              "host_key": partner.host_key_line, "credential_ref": f"file:{partner.client_key_path}"}
    values.update(overrides)
    return [part for name, value in values.items() for part in (f"--{name.replace('_', '-')}", value)]


def one_line(stream: str) -> str:
    lines = stream.strip().splitlines()
    assert len(lines) == 1, stream
    return lines[0]


def assert_refused(result, *expected: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    line = one_line(result.stderr)
    assert line.startswith("error: "), line
    for fragment in expected:
        assert fragment in line, line
    assert result.stdout == "", result.stdout


async def destination_rows(db) -> list[dict]:
    return [dict(r) for r in await db.admin.fetch("SELECT * FROM destinations ORDER BY id")]


def new_key_line(algorithm: str = "ssh-ed25519") -> str:
    return asyncssh.generate_private_key(algorithm).export_public_key().decode().strip()


def fingerprint(line: str) -> str:
    return asyncssh.import_public_key(line).get_fingerprint()


def text_file(partner: LocalPartner) -> Path:
    path = partner.root.parent / "not-a-key.txt"
    path.write_text("hello\n")
    return path


# --- add and update refuse what the delivery could not act on --------------------------------------------------

ADD_REFUSALS = {
    "host key as a known_hosts line": (
        lambda p: {"host_key": f"[{p.host}]:{p.port} {p.host_key_line}"}, ("host_key", "known_hosts")),
    "host key after a host name": (lambda p: {"host_key": f"sftp.partner.example {p.host_key_line}"},
                                   ("host_key", "known_hosts")),
    "host key with options": (lambda p: {"host_key": f'from="10.0.0.1" {p.host_key_line}'},
                              ("host_key", "options")),
    "host key garbage": (lambda p: {"host_key": "not a key at all"}, ("host_key", "not an OpenSSH public key")),
    "host key of two lines": (lambda p: {"host_key": f"{p.host_key_line}\n{p.host_key_line}"},
                              ("host_key", "control")),
    "host key whose type lies": (lambda p: {"host_key": "ssh-rsa " + p.host_key_line.split()[1]}, ("host_key",)),
    "temp_dir equal to final_dir": (lambda p: {"final_dir": "/out", "temp_dir": "/out"}, ("temp_dir", "final_dir")),
    "temp_dir equal to final_dir, normalised": (lambda p: {"final_dir": "/out", "temp_dir": "/out/"},
                                                ("temp_dir", "final_dir")),
    "temp_dir equal to final_dir, with dots": (lambda p: {"final_dir": "/out/", "temp_dir": "/a/../out/."},
                                               ("temp_dir", "final_dir")),
    "temp_dir inside final_dir": (lambda p: {"final_dir": "/out", "temp_dir": "/out/tmp"},
                                  ("temp_dir", "inside final_dir")),
    "relative final_dir": (lambda p: {"final_dir": "outbound"}, ("final_dir", "absolute")),
    "credential_ref of an unknown scheme": (lambda p: {"credential_ref": "vault:secret/partner"},
                                            ("credential_ref", "'vault'", "file:<path> or env:<VAR>")),
    "credential_ref without a scheme": (lambda p: {"credential_ref": str(p.client_key_path)},
                                        ("credential_ref", "file:<path> or env:<VAR>")),
    "credential_ref to a missing file": (lambda p: {"credential_ref": "file:/nonexistent/partner_key"},
                                         ("credential_ref", "/nonexistent/partner_key", "no such file")),
    "credential_ref to a file that holds no key": (lambda p: {"credential_ref": f"file:{p.root}"},
                                                   ("credential_ref", "not a regular file")),
    "credential_ref to a file that is not a private key": (lambda p: {"credential_ref": f"file:{text_file(p)}"},
                                                           ("credential_ref", "no private key")),
    "credential_ref naming no variable": (lambda p: {"credential_ref": "env:1-not-a-name"},
                                          ("credential_ref", "environment variable name")),
    "port zero": (lambda p: {"port": "0"}, ("port", "1 to 65535")),
    "port not a number": (lambda p: {"port": "22x"}, ("port", "whole number")),
    "unknown hash evidence": (lambda p: {"hash_evidence": "md5"}, ("hash_evidence", "none, read_back, check_file")),
    "temporary files kept too briefly": (lambda p: {"temp_file_max_age_seconds": "3600"},
                                         ("temp_file_max_age_seconds", "43200")),
    "terminal escape in the name": (lambda p: {"name": "partner\x1b[2J"}, ("name", "control")),
    "NUL in the username": (lambda p: {"username": "part\x00ner"}, ("username", "control")),
    "over-long name": (lambda p: {"name": "n" * 201}, ("name", "200")),
    "host with a space": (lambda p: {"host": "127.0.0.1 -oProxyCommand=x"}, ("host",)),
    "relative acknowledgment_dir": (lambda p: {"acknowledgment_dir": "acks"}, ("acknowledgment_dir", "absolute")),
}


@pytest.mark.spec("HI7")
@pytest.mark.parametrize("case", list(ADD_REFUSALS))
async def test_add__refuses_a_destination_the_delivery_could_not_act_on_and_writes_nothing(db, env, partner, case):
    overrides, expected = ADD_REFUSALS[case]
    before = await destination_rows(db)
    result = await run(env, "add", *options(partner, uuid.uuid4(), **overrides(partner)))
    assert_refused(result, *expected)
    assert await destination_rows(db) == before


@pytest.mark.spec("HI7")
async def test_add__refusal_never_echoes_a_credential_ref_that_may_be_a_secret(db, env, partner):
    secret = "-----BEGIN OPENSSH PRIVATE KEY-----b3BlbnNzaC1rZXktdjEAAAAA"
    result = await run(env, "add", *options(partner, uuid.uuid4(), credential_ref=secret))
    assert_refused(result, "credential_ref")
    assert "b3BlbnNzaC1rZXktdjEAAAAA" not in result.stderr and await destination_rows(db) == []


@pytest.mark.spec("HI7")
async def test_update__refuses_the_same_and_leaves_the_row_as_it_was(db, env, partner):
    tenant = uuid.uuid4()
    added = await run(env, "add", *options(partner, tenant))
    assert added.exit_code == 0, added.output
    destination = added.stdout.strip()
    before = await destination_rows(db)
    for change, expected in (
        (["--host-key", f"[{partner.host}]:{partner.port} {partner.host_key_line}"], ("host_key", "known_hosts")),
        (["--temp-dir", "/outbound/"], ("temp_dir", "final_dir")),
        (["--final-dir", "/incoming-tmp"], ("temp_dir", "final_dir")),
        (["--credential-ref", "vault:partner"], ("credential_ref", "'vault'")),
        (["--hash-evidence", "sha1"], ("hash_evidence",)),
    ):
        assert_refused(await run(env, "update", destination, "--tenant", str(tenant), *change), *expected)
    assert_refused(await run(env, "update", destination, "--tenant", str(uuid.uuid4()), "--port", "2222"),
                   "not found for tenant")
    assert_refused(await run(env, "update", destination, "--tenant", str(tenant)), "nothing to change")
    assert await destination_rows(db) == before


# --- a valid destination: written, listed, checked --------------------------------------------------------------


@pytest.mark.spec("HI7")
async def test_add_list_update_and_check__against_the_local_partner(db, env, partner):
    tenant = uuid.uuid4()
    added = await run(env, "add", *options(partner, tenant), "--hash-evidence", "check_file",
                      "--temp-file-max-age-seconds", "86400")
    assert added.exit_code == 0, added.output
    destination = uuid.UUID(one_line(added.stdout))
    row = await db.admin.fetchrow("SELECT * FROM destinations WHERE id = $1", destination)
    assert (row["tenant_id"], row["host_key"], row["credential_ref"], row["hash_evidence"],
            row["temp_file_max_age_seconds"], row["enabled"]) == (
        tenant, partner.host_key_line, f"file:{partner.client_key_path}", "check_file", 86400, True)

    (partner.final_dir / "already-there.csv").write_bytes(b"x\n")
    checked = await run(env, "check", str(destination), "--tenant", str(tenant))
    assert checked.exit_code == 0, (checked.stdout, checked.stderr)
    assert checked.stderr == ""
    facts = checked.stdout.splitlines()
    expected = [
        "contract: valid",
        f"credential: file:{partner.client_key_path} holds an ssh-ed25519 key",
        (f"host key: {partner.host}:{partner.port} presented the pinned ssh-ed25519 key "
         f"({fingerprint(partner.host_key_line)})"),
        "login: accepted as partner",
        "final_dir /outbound: a directory, 1 entry",
        "temp_dir /incoming-tmp: a directory, 0 entries",
        "hash_evidence check_file: the partner answers check-file-name",
        f"ok: destination {destination} is reachable and its directories are there",
    ]
    for fact in expected:
        assert any(line.startswith(fact) for line in facts), (fact, facts)
    # The check only looks: nothing written at the partner.
    assert sorted(p.name for p in partner.final_dir.iterdir()) == ["already-there.csv"]
    assert list(partner.temp_dir.iterdir()) == []

    (partner.root / "acks").mkdir()  # an acknowledgment_dir is asked of the partner when it is written
    updated = await run(env, "update", str(destination), "--tenant", str(tenant), "--disabled",
                        "--acknowledgment-dir", "/acks", "--name", "renamed partner")
    assert updated.exit_code == 0, updated.output
    row = await db.admin.fetchrow("SELECT * FROM destinations WHERE id = $1", destination)
    assert (row["enabled"], row["acknowledgment_dir"], row["name"], row["hash_evidence"]) == (
        False, "/acks", "renamed partner", "check_file")

    listed = await run(env, "list", "--tenant", str(tenant))
    assert listed.exit_code == 0, listed.output
    line = one_line(listed.stdout)
    assert str(destination) in line and "renamed partner" in line and "disabled" in line
    assert f"file:{partner.client_key_path}" in line  # a reference: fine to show
    assert "PRIVATE KEY" not in listed.stdout
    assert one_line((await run(env, "list", "--tenant", str(uuid.uuid4()))).stdout) == "no destinations"


@pytest.mark.spec("HI7")
async def test_check__a_partner_with_another_host_key_fails_with_one_line_saying_what_it_offered(db, env, partner):
    tenant = uuid.uuid4()
    offered = f"ssh-ed25519 {fingerprint(partner.host_key_line)}"
    for pinned in (new_key_line("ssh-ed25519"), new_key_line("ecdsa-sha2-nistp256")):
        added = await run(env, "add", *options(partner, tenant, host_key=pinned))
        assert added.exit_code == 0, added.output
        checked = await run(env, "check", one_line(added.stdout), "--tenant", str(tenant))
        assert checked.exit_code == 1, (checked.stdout, checked.stderr)
        line = one_line(checked.stderr)
        assert line.startswith("failed: host key:") and offered in line and fingerprint(pinned) in line, line
        assert "login" not in checked.stdout  # nothing was offered to a server that is not the partner
    assert list(partner.final_dir.iterdir()) == [] and list(partner.temp_dir.iterdir()) == []


@pytest.mark.spec("HI7")
async def test_check__an_env_credential_is_looked_up_when_checked_not_when_added(db, env, partner):
    tenant = uuid.uuid4()
    added = await run(env, "add", *options(partner, tenant, credential_ref="env:EXPORTS_TEST_PARTNER_KEY"))
    assert added.exit_code == 0, added.output
    destination = one_line(added.stdout)
    unset = await run(env, "check", destination, "--tenant", str(tenant))
    assert unset.exit_code == 1
    assert one_line(unset.stderr).startswith("failed: credential:") and "EXPORTS_TEST_PARTNER_KEY" in unset.stderr
    key = partner.client_key_path.read_text()
    checked = await run({**env, "EXPORTS_TEST_PARTNER_KEY": key}, "check", destination, "--tenant", str(tenant))
    assert checked.exit_code == 0, (checked.stdout, checked.stderr)
    assert "credential: env:EXPORTS_TEST_PARTNER_KEY holds an ssh-ed25519 key" in checked.stdout
    assert key.strip().splitlines()[1] not in checked.stdout + checked.stderr


@pytest.mark.spec("HI7")
async def test_check__missing_directories_and_unknown_destinations(db, env, partner):
    tenant = uuid.uuid4()
    added = await run(env, "add", *options(partner, tenant, final_dir="/nowhere"))
    assert added.exit_code == 0, added.output
    checked = await run(env, "check", one_line(added.stdout), "--tenant", str(tenant))
    assert checked.exit_code == 1
    assert one_line(checked.stderr) == "failed: final_dir /nowhere: no such directory at the partner"
    assert_refused(await run(env, "check", str(uuid.uuid4()), "--tenant", str(tenant)), "not found for tenant")
    assert_refused(await run(env, "check", "nope", "--tenant", str(tenant)), "destination ID 'nope' is not a UUID")


@pytest.mark.spec("HI7")
async def test_add__only_the_owner_may_write_destinations(db, env, partner):
    as_app = {**env, "EXPORTS_OWNER_DATABASE_URL": env["EXPORTS_DATABASE_URL"]}
    result = await run(as_app, "add", *options(partner, uuid.uuid4()))
    assert result.exit_code == 4, (result.stdout, result.stderr)
    assert one_line(result.stderr).startswith("refused: ")
    assert await destination_rows(db) == []


# --- LV3: the evidence the contract names, asked of the partner (OpenSSH's sshd and sftp-server) -------------


def openssh_options(server: OpenSshPartner, tenant: uuid.UUID, **overrides: str) -> list[str]:
    """The options of an `add` that reaches the OpenSSH partner; `overrides` by option name."""
    d = server.destination()
    values = {"tenant": str(tenant), "name": "openssh partner", "host": d.host, "port": str(d.port),
              "username": d.username, "final_dir": d.final_dir, "temp_dir": d.temp_dir, "host_key": d.host_key,
              "credential_ref": d.credential_ref}
    values.update(overrides)
    return [part for name, value in values.items() for part in (f"--{name.replace('_', '-')}", value)]


async def destinations_command(db, cwd: Path, *args: str) -> Ran:
    """The real `exports destinations ...`, a process of its own, with this test's database."""
    return await exports_command(db.settings(), "destinations", *args, cwd=cwd, bound=90)


def assert_one_line_refusal(ran: Ran, code: int, prefix: str, *expected: str) -> str:
    assert ran.code == code, ran
    line = one_line(ran.stderr)
    assert line.startswith(prefix), line
    for fragment in expected:
        assert fragment in line, line
    return line


def partner_untouched(server: OpenSshPartner) -> None:
    assert list((server.root / "outbound").iterdir()) == [] and list((server.root / "incoming-tmp").iterdir()) == []


@pytest.mark.spec("LV3")
async def test_add_update_and_check__refuse_check_file_at_an_openssh_partner_in_one_line(db, openssh, tmp_path):
    tenant = uuid.uuid4()
    refused = await destinations_command(db, tmp_path, "add",
                                         *openssh_options(openssh, tenant, hash_evidence="check_file"))
    assert_one_line_refusal(refused, 2, "error: ", "check_file", "does not offer")
    assert refused.stdout == "" and await destination_rows(db) == []

    # read_back needs only reads, which no listing can prove without a file: accepted.
    added = await destinations_command(db, tmp_path, "add",
                                       *openssh_options(openssh, tenant, hash_evidence="read_back"))
    assert added.code == 0 and added.stderr == "", added
    destination = uuid.UUID(one_line(added.stdout))
    before = await destination_rows(db)
    assert [row["hash_evidence"] for row in before] == ["read_back"]

    updated = await destinations_command(db, tmp_path, "update", str(destination), "--tenant", str(tenant),
                                         "--hash-evidence", "check_file")
    assert_one_line_refusal(updated, 2, "error: ", "check_file", "does not offer")
    assert updated.stdout == "" and await destination_rows(db) == before

    # A row that names check_file all the same (written by SQL, or before this check): check fails in one line,
    # and the row can still be disabled and mended.
    await db.admin.execute("UPDATE destinations SET hash_evidence = 'check_file' WHERE id = $1", destination)
    checked = await destinations_command(db, tmp_path, "check", str(destination), "--tenant", str(tenant))
    assert_one_line_refusal(checked, 1, "failed: hash_evidence check_file", "does not offer")
    for change in (["--disabled"], ["--hash-evidence", "read_back", "--enabled"]):
        mended = await destinations_command(db, tmp_path, "update", str(destination), "--tenant", str(tenant),
                                            *change)
        assert mended.code == 0 and mended.stderr == "", mended
    checked = await destinations_command(db, tmp_path, "check", str(destination), "--tenant", str(tenant))
    assert checked.code == 0 and checked.stderr == "", checked
    partner_untouched(openssh)


@pytest.mark.spec("LV3")
async def test_add__an_acknowledgment_dir_the_partner_does_not_have_is_refused_in_one_line(db, openssh, tmp_path):
    tenant = uuid.uuid4()
    acks = str(openssh.root / "acks")
    refused = await destinations_command(db, tmp_path, "add",
                                         *openssh_options(openssh, tenant, acknowledgment_dir=acks))
    assert_one_line_refusal(refused, 2, "error: ", "acknowledgment_dir", acks, "no such directory")
    assert await destination_rows(db) == []
    (openssh.root / "acks").mkdir()
    added = await destinations_command(db, tmp_path, "add",
                                       *openssh_options(openssh, tenant, acknowledgment_dir=acks))
    assert added.code == 0 and added.stderr == "", added
    assert [row["acknowledgment_dir"] for row in await destination_rows(db)] == [acks]
    partner_untouched(openssh)


@pytest.mark.spec("LV3")
async def test_add__a_partner_not_reachable_from_here_is_written_with_a_warning_and_no_check_asks_nothing(
        db, openssh, tmp_path):
    tenant = uuid.uuid4()
    unreachable = await destinations_command(db, tmp_path, "add", *openssh_options(
        openssh, tenant, name="elsewhere", port=str(free_port()), hash_evidence="check_file"))
    assert unreachable.code == 0, unreachable
    uuid.UUID(one_line(unreachable.stdout))
    warning = one_line(unreachable.stderr)
    assert warning.startswith("warning: ") and "check_file" in warning and "exports destinations check" in warning
    # --no-check: written as given, nothing asked of the partner (one that will offer it later, say).
    unchecked = await destinations_command(db, tmp_path, "add", "--no-check",
                                           *openssh_options(openssh, tenant, hash_evidence="check_file"))
    assert unchecked.code == 0 and unchecked.stderr == "", unchecked
    assert sorted(row["hash_evidence"] for row in await destination_rows(db)) == ["check_file", "check_file"]
    partner_untouched(openssh)


# --- an export to a destination whose contract is not valid -------------------------------------------------


def scheduled_activities(history) -> list[str]:
    return [e.activity_task_scheduled_event_attributes.activity_type.name for e in history.events
            if e.HasField("activity_task_scheduled_event_attributes")]


@pytest.mark.spec("HI7")
@pytest.mark.parametrize(("column", "value", "expected"), [
    ("host_key", lambda p: f"[{p.host}]:{p.port} {p.host_key_line}", "known_hosts"),
    ("credential_ref", lambda p: "vault:secret/partner", "'vault'"),
])
async def test_export__to_a_destination_whose_contract_is_not_valid_is_rejected_before_its_claim(
        harness: Harness, caplog, column, value, expected):
    h = harness
    # Written by SQL as the owner, as rows from before validation may be: the table accepts it.
    await h.db.admin.execute(f"UPDATE destinations SET {column} = $1 WHERE id = $2", value(h.partner),
                             h.destination_id)
    caplog.set_level(logging.INFO, logger="activities.exports")
    job_id = await h.create()
    row = await h.settled(job_id)
    assert (row.status, row.attempt_count, row.attempt_id) == (Status.REJECTED, 0, None)
    events = await h.db.admin.fetchval("SELECT count(*) FROM export_attempt_events WHERE job_id = $1", job_id)
    assert events == 0
    history = await h.client.get_workflow_handle(export_workflow_id(job_id)).fetch_history()
    assert scheduled_activities(history) == ["claim_if_allowed"]  # evaluated, refused, nothing claimed
    assert list(h.partner.final_dir.iterdir()) == [] and list(h.partner.temp_dir.iterdir()) == []
    reasons = [m for m in (r.getMessage() for r in caplog.records) if str(job_id) in m and "rejected" in m]
    assert reasons and column in reasons[0] and expected in reasons[0], reasons
