"""`exports destinations`: a partner's destination written, listed and checked.

`add` and `update` write as the owner role (EXPORTS_OWNER_DATABASE_URL): only the owner may write destinations.
Every write is checked first by `activities.destination.validate_destination`, the check that also makes the worker
reject an export to a destination that does not pass it, before its claim; and a `file:` credential must be a
private key readable here when it is written. An `env:` credential names a variable of the worker's environment,
so it is looked up by `check`, on the machine that checks, not when it is written.

Before `add` writes a contract that names evidence the partner must offer (hash_evidence check_file, an
acknowledgment_dir), and before `update` writes a change to that evidence or to how the partner is reached, it asks
the partner, writing nothing there: whether it answers check-file-name (OpenSSH's sftp-server never does), whether
the acknowledgment directory is there. A partner that answers no is refused (exit status 2, one line, nothing
written): every delivery there would end OutcomeUnknown. A partner that cannot be asked from here (not reachable,
another host key, an env: credential of the worker's environment) is written as before, with one warning line;
`--no-check` writes without asking. read_back and none need nothing the partner could be asked about.

`list` and `check` only read, as the application role (EXPORTS_DATABASE_URL), so that `check` runs where a worker
runs: it connects with the pinned host key and the credential, looks at the directories and the evidence the
contract names, and prints one line per fact it found. Bad input is one line on stderr, exit status 2, and nothing
is written.
"""

from __future__ import annotations

import asyncio
import os
import posixpath
import sys
import uuid
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import asyncssh
import typer
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from activities.destination import DestinationConfig, InvalidDestination, PartnerContract, validate_destination
from activities.partner_connection import HostKeyMismatch, connect, load_client_key, server_host_key
from activities.partner_delivery import TEMP_NAME
from activities.sftp_check_file import CheckFileError, check_file_sha256
from starter.client import InputError, parse_id
from starter.exits import EXIT_BAD_INPUT, EXIT_CHECK_FAILED, DatabaseFailure, answer, gist
from store import errors
from store.db import make_engine
from store.destinations import DestinationNotFound, Destinations
from store.jobs import JobStore
from store.settings import get_settings

T = TypeVar("T")

# What `add` writes when not told otherwise: the table's defaults.
DEFAULTS: dict[str, Any] = {"enabled": True, "name_and_size_identify": False, "hash_evidence": "none",
                            "acknowledgment_dir": None,
                            "temp_file_max_age_seconds": PartnerContract().temp_file_max_age_seconds}


# --- the store side -------------------------------------------------------------------------------------------


# The columns the partner is asked about (how it is reached, the evidence the contract names): an update that
# changes one of them, or enables the destination, asks again.
ASKED_FIELDS = ("host", "port", "username", "host_key", "credential_ref", "hash_evidence", "acknowledgment_dir")


async def add_destination(engine: AsyncEngine, tenant_id: uuid.UUID, values: Mapping[str, Any], *,
                          ask_partner: bool = False, warn: Callable[[str], None] = lambda line: None,
                          timeout: float = 10.0) -> uuid.UUID:
    """Insert a destination once it passes the check, as the owner. Returns its new ID. With `ask_partner`, the
    evidence its contract names is asked of the partner first (`ask_evidence`)."""
    fields = {**DEFAULTS, **values}
    if ask_partner:
        _validated(fields, credential_changed=True)
        await ask_evidence(fields, warn, timeout=timeout)
    return await Destinations(engine).add(tenant_id, fields,
                                          lambda row: _validated(row, credential_changed=True))


async def update_destination(engine: AsyncEngine, tenant_id: uuid.UUID, destination_id: uuid.UUID,
                             changes: Mapping[str, Any], *, ask_partner: bool = False,
                             warn: Callable[[str], None] = lambda line: None,
                             timeout: float = 10.0) -> dict[str, Any]:
    """Change some columns of a tenant's destination; the row as it will stand must pass the check. With
    `ask_partner`, a change to how the partner is reached or to the evidence the contract names (or enabling it)
    asks the partner first, outside the write's transaction (no row lock held across a connection); the write
    then refuses a row whose asked columns changed meanwhile."""
    if not changes:
        raise InputError("nothing to change: give at least one field")
    credential_changed = "credential_ref" in changes
    asked: dict[str, Any] | None = None
    if ask_partner and (any(column in changes for column in ASKED_FIELDS) or changes.get("enabled") is True):
        rows = await _app_store(engine).read_destinations(tenant_id, destination_id)
        if rows:  # else the write below says it is not found
            merged = {**rows[0], **changes}
            _validated(merged, credential_changed=credential_changed)
            await ask_evidence(merged, warn, timeout=timeout)
            asked = {column: merged[column] for column in ASKED_FIELDS}

    def check(merged: Mapping[str, Any]) -> None:
        _validated(merged, credential_changed=credential_changed)
        if asked is not None and any(merged[column] != value for column, value in asked.items()):
            raise InputError(f"destination {destination_id} changed while the partner was asked; nothing "
                             "written: run the command again")

    try:
        return await Destinations(engine).update(tenant_id, destination_id, changes, check)
    except DestinationNotFound as exc:
        raise InputError(str(exc)) from None


def _validated(fields: Mapping[str, Any], *, credential_changed: bool) -> None:
    try:
        validate_destination(fields)
    except InvalidDestination as exc:
        raise InputError(str(exc)) from None
    if credential_changed and fields["credential_ref"].startswith("file:"):
        try:
            load_credential(fields["credential_ref"])
        except CredentialUnusable as exc:
            raise InputError(f"credential_ref {exc}") from None


class CredentialUnusable(Exception):
    """One line saying why; never the key's text."""


def load_credential(credential_ref: str) -> asyncssh.SSHKey:
    """The private key a credential_ref names, read here (the key file, or the variable of this environment)."""
    scheme, _, rest = credential_ref.partition(":")
    if scheme == "file":
        path = Path(rest)
        if not path.exists():
            raise CredentialUnusable(f"file:{rest}: no such file here")
        if not path.is_file():
            raise CredentialUnusable(f"file:{rest}: not a regular file")
        if not os.access(path, os.R_OK):
            raise CredentialUnusable(f"file:{rest}: not readable by this user")
    try:
        return load_client_key(credential_ref)
    except asyncssh.KeyImportError:
        raise CredentialUnusable(f"{credential_ref} holds no private key that can be read without a passphrase"
                                 ) from None
    except (ValueError, OSError) as exc:  # an unset variable, or a file that went away meanwhile
        raise CredentialUnusable(str(exc)) from None


# --- the evidence a contract names, asked of the partner when the contract is written -------------------------


class NotOffered(Exception):
    """The partner answered that it does not offer the evidence the contract names: one line."""


async def ask_evidence(row: Mapping[str, Any], warn: Callable[[str], None], *, timeout: float = 10.0) -> None:
    """Ask the partner, writing nothing there, for the evidence by content a valid contract names: whether it
    answers check-file-name (hash_evidence check_file) and has the acknowledgment_dir. read_back and none need
    nothing asked (a read can only be tried on a file). Raises InputError, in one line, when the partner answers
    that it does not offer it; a partner that cannot be asked from here gets one line to `warn` instead."""
    dest = validate_destination(row)
    wanted = [what for what, named in (("hash_evidence check_file", dest.contract.hash_evidence == "check_file"),
                                       ("acknowledgment_dir", dest.contract.acknowledgment_dir is not None))
              if named]
    if not wanted:
        return
    where = f"{dest.host}:{dest.port}"

    def not_asked(why: str) -> None:
        warn(f"warning: {' and '.join(wanted)} not verified at the partner ({why}); written all the same: run "
             "`exports destinations check` where a worker runs")

    try:
        load_credential(dest.credential_ref)
    except CredentialUnusable as exc:
        not_asked(f"credential: {exc}")
        return
    try:
        async with asyncio.timeout(timeout * 4):
            async with connect(dest, connect_timeout=timeout) as sftp:
                if dest.contract.acknowledgment_dir is not None:
                    await _acknowledgment_dir_there(sftp, dest.contract.acknowledgment_dir, where)
                if dest.contract.hash_evidence == "check_file":
                    fact = await _check_file_fact(sftp, dest, where)
                    if fact.startswith("warning: "):
                        warn(fact)
    except NotOffered as exc:
        raise InputError(f"{exc}; nothing written (--no-check writes without asking)") from None
    except HostKeyMismatch:
        not_asked(f"host key: {where} did not present the pinned key")
    except asyncssh.PermissionDenied:
        not_asked(f"login: {where} refused the credential for user {_shown(dest.username)}")
    except asyncssh.SFTPError as exc:  # connected, but the partner would not say (a directory it may not stat)
        not_asked(f"{where} answered {_describe(exc)}")
    except (asyncssh.Error, OSError) as exc:  # TimeoutError included
        not_asked(f"connect: {where}: {_describe(exc)}")


async def _acknowledgment_dir_there(sftp: asyncssh.SFTPClient, path: str, where: str) -> None:
    if not await sftp.isdir(path):
        found = "not a directory" if await sftp.exists(path) else "no such directory"
        raise NotOffered(f"acknowledgment_dir {_shown(path)}: {found} at the partner {where}: no acknowledgment "
                         "could be read there")


async def _check_file_fact(sftp: asyncssh.SFTPClient, dest: DestinationConfig, where: str) -> str:
    """Whether the partner answers check-file-name, asked about a name that is not there: the fact, in one line
    (a warning where its answer says neither). Raises NotOffered where it answers that it does not offer it."""
    probe = posixpath.join(dest.final_dir, f".exports-check-{uuid.uuid4().hex}")  # a name that is not there
    try:
        await check_file_sha256(sftp, probe)
    except asyncssh.SFTPNoSuchFile:
        pass
    except asyncssh.SFTPOpUnsupported:
        raise NotOffered(f"hash_evidence check_file: the partner {where} does not offer it (its answer to the SFTP "
                         "extension check-file-name is OP_UNSUPPORTED, as OpenSSH's): every delivery there would "
                         "end OutcomeUnknown; use read_back") from None
    except (asyncssh.SFTPError, CheckFileError) as exc:
        return f"warning: hash_evidence check_file: {_describe(exc)}"
    return "hash_evidence check_file: the partner answers check-file-name"


# --- check: what the partner shows, with the pinned key and the credential ---------------------------------------


class CheckFailed(Exception):
    """What would stop a delivery, in one line."""


async def check_destination(row: Mapping[str, Any], say: Callable[[str], None], *, timeout: float = 10.0) -> None:
    """Connect as a delivery would and look at the destination's directories, writing nothing. `say` gets one line
    per fact found; the first fact that would stop a delivery raises CheckFailed."""
    try:
        dest = validate_destination(row)
    except InvalidDestination as exc:
        raise CheckFailed(f"contract: {exc}") from None
    say("contract: valid" + ("" if row["enabled"] else "; the destination is disabled: its exports are Rejected"))
    try:
        key = load_credential(dest.credential_ref)
    except CredentialUnusable as exc:
        raise CheckFailed(f"credential: {exc}") from None
    say(f"credential: {dest.credential_ref} holds an {key.get_algorithm()} key ({key.get_fingerprint()})")
    pinned = asyncssh.import_public_key(dest.host_key)
    where, pinned_text = f"{dest.host}:{dest.port}", f"{pinned.get_algorithm()} {pinned.get_fingerprint()}"
    try:
        async with asyncio.timeout(timeout * 4):
            async with connect(dest, connect_timeout=timeout) as sftp:
                say(f"host key: {where} presented the pinned {pinned.get_algorithm()} key "
                    f"({pinned.get_fingerprint()})")
                say(f"login: accepted as {_shown(dest.username)}")
                await _look(sftp, dest, say)
    except HostKeyMismatch:
        offered = await _offered_host_key(dest, pinned, timeout)
        raise CheckFailed(f"host key: {where} offered {offered}, not the pinned {pinned_text}; "
                          "the credential was not offered to it") from None
    except asyncssh.PermissionDenied:
        raise CheckFailed(f"login: {where} refused the credential for user {_shown(dest.username)}") from None
    except (asyncssh.Error, OSError) as exc:
        raise CheckFailed(f"connect: {where}: {_describe(exc)}") from None


async def _look(sftp: asyncssh.SFTPClient, dest: DestinationConfig, say: Callable[[str], None]) -> None:
    final = await _entries(sftp, "final_dir", dest.final_dir)
    say(f"final_dir {_shown(dest.final_dir)}: a directory, {_count(final, 'entry', 'entries')}")
    temp = await _entries(sftp, "temp_dir", dest.temp_dir)
    ours = sum(1 for name in temp if TEMP_NAME.match(name))
    say(f"temp_dir {_shown(dest.temp_dir)}: a directory, {_count(temp, 'entry', 'entries')}"
        + (f", {ours} of them temporary files of ours (removed once older than "
           f"{dest.contract.temp_file_max_age_seconds} s)" if ours else ""))
    if dest.contract.acknowledgment_dir is not None:
        ack_dir = dest.contract.acknowledgment_dir
        try:
            acks = await _entries(sftp, "acknowledgment_dir", ack_dir)
            say(f"acknowledgment_dir {_shown(ack_dir)}: a directory, {_count(acks, 'entry', 'entries')}")
        except CheckFailed as exc:  # deliveries go on without it; only the acknowledgments are missing
            say(f"warning: {exc}; no acknowledgment can be read")
    if dest.contract.hash_evidence == "check_file":
        try:
            say(await _check_file_fact(sftp, dest, f"{dest.host}:{dest.port}"))
        except NotOffered as exc:  # the hash its deliveries need cannot be had: each would end OutcomeUnknown
            raise CheckFailed(str(exc)) from None


async def _entries(sftp: asyncssh.SFTPClient, label: str, path: str) -> list[str]:
    try:
        if not await sftp.isdir(path):
            found = "not a directory" if await sftp.exists(path) else "no such directory"
            raise CheckFailed(f"{label} {_shown(path)}: {found} at the partner")
        return [name for name in await sftp.listdir(path) if name not in (".", "..")]
    except asyncssh.SFTPError as exc:
        raise CheckFailed(f"{label} {_shown(path)}: {_describe(exc)}") from None


async def _offered_host_key(dest: DestinationConfig, pinned: asyncssh.SSHKey, timeout: float) -> str:
    """The host key the server offers, trusted for nothing: only to say what it is. The pinned key's type first, as
    a server may hold keys of several types."""
    for algorithms in ([pinned.get_algorithm()], ()):
        try:
            key = await server_host_key(dest, algorithms, timeout)
        except (asyncssh.Error, OSError, ValueError):
            continue
        if key is not None:
            return f"{key.get_algorithm()} {key.get_fingerprint()}"
    return "a host key that could not be read"


def _count(names: list[str], one: str, many: str) -> str:
    return f"{len(names)} {one if len(names) == 1 else many}"


def _describe(exc: BaseException) -> str:
    return _shown(gist(exc))


def _shown(text: object) -> str:
    """Text from the table or a server, printed literally: a control or invisible character is escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


# --- the command line -------------------------------------------------------------------------------------------

destinations_app = typer.Typer(
    help="Partner destinations. add and update write as the owner role (EXPORTS_OWNER_DATABASE_URL), since only "
         "the owner may write destinations; list and check only read, as the application role "
         "(EXPORTS_DATABASE_URL).\n\nExit status: 0 done; 1 check found what would stop a delivery; 2 bad input, "
         "nothing written; 4 the database refused (a role that may not write destinations); 5 the database could "
         "not be reached.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


def fail(message: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    """One line on stderr, never wrapped, and the exit status (as starter/cli.py's)."""
    print(message, file=sys.stderr)
    raise typer.Exit(code)


def _run(body: Callable[[AsyncEngine], Awaitable[T]], *, owner: bool) -> T:
    async def main() -> T:
        settings = get_settings()
        url = settings.owner_database_url if owner else settings.database_url
        if not url:
            raise InputError("no database URL for the " + ("owner role (EXPORTS_OWNER_DATABASE_URL)" if owner
                                                           else "application role (EXPORTS_DATABASE_URL)"))
        engine = make_engine(url, pool_size=1)
        try:
            return await body(engine)
        finally:
            await engine.dispose()

    try:
        return asyncio.run(main())
    except (InputError, errors.StoreError) as exc:
        code, line = answer(exc)
    except (SQLAlchemyError, OSError) as exc:  # no connection check first: starter/exits.py says what it means
        code, line = answer(DatabaseFailure(exc))
    fail(_shown(line), code)


def _app_store(engine: AsyncEngine) -> JobStore:
    """The application role's store on `_run`'s engine (it reads destinations; the owner writes them)."""
    return JobStore(engine, lease_seconds=get_settings().lease_seconds)


def _whole_number(value: str | None, what: str) -> int | None:
    if value is None:
        return None
    try:
        return int(value.strip())
    except ValueError:
        fail(f"error: {what} {_shown(repr(value))} is not a whole number", EXIT_BAD_INPUT)


def _given(**values: Any) -> dict[str, Any]:
    return {column: value for column, value in values.items() if value is not None}


TENANT = typer.Option(..., help="tenant ID")
MAX_SESSIONS_HELP = ("how many sessions the partner accepts at once (1 to 1000; its MaxSessions, say): no more "
                     "uploads than that run to it across all workers; none when omitted")
HOST_KEY_HELP = ("the partner's host key as one OpenSSH public key line ('ssh-ed25519 AAAA...'), without a "
                 "known_hosts host pattern or authorized_keys options")
CREDENTIAL_HELP = ("file:<path> (a private key file, readable here when written) or env:<VAR> (a variable of "
                   "the worker's environment, looked up by check): names the key, never the key itself")
HASH_EVIDENCE_HELP = ("none, read_back or check_file (only where the partner answers the SFTP check-file-name "
                      "extension: OpenSSH does not)")
NO_CHECK = typer.Option(False, "--no-check",
                        help="write without asking the partner whether it offers the evidence the contract names "
                             "(check_file, acknowledgment_dir); by default a partner that answers no is refused")


def _warn(line: str) -> None:
    print(_shown(line), file=sys.stderr, flush=True)


@destinations_app.command("add")
def add_command(
    tenant: str = TENANT,
    name: str = typer.Option(..., help="what operators call it"),
    host: str = typer.Option(..., help="the partner's SFTP host name or IP address"),
    port: str = typer.Option("22", help="1 to 65535"),
    username: str = typer.Option(..., help="the user name at the partner"),
    final_dir: str = typer.Option(..., help="absolute; where the partner takes files from"),
    temp_dir: str = typer.Option(..., help="absolute; where files are written first, apart from final_dir"),
    host_key: str = typer.Option(..., help=HOST_KEY_HELP),
    credential_ref: str = typer.Option(..., help=CREDENTIAL_HELP),
    hash_evidence: str = typer.Option("none", help=HASH_EVIDENCE_HELP),
    acknowledgment_dir: str | None = typer.Option(None, help="absolute; where the partner writes <name>.ack"),
    name_and_size_identify: bool = typer.Option(False, help="only where the partner agreed to it"),
    temp_file_max_age_seconds: str | None = typer.Option(None, help="at least 43200; 604800 when omitted"),
    max_sessions: str | None = typer.Option(None, help=MAX_SESSIONS_HELP),
    disabled: bool = typer.Option(False, "--disabled", help="written disabled: its exports are Rejected"),
    no_check: bool = NO_CHECK,
) -> None:
    """Add a destination (as the owner role, EXPORTS_OWNER_DATABASE_URL) and print its new ID.

    Where the contract names check_file or an acknowledgment_dir, the partner is asked first, writing nothing
    there, and one that does not offer it is refused (exit status 2). One it cannot reach from here is written
    with a warning: run check where a worker runs."""
    values = _given(name=name, host=host, port=_whole_number(port, "port"), username=username,
                    final_dir=final_dir, temp_dir=temp_dir, host_key=host_key, credential_ref=credential_ref,
                    hash_evidence=hash_evidence, acknowledgment_dir=acknowledgment_dir,
                    name_and_size_identify=name_and_size_identify, enabled=not disabled,
                    temp_file_max_age_seconds=_whole_number(temp_file_max_age_seconds,
                                                            "temp_file_max_age_seconds"),
                    max_sessions=_whole_number(max_sessions, "max_sessions"))
    tenant_id = _parsed(tenant, "tenant ID")
    print(_run(lambda engine: add_destination(engine, tenant_id, values, ask_partner=not no_check, warn=_warn),
               owner=True))


@destinations_app.command("update")
def update_command(
    destination: str = typer.Argument(..., help="destination ID"),
    tenant: str = TENANT,
    name: str | None = typer.Option(None),
    host: str | None = typer.Option(None),
    port: str | None = typer.Option(None),
    username: str | None = typer.Option(None),
    final_dir: str | None = typer.Option(None),
    temp_dir: str | None = typer.Option(None),
    host_key: str | None = typer.Option(None, help=HOST_KEY_HELP),
    credential_ref: str | None = typer.Option(None, help=CREDENTIAL_HELP),
    hash_evidence: str | None = typer.Option(None, help=HASH_EVIDENCE_HELP),
    acknowledgment_dir: str | None = typer.Option(None),
    no_acknowledgment_dir: bool = typer.Option(False, "--no-acknowledgment-dir", help="clear it"),
    name_and_size_identify: bool | None = typer.Option(None, "--name-and-size-identify/"
                                                                "--no-name-and-size-identify"),
    temp_file_max_age_seconds: str | None = typer.Option(None, help="at least 43200"),
    max_sessions: str | None = typer.Option(None, help=MAX_SESSIONS_HELP),
    no_max_sessions: bool = typer.Option(False, "--no-max-sessions", help="no session limit"),
    enabled: bool | None = typer.Option(None, "--enabled/--disabled"),
    no_check: bool = NO_CHECK,
) -> None:
    """Change fields of a destination, as the owner role (EXPORTS_OWNER_DATABASE_URL).

    The whole row as it will stand is checked, as add checks it; a change to how the partner is reached or to the
    evidence the contract names, or enabling it, asks the partner as add does."""
    if no_acknowledgment_dir and acknowledgment_dir is not None:
        fail("error: give --acknowledgment-dir or --no-acknowledgment-dir, not both")
    changes = _given(name=name, host=host, port=_whole_number(port, "port"), username=username,
                     final_dir=final_dir, temp_dir=temp_dir, host_key=host_key, credential_ref=credential_ref,
                     hash_evidence=hash_evidence, acknowledgment_dir=acknowledgment_dir,
                     name_and_size_identify=name_and_size_identify, enabled=enabled,
                     temp_file_max_age_seconds=_whole_number(temp_file_max_age_seconds,
                                                             "temp_file_max_age_seconds"),
                     max_sessions=_whole_number(max_sessions, "max_sessions"))
    if no_acknowledgment_dir:
        changes["acknowledgment_dir"] = None
    if no_max_sessions:
        if max_sessions is not None:
            fail("error: give --max-sessions or --no-max-sessions, not both")
        changes["max_sessions"] = None
    destination_id, tenant_id = _parsed(destination, "destination ID"), _parsed(tenant, "tenant ID")
    _run(lambda engine: update_destination(engine, tenant_id, destination_id, changes, ask_partner=not no_check,
                                           warn=_warn), owner=True)
    print(f"updated {destination_id}")


@destinations_app.command("list")
def list_command(tenant: str | None = typer.Option(None, help="only this tenant's destinations")) -> None:
    """One line per destination, with whether its contract is valid.

    Reads as the application role (EXPORTS_DATABASE_URL). A credential_ref is a reference, shown; no secret is
    ever read."""
    tenant_id = _parsed(tenant, "tenant ID") if tenant is not None else None
    rows = _run(lambda engine: _app_store(engine).read_destinations(tenant_id), owner=False)
    for row in rows:
        print(_listed(row))
    if not rows:
        print("no destinations")


@destinations_app.command("check")
def check_command(destination: str = typer.Argument(..., help="destination ID"), tenant: str = TENANT) -> None:
    """Connect as a delivery would and say what was found, one line per fact.

    Connects with the pinned host key and the credential, looks at final_dir and temp_dir and at the evidence
    the contract names (check_file: whether the partner answers check-file-name), and writes nothing.
    Exit status 1 with one line on stderr when what it found would stop a delivery. Reads the row as the
    application role (EXPORTS_DATABASE_URL); an env: credential is looked up in this environment."""
    destination_id, tenant_id = _parsed(destination, "destination ID"), _parsed(tenant, "tenant ID")
    rows = _run(lambda engine: _app_store(engine).read_destinations(tenant_id, destination_id), owner=False)
    if not rows:
        fail(f"error: destination {destination_id} not found for tenant {tenant_id}")
    try:
        asyncio.run(check_destination(rows[0], lambda fact: print(fact, flush=True)))
    except CheckFailed as exc:
        fail(f"failed: {exc}", EXIT_CHECK_FAILED)
    print(f"ok: destination {destination_id} is reachable and its directories are there")


def _parsed(value: str, what: str) -> uuid.UUID:
    try:
        return parse_id(value, what)
    except InputError as exc:
        fail(f"error: {_shown(exc)}")


def _listed(row: Mapping[str, Any]) -> str:
    try:
        validate_destination(row)
        contract = "valid"
    except InvalidDestination as exc:
        contract = f"not valid: {exc}"
    try:
        key = asyncssh.import_public_key(row["host_key"])
        host_key = f"{key.get_algorithm()} {key.get_fingerprint()}"
    except (asyncssh.KeyImportError, ValueError):
        host_key = "(not a key)"
    ref = row["credential_ref"]
    # A reference is fine to show; anything else in that column may be a pasted key.
    shown_ref = ref if ref.startswith(("file:", "env:")) and "\n" not in ref else "(not shown)"
    fields = [
        str(row["id"]), f"tenant {row['tenant_id']}", f"name {row['name']!r}",
        "enabled" if row["enabled"] else "disabled",
        f"{row['username']}@{row['host']}:{row['port']}", f"final_dir {row['final_dir']}",
        f"temp_dir {row['temp_dir']}", f"host_key {host_key}", f"credential_ref {shown_ref}",
        f"hash_evidence {row['hash_evidence']}", f"acknowledgment_dir {row['acknowledgment_dir'] or '-'}",
        f"name_and_size_identify {'yes' if row['name_and_size_identify'] else 'no'}",
        f"temp_file_max_age_seconds {row['temp_file_max_age_seconds']}",
        f"max_sessions {row.get('max_sessions') or 'no limit'}", f"contract {contract}",
    ]
    return _shown("  ".join(fields))
