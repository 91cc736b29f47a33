"""The partner client: one delivery of a local file to a partner's SFTP server, and the classification of its
failures into what is known about the partner's side.

The partner processes whatever appears under its final directory, so the file is written under a temporary
name that the partner ignores and then moved into place with the SFTP v3 `rename`, which refuses to replace an
existing name. That rename is the one irreversible step: everything before it can be proven undelivered by a
fresh listing, everything from it on can only be proven delivered by a listing that confirms it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import posixpath
import re
import time
import unicodedata
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal, get_args
from uuid import UUID

import asyncssh
from asyncssh.encryption import get_default_encryption_algs
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from activities import outcomes
from activities.sftp_check_file import check_file_sha256

logger = logging.getLogger(__name__)

# Bounds for the work done after a failure: a fresh listing, then removing the temporary file.
AFTER_FAILURE_TIMEOUT_SECONDS = 10.0

# Where a delivery was when it failed; see `classify`.
Step = Literal["connect", "baseline", "upload", "rename", "confirm"]
_NOTHING_WRITTEN_YET: frozenset[str] = frozenset({"connect", "baseline"})



def _refused_by_server(exc: BaseException) -> bool:
    """A status reply from the server: the request was processed and not carried out, whatever its code (SFTP v3
    reports "name exists" as a plain failure, a missing directory as no such file). SFTPConnectionLost and
    SFTPNoConnection are SFTPErrors the client makes up itself when the channel dies: they say nothing about what
    the server did."""
    return isinstance(exc, asyncssh.SFTPError) and not isinstance(
        exc, (asyncssh.SFTPConnectionLost, asyncssh.SFTPNoConnection))


@asynccontextmanager
async def _within(seconds: float) -> AsyncIterator[None]:
    """asyncio.timeout whose TimeoutError says what did not answer, and within how long."""
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError as exc:
        if str(exc):
            raise
        raise TimeoutError(f"no answer from the partner within {seconds:g} s") from None

# What a delivery catches and classifies. Exception, not a list of transport errors: an unexpected error
# in the middle of an upload leaves the partner side just as uncertain, and the caller still needs an outcome.
_CAUGHT = (Exception, asyncio.CancelledError)


class PartnerContract(BaseModel):
    """What was agreed with the partner, stored with the destination."""

    model_config = ConfigDict(frozen=True)

    # Name and size alone identify a file there. Different exports can share a size, so only by agreement.
    name_and_size_identify: bool = False
    # Evidence by content: "read_back" (the final file may be read back and hashed), "check_file" (the partner
    # answers the SFTP check-file-name extension with its SHA-256), or "none".
    hash_evidence: Literal["none", "read_back", "check_file"] = "none"
    # Where the partner writes <final name>.ack holding the SHA-256 (hex) of the file it processed.
    acknowledgment_dir: str | None = None
    # After how long a temporary file of ours may be removed from temp_dir (the partner ignores it meanwhile).
    temp_file_max_age_seconds: int = 604800


class Replacement(BaseModel):
    """What a replacement's delivery knows of its original, to tell the original's file from any other."""

    model_config = ConfigDict(frozen=True)

    original_bytes: int | None
    original_sha256: str | None
    overwrite_agreed: bool


class DestinationConfig(BaseModel):
    model_config = ConfigDict(frozen=True)

    host: str
    port: int = Field(ge=1, le=65535)
    username: str
    final_dir: str
    temp_dir: str
    host_key: str
    credential_ref: str
    contract: PartnerContract = PartnerContract()

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> DestinationConfig:
        """The destination as its `destinations` row records it."""
        return cls(
            host=row["host"], port=row["port"], username=row["username"], final_dir=row["final_dir"],
            temp_dir=row["temp_dir"], host_key=row["host_key"], credential_ref=row["credential_ref"],
            contract=PartnerContract(name_and_size_identify=row["name_and_size_identify"],
                                     hash_evidence=row["hash_evidence"],
                                     acknowledgment_dir=row["acknowledgment_dir"],
                                     temp_file_max_age_seconds=row["temp_file_max_age_seconds"]),
        )

    @model_validator(mode="after")
    def _temp_dir_is_not_final_dir(self) -> DestinationConfig:
        # The partner processes everything in final_dir: a temporary file there could be taken half-written.
        if posixpath.normpath(self.final_dir) == posixpath.normpath(self.temp_dir):
            raise ValueError("temp_dir must differ from final_dir")
        return self


# --- a destination as written: what `exports destinations add` and `update` refuse, and what makes evaluate_policy
# reject an export before its claim. The table accepts more (rows written by SQL, rows from before this check).

MAX_DESTINATION_NAME = 200  # the table's CHECK
MAX_HOST = 253  # a DNS name
MAX_USERNAME = 200
MAX_PATH = 1024
MAX_HOST_KEY = 8192  # an RSA key of 16384 bits is a line of about 2,800 characters
MIN_TEMP_FILE_MAX_AGE_SECONDS = 43200  # the table's CHECK: far above the delivery's six-hour timeout
MAX_TEMP_FILE_MAX_AGE_SECONDS = 2**31 - 1  # an int column
HASH_EVIDENCE: tuple[str, ...] = get_args(PartnerContract.model_fields["hash_evidence"].annotation)

# A DNS name or an IP address, nothing else: no spaces, nothing that starts like an option.
_HOST = re.compile(r"[A-Za-z0-9_.:%-]+")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SCHEME = re.compile(r"[a-z][a-z0-9+.-]{0,19}")
# Control characters (NUL, terminal escapes, line breaks) and invisible ones (bidirectional overrides): never in
# anything an operator reads back or a connection uses.
_HIDDEN = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
# What an authorized_keys line may put before its key, where a known_hosts line puts host patterns.
_KEY_OPTIONS = frozenset({"restrict", "cert-authority", "no-pty", "pty", "no-port-forwarding", "port-forwarding",
                          "no-agent-forwarding", "agent-forwarding", "no-x11-forwarding", "x11-forwarding",
                          "no-user-rc", "user-rc", "no-touch-required", "verify-required"})


class InvalidDestination(ValueError):
    """A destination the delivery could not act on as written: one line naming the column and why."""


def validate_destination(row: Mapping[str, Any]) -> DestinationConfig:
    """The one check of a destination's contract, on its `destinations` row or on the values about to be written
    there (every column but the IDs). Reads nothing outside the row, neither a key file nor an environment
    variable: whether a worker can read the credential is a fact of that machine, which `exports destinations
    check` reports and a delivery's connect step finds. Raises InvalidDestination."""
    problem = _destination_problem(row)
    if problem is None:
        try:
            return DestinationConfig.from_row(row)
        except ValidationError as exc:
            first = exc.errors()[0]
            problem = f"{'.'.join(str(p) for p in first['loc']) or 'destination'} {first['msg']}"
    raise InvalidDestination(problem)


def _destination_problem(row: Mapping[str, Any]) -> str | None:
    texts = {"name": MAX_DESTINATION_NAME, "host": MAX_HOST, "username": MAX_USERNAME, "final_dir": MAX_PATH,
             "temp_dir": MAX_PATH, "host_key": MAX_HOST_KEY, "credential_ref": len("file:") + MAX_PATH,
             "hash_evidence": MAX_DESTINATION_NAME}
    if row.get("acknowledgment_dir") is not None:
        texts["acknowledgment_dir"] = MAX_PATH
    for column, limit in texts.items():
        if (problem := _text_problem(row.get(column), limit)) is not None:
            return f"{column} {problem}"
    if not _HOST.fullmatch(row["host"]) or row["host"].startswith("-"):
        return f"host {row['host']!r} is not a host name or an IP address"
    if not _whole(row.get("port")) or not 1 <= row["port"] <= 65535:
        return "port must be a whole number from 1 to 65535"
    for column in ("final_dir", "temp_dir", "acknowledgment_dir"):
        if column in texts and not row[column].startswith("/"):
            return f"{column} must be an absolute path (starting with '/'), as the partner's server resolves it"
    final, temp = _directory(row["final_dir"]), _directory(row["temp_dir"])
    # The partner takes whatever appears under final_dir: a temporary file there could be taken half-written.
    if temp == final:
        return f"temp_dir must differ from final_dir (both are {final!r}): the partner takes what appears there"
    if posixpath.commonpath([final, temp]) == final:
        return f"temp_dir {temp!r} must not be inside final_dir {final!r}: the partner takes what appears there"
    if (problem := _host_key_problem(row["host_key"])) is not None:
        return f"host_key {problem}"
    if (problem := _credential_ref_problem(row["credential_ref"])) is not None:
        return f"credential_ref {problem}"
    if row["hash_evidence"] not in HASH_EVIDENCE:
        return f"hash_evidence must be one of {', '.join(HASH_EVIDENCE)}"
    age = row.get("temp_file_max_age_seconds")
    if not _whole(age) or not MIN_TEMP_FILE_MAX_AGE_SECONDS <= age <= MAX_TEMP_FILE_MAX_AGE_SECONDS:
        return (f"temp_file_max_age_seconds must be a whole number of seconds from {MIN_TEMP_FILE_MAX_AGE_SECONDS} "
                f"(12 hours, above the delivery's timeout) to {MAX_TEMP_FILE_MAX_AGE_SECONDS}")
    for column in ("enabled", "name_and_size_identify"):
        if not isinstance(row.get(column, False), bool):
            return f"{column} must be true or false"
    return None


def _text_problem(value: object, limit: int) -> str | None:
    if not isinstance(value, str) or not value.strip():
        return "must be given, as text"
    if len(value) > limit:
        return f"is longer than {limit} characters"
    if any(unicodedata.category(c) in _HIDDEN for c in value):
        return "contains a control character (NUL, an escape, a line break) or an invisible formatting one"
    return None


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _directory(path: str) -> str:
    # One spelling per directory: "/out", "/out/", "//out" and "/a/../out/." are the same one.
    return "/" + posixpath.normpath(path).lstrip("/")


def _host_key_problem(line: str) -> str | None:
    """Why `line` is not a single OpenSSH public key line ("<type> <base64> [comment]"), or None."""
    try:
        asyncssh.import_public_key(line)
        return None
    except (asyncssh.KeyImportError, ValueError) as exc:
        error = str(exc)
    tokens = line.split()
    for start in range(1, len(tokens) - 1):
        if _public_key_line(" ".join(tokens[start:start + 2])):
            before = " ".join(tokens[:start])
            key = f"'{tokens[start]} {tokens[start + 1][:16]}...'"
            first = before.split(",")[0].lower()
            if ("=" in before and not before.startswith("|")) or first in _KEY_OPTIONS:  # |1|: hashed host
                return f"has options before the key (an authorized_keys line): pin the key alone, as {key}"
            return (f"is a known_hosts line ({before[:60]!r} before the key): pin the key alone, as {key}, "
                    "since the destination's host and port say where it is")
    return f"is not an OpenSSH public key line ('<type> <base64> [comment]'): {error}"


def _public_key_line(text: str) -> bool:
    try:
        asyncssh.import_public_key(text)
    except (asyncssh.KeyImportError, ValueError):
        return False
    return True


def _credential_ref_problem(ref: str) -> str | None:
    """Why `ref` is not file:<path> or env:<VAR>, or None. Never quotes `ref`: it may be a pasted key."""
    scheme, colon, rest = ref.partition(":")
    if colon and scheme == "file":
        return None if rest.strip() else "file: names no path"
    if colon and scheme == "env":
        return None if _ENV_NAME.fullmatch(rest) else (
            "env: needs an environment variable name (letters, digits and '_', not starting with a digit)")
    what = f"has an unknown scheme {scheme!r}" if colon and _SCHEME.fullmatch(scheme) else "names no scheme"
    return f"{what}: expected file:<path> or env:<VAR>, naming the private key (never the key itself)"


class RemoteFile(BaseModel):
    model_config = ConfigDict(frozen=True)

    path: str
    exists: bool
    size: int | None = None
    mtime: int | None = None


class DeliveryResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    outcome: Literal["Completed", "Failed", "OutcomeUnknown"]
    failure_reason: Literal["NotDelivered", "FinalNameOccupied", "OriginalDelivered"] | None = None
    summary: str
    receipt: RemoteFile | None = None
    confirmed_by: outcomes.ConfirmedBy | None = None  # what made a Completed true


class HostKeyMismatch(Exception):
    """The server presented a host key other than the pinned one."""


class FinalDirMissing(Exception):
    """The partner has no final directory: no rename could ever publish the file."""


class UploadIncomplete(Exception):
    """The temporary file does not hold exactly the bytes of the local file, so it must not be renamed."""


def load_client_key(credential_ref: str) -> asyncssh.SSHKey:
    """The client's private key from "file:<path>" or "env:<VARNAME>". Errors never include the key text."""
    scheme, _, rest = credential_ref.partition(":")
    if scheme == "file" and rest:
        return asyncssh.read_private_key(rest)
    if scheme == "env" and rest:
        text = os.environ.get(rest)
        if not text:
            raise ValueError(f"credential_ref names environment variable {rest!r}, which is unset or empty")
        return asyncssh.import_private_key(text)
    raise ValueError(
        f"unsupported credential_ref scheme {scheme!r}: expected 'file:<path>' or 'env:<VARNAME>'"
    )


def _pinned_host_key(line: str) -> asyncssh.SSHKey:
    try:
        return asyncssh.import_public_key(line.strip())
    except (asyncssh.KeyImportError, ValueError) as exc:
        raise ValueError("destination host_key is not a valid OpenSSH public key line") from exc


def _no_key_of_pinned_type(dest: DestinationConfig, pinned: asyncssh.SSHKey) -> HostKeyMismatch:
    return HostKeyMismatch(f"{dest.host}:{dest.port} has no host key of the pinned type ({pinned.get_algorithm()})")


async def server_host_key(dest: DestinationConfig, algorithms: Sequence[str] | str,
                          timeout: float) -> asyncssh.SSHKey | None:
    """The host key the server presents when only `algorithms` are allowed ("default": any). Trusted for nothing
    and nothing is authenticated: only the key is read. Raises what the handshake raised."""
    return await asyncio.wait_for(asyncssh.get_server_host_key(
        dest.host, dest.port, server_host_key_algs=algorithms, config=[]), timeout)


async def _lacks_pinned_key_type(dest: DestinationConfig, pinned: asyncssh.SSHKey, timeout: float) -> bool:
    """Whether the server cuts a handshake that allows only the pinned key's type while it completes one that
    allows any type with a key of another type."""
    async def offered(algorithms: list[str] | str) -> asyncssh.SSHKey | None:
        try:
            return await server_host_key(dest, algorithms, timeout)
        except asyncssh.KeyExchangeFailed as exc:
            return None if "host key" in str(exc).lower() else pinned  # only a refusal of the type counts
        except (asyncssh.ConnectionLost, ConnectionResetError):
            return None
        except (asyncssh.Error, OSError):
            return pinned  # the server could not be asked: the first failure stands

    if await offered([alg.decode() for alg in pinned.sig_algorithms]) is not None:
        return False
    other = await offered("default")
    return other is not None and other is not pinned and other.get_algorithm() != pinned.get_algorithm()


# asyncssh's own ciphers, AES-GCM first: the client's order decides, and on a CPU with AES instructions AES-GCM
# moves about twice the bytes of ChaCha20-Poly1305 per second of CPU. Nothing is added or dropped.
CIPHERS = sorted((alg.decode() for alg in get_default_encryption_algs()), key=lambda alg: "-gcm@" not in alg)


@asynccontextmanager
async def connect(
    dest: DestinationConfig, *, connect_timeout: float = 10.0
) -> AsyncIterator[asyncssh.SFTPClient]:
    """An SFTP session with the partner, whose host key must be exactly `dest.host_key`.

    Raises HostKeyMismatch for any other key, ValueError for a bad credential_ref or host_key, asyncssh.Error
    or OSError (including TimeoutError) when the server cannot be reached within `connect_timeout`.
    """
    client_key = load_client_key(dest.credential_ref)
    pinned = _pinned_host_key(dest.host_key)
    logger.info("connecting to partner %s:%d as %s", dest.host, dest.port, dest.username)
    try:
        conn = await asyncssh.connect(
            dest.host,
            dest.port,
            username=dest.username,
            # The pinned key is the only trusted one: no CA keys, no known_hosts file, no X.509 chains.
            known_hosts=([pinned], [], []),
            x509_trusted_certs=None,
            client_keys=[client_key],
            # Nothing from the machine's environment takes part: no ~/.ssh/config, agent, GSS or passwords.
            config=[],
            agent_path=None,
            gss_host=None,
            password_auth=False,
            kbdint_auth=False,
            preferred_auth="publickey",
            encryption_algs=CIPHERS,
            connect_timeout=connect_timeout,
        )
    except asyncssh.HostKeyNotVerifiable as exc:
        raise HostKeyMismatch(
            f"host key of {dest.host}:{dest.port} does not match the pinned key ({pinned.get_algorithm()})"
        ) from exc
    except asyncssh.KeyExchangeFailed as exc:
        # Only the pinned key's algorithms are offered, so a server without a key of that type fails the key
        # exchange instead ("Unable to find compatible server host key"): it cannot present the pinned key
        # either.
        if "host key" in str(exc).lower():
            raise _no_key_of_pinned_type(dest, pinned) from exc
        raise
    except (asyncssh.ConnectionLost, ConnectionResetError) as exc:
        # OpenSSH refuses such a handshake by cutting the connection without a reason, and asyncssh's server may
        # close before its reason is read; only asking again tells that apart from a connection that failed.
        if await _lacks_pinned_key_type(dest, pinned, connect_timeout):
            raise _no_key_of_pinned_type(dest, pinned) from exc
        raise
    try:
        async with asyncio.timeout(connect_timeout):
            sftp = await conn.start_sftp_client()
        try:
            yield sftp
        finally:
            sftp.exit()
    finally:
        conn.close()
        try:
            async with asyncio.timeout(connect_timeout):
                await conn.wait_closed()
        except (asyncssh.Error, OSError) as exc:
            # The session's work is done or already failed; a slow goodbye changes nothing.
            logger.debug("closing the connection to %s:%d: %s", dest.host, dest.port, exc)


async def _listing(sftp: asyncssh.SFTPClient, path: str) -> RemoteFile:
    try:
        attrs = await sftp.stat(path)
    except asyncssh.SFTPNoSuchFile:
        return RemoteFile(path=path, exists=False)
    return RemoteFile(path=path, exists=True, size=attrs.size, mtime=attrs.mtime)


async def _require_final_dir(sftp: asyncssh.SFTPClient, dest: DestinationConfig) -> None:
    try:
        await sftp.stat(dest.final_dir)
    except asyncssh.SFTPNoSuchFile:
        raise FinalDirMissing(f"final directory {dest.final_dir} does not exist at the partner") from None


async def preflight(dest: DestinationConfig, final_name: str, *, timeout: float = 10.0) -> RemoteFile:
    """The preparation's look, before the build: connect with the pinned key and the credential, require the final
    directory, and list the final name. Raises HostKeyMismatch, ValueError (an unusable credential or key),
    asyncssh.PermissionDenied (the credential is refused) or FinalDirMissing for what no retry can mend."""
    async with _within(timeout * 3):
        async with connect(dest, connect_timeout=timeout) as sftp:
            await _require_final_dir(sftp, dest)
            return await _listing(sftp, posixpath.join(dest.final_dir, final_name))


async def list_final(dest: DestinationConfig, final_name: str, *, timeout: float = 10.0) -> RemoteFile:
    """The final name as the partner shows it now, on a connection of its own (recovery's evidence)."""
    async with asyncio.timeout(timeout):
        async with connect(dest, connect_timeout=timeout) as sftp:
            return await _listing(sftp, posixpath.join(dest.final_dir, final_name))


async def look_at_final(dest: DestinationConfig, final_name: str, *, timeout: float = 10.0) -> outcomes.FinalLook:
    """The final name with every evidence by content the contract offers (hash, acknowledgment), on a connection
    of its own: recovery's own look. A hash or acknowledgment that cannot be had is recorded, not raised."""
    final_path = posixpath.join(dest.final_dir, final_name)
    async with asyncio.timeout(timeout * 4):
        async with connect(dest, connect_timeout=timeout) as sftp:
            listing = await _listing(sftp, final_path)
            if not listing.exists:
                return outcomes.FinalLook(exists=False)
            sha256 = acknowledged = error = None
            try:
                sha256 = await _content_sha256(sftp, dest, final_path, timeout)
                acknowledged = await _acknowledged_sha256(sftp, dest, final_name, timeout)
            except (asyncssh.Error, OSError) as exc:
                error = _describe(exc)
            return outcomes.FinalLook(exists=True, size=listing.size, sha256=sha256, sha256_error=error,
                                      acknowledged_sha256=acknowledged)


# Our temporary names: ".<final name>.<attempt ID>.part" (see the deliver activity).
_TEMP_NAME = re.compile(r"^\.(?P<final>.+)\.(?P<attempt>[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})\.part$")


def temp_file_name(final_name: str, attempt_id: UUID) -> str:
    return f".{final_name}.{attempt_id}.part"


async def sweep_temp_files(dest: DestinationConfig, *, is_ours: Callable[[str], Awaitable[bool]],
                           is_live: Callable[[UUID], Awaitable[bool]], timeout: float = 30.0) -> dict[str, list[str]]:
    """Remove our temporary files in the destination's temp_dir that are older than the partner's contract allows
    (recovery cannot tell a dead worker from a paused one, so only age can) and whose attempt is not live
    (`is_live`: still Delivering). Ours means named after a final name of this destination's exports (`is_ours`):
    another tenant's files in a shared directory, and files of other names, are never touched.
    Returns the names removed, kept (too young or live), and the removals that failed, with why."""
    found: dict[str, list[str]] = {"removed": [], "kept": [], "failed": []}
    async with asyncio.timeout(timeout):
        async with connect(dest, connect_timeout=timeout) as sftp:
            names = await sftp.readdir(dest.temp_dir)
            cutoff = time.time() - dest.contract.temp_file_max_age_seconds
            for entry in names:
                match = _TEMP_NAME.match(entry.filename)
                if match is None or not await is_ours(match["final"]):
                    continue
                mtime = entry.attrs.mtime
                if mtime is None or mtime > cutoff or await is_live(UUID(match["attempt"])):
                    found["kept"].append(entry.filename)
                    continue
                try:
                    await sftp.remove(posixpath.join(dest.temp_dir, entry.filename))
                    found["removed"].append(entry.filename)
                except (asyncssh.Error, OSError) as exc:
                    found["failed"].append(f"{entry.filename}: {_describe(exc)}")
    return found


async def _content_sha256(sftp: asyncssh.SFTPClient, dest: DestinationConfig, path: str,
                          operation_timeout: float) -> str | None:
    """The SHA-256 (hex) of the partner's file, by the means its contract offers; None where it offers none."""
    if dest.contract.hash_evidence == "check_file":
        async with _within(operation_timeout):
            return await check_file_sha256(sftp, path)
    if dest.contract.hash_evidence == "read_back":
        digest = hashlib.sha256()
        async with _within(operation_timeout):
            async with sftp.open(path, "rb") as remote:
                while chunk := await remote.read(256 * 1024):
                    digest.update(chunk)
        return digest.hexdigest()
    return None


async def _acknowledged_sha256(sftp: asyncssh.SFTPClient, dest: DestinationConfig, final_name: str,
                               operation_timeout: float) -> str | None:
    """The SHA-256 the partner acknowledged for this final name, if it wrote an acknowledgment."""
    if dest.contract.acknowledgment_dir is None:
        return None
    path = posixpath.join(dest.contract.acknowledgment_dir, f"{final_name}.ack")
    try:
        async with _within(operation_timeout):
            async with sftp.open(path, "r") as ack:
                text = await ack.read(4096)
    except asyncssh.SFTPNoSuchFile:
        return None
    return text.strip().removeprefix("sha256=").strip().lower() or None


async def _identify(sftp: asyncssh.SFTPClient, dest: DestinationConfig, final_path: str, final_name: str,
                    found: RemoteFile, original: Replacement, operation_timeout: float) -> tuple[bool, str]:
    """Whether a file under a replacement's final name is the original's delivery, and on what evidence:
    a matching checksum, an acknowledgment tied to the original, or name and size where the contract says so."""
    if original.original_sha256:
        actual = await _content_sha256(sftp, dest, final_path, operation_timeout)
        if actual is not None and actual == original.original_sha256:
            return True, "checksum matches the original's expected file"
    if original.original_sha256:
        acknowledged = await _acknowledged_sha256(sftp, dest, final_name, operation_timeout)
        if acknowledged == original.original_sha256:
            return True, "the partner's acknowledgment names the original's file"
    if dest.contract.name_and_size_identify and found.size == original.original_bytes:
        return True, "name and size match the original's, which the contract accepts"
    return False, "not identified as the original's delivery"


def _describe(exc: BaseException) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text[:300]


async def _record(
    record_evidence: Callable[[dict[str, Any]], Awaitable[None]], record: dict[str, Any]
) -> None:
    """Append evidence; a failed write is logged, never allowed to change what happens at the partner.

    CancelledError propagates: before the rename it must stop the delivery like any other cancellation.
    """
    try:
        await record_evidence(record)
    except Exception as exc:
        logger.warning("could not record delivery evidence (step %s): %s", record.get("step"), _describe(exc))


async def _record_quietly(
    record_evidence: Callable[[dict[str, Any]], Awaitable[None]], record: dict[str, Any]
) -> None:
    """Append evidence once the outcome is decided: not even a cancellation may lose the outcome."""
    try:
        await _record(record_evidence, record)
    except asyncio.CancelledError:
        logger.warning("cancelled while recording delivery evidence (step %s); returning the outcome anyway",
                       record.get("step"))


# How many writes of one upload are in flight at once: 16 of 64 KiB keep a loopback or LAN link full.
PIPELINED_WRITES = 16


async def _upload(
    sftp: asyncssh.SFTPClient,
    local_path: str,
    temp_path: str,
    total: int,
    *,
    chunk_size: int,
    throttle_bytes_per_second: int,
    on_progress: Callable[[int, int], None] | None,
    operation_timeout: float,
) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    sent = 0
    # Each piece goes out as parallel SFTP writes of `chunk_size` (asyncssh pipelines a large write), so the link
    # and the cipher stay busy instead of waiting out a round trip per chunk. A throttled upload sends pieces of
    # about a quarter second, so that its rate stays smooth.
    piece = chunk_size * PIPELINED_WRITES
    if throttle_bytes_per_second > 0:
        piece = max(chunk_size, min(piece, throttle_bytes_per_second // 4 // chunk_size * chunk_size))
    async with _within(operation_timeout):
        # "wb" truncates: a temporary file left by an earlier attempt under the same name is simply replaced.
        remote = await sftp.open(temp_path, "wb", block_size=chunk_size, max_requests=PIPELINED_WRITES)
    # On failure the handle is not closed here: closing the connection releases it.
    # Local reads are blocking but short (a page-cache read of one piece); a thread would cost more.
    with open(local_path, "rb") as local:
        while chunk := local.read(piece):
            async with _within(operation_timeout):
                await remote.write(chunk, sent)
            sent += len(chunk)
            if on_progress is not None:
                on_progress(sent, total)
            if throttle_bytes_per_second > 0:
                # Sleep off any lead over the allowed average rate since the start of the upload.
                ahead = sent / throttle_bytes_per_second - (loop.time() - started)
                if ahead > 0:
                    await asyncio.sleep(ahead)
    async with _within(operation_timeout):
        await remote.close()
        attrs = await sftp.stat(temp_path)
    # The rename publishes whatever the temporary file holds, so it must be exactly the measured file.
    if sent != total or attrs.size != total:
        raise UploadIncomplete(f"expected {total} bytes, sent {sent}, temporary file holds {attrs.size}")


def classify(exc: BaseException, step: Step, fresh_listing: RemoteFile | None) -> DeliveryResult:
    """What a failed delivery means at the partner, from where it failed and a listing taken afterwards.

    `step` is where the delivery was: "connect" and "baseline" come before anything is written; "upload"
    ends just before the rename request is sent; "rename" lasts until the server answers it; "confirm" is the
    listing after an acknowledged rename. `fresh_listing` is the final name as listed on a new connection
    after the failure, or None when that listing could not be taken. The baseline is always "absent": a
    present final name never gets past the baseline.

    - connect/baseline: Failed/NotDelivered. No upload was started, so nothing can be at the partner.
    - upload: Failed/NotDelivered if the fresh listing still shows the final name absent: no rename was sent,
      and the temporary directory is invisible to the partner. A present final name was not put there by this
      delivery, but it is unexplained, so OutcomeUnknown.
    - rename refused by the server (an SFTP status reply, e.g. the name appeared after the baseline):
      Failed/NotDelivered only if the fresh listing still shows the final name absent, else OutcomeUnknown.
    - everything else is OutcomeUnknown: no fresh listing; a rename interrupted (timeout, lost connection,
      cancellation), because the server may have carried it out and the partner may already have taken
      the file; a failure after an acknowledged rename, which is left to a person to confirm.
    """
    error = _describe(exc)
    if step in _NOTHING_WRITTEN_YET:
        return DeliveryResult(
            outcome="Failed", failure_reason="NotDelivered",
            summary=f"not delivered: {step} failed before any upload started ({error})",
        )
    if fresh_listing is None:
        return DeliveryResult(
            outcome="OutcomeUnknown",
            summary=f"outcome unknown: {step} failed ({error}) and the final name could not be listed again",
        )
    if not fresh_listing.exists:
        if step == "upload":
            return DeliveryResult(
                outcome="Failed", failure_reason="NotDelivered",
                summary=f"not delivered: upload failed before the rename was sent ({error}); "
                        "final name still absent",
            )
        if step == "rename" and _refused_by_server(exc):
            return DeliveryResult(
                outcome="Failed", failure_reason="NotDelivered",
                summary=f"not delivered: the server refused the rename ({error}); final name still absent",
            )
        return DeliveryResult(
            outcome="OutcomeUnknown",
            summary=f"outcome unknown: {step} failed ({error}); final name absent, "
                    "but the partner may have taken it",
        )
    return DeliveryResult(
        outcome="OutcomeUnknown",
        summary=f"outcome unknown: {step} failed ({error}); final name now holds {fresh_listing.size} bytes "
                "that cannot be proven to be this delivery's",
    )


async def _fresh_listing_and_cleanup(
    dest: DestinationConfig, final_path: str, temp_path: str, timeout: float, *, remove_temp: bool
) -> tuple[RemoteFile | None, str | None]:
    """List the final name on a new connection, then, if `remove_temp`, remove the temporary file over the same
    connection.

    The listing and the removal are bounded by `timeout` each. Returns the listing (None if it could not be
    taken) and why it could not. Errors and cancellation are absorbed: see `deliver`.
    """
    listing: RemoteFile | None = None
    try:
        async with asyncio.timeout(timeout) as deadline:
            async with connect(dest, connect_timeout=timeout) as sftp:
                listing = await _listing(sftp, final_path)
                if remove_temp:
                    deadline.reschedule(asyncio.get_running_loop().time() + timeout)
                    try:
                        await sftp.remove(temp_path)
                    except asyncssh.SFTPNoSuchFile:
                        pass  # Never created, or already renamed into place.
    except _CAUGHT as exc:
        if listing is None:
            logger.warning("fresh listing of %s on %s failed: %s", final_path, dest.host, _describe(exc))
            return None, _describe(exc)
        logger.warning("could not remove temporary file %s on %s: %s", temp_path, dest.host, _describe(exc))
    return listing, None


async def deliver(
    dest: DestinationConfig,
    local_path: str,
    final_name: str,
    temp_name: str,
    *,
    record_evidence: Callable[[dict[str, Any]], Awaitable[None]],
    on_progress: Callable[[int, int], None] | None = None,
    throttle_bytes_per_second: int = 0,
    chunk_size: int = 64 * 1024,
    operation_timeout: float = 60.0,
    after_failure_timeout: float = AFTER_FAILURE_TIMEOUT_SECONDS,
    expected_sha256: str | None = None,
    replacement: Replacement | None = None,
) -> DeliveryResult:
    """Upload `local_path` to `temp_dir/temp_name`, then rename it to `final_dir/final_name` (no overwrite).

    Always returns a DeliveryResult, never raises for what happens at the partner, and never re-raises
    asyncio.CancelledError: a cancelled delivery is classified like any other failure, because the caller must
    still record the outcome. The task's cancellation request stays counted (Task.cancelling()), so the caller
    can tell.

    Each SFTP request is bounded by `operation_timeout`; the fresh listing and the cleanup after a failure by
    `after_failure_timeout` each. Raises ValueError only for names that are not plain file names.
    """
    for name in (final_name, temp_name):
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"not a plain file name: {name!r}")
    final_path = posixpath.join(dest.final_dir, final_name)
    temp_path = posixpath.join(dest.temp_dir, temp_name)
    step: Step = "connect"
    receipt: RemoteFile | None = None
    occupied: DeliveryResult | None = None
    content: str | None = None
    content_error: str | None = None
    acknowledged: str | None = None
    overwrite = False
    total = 0
    try:
        total = os.path.getsize(local_path)
        async with connect(dest) as sftp:
            step = "baseline"
            async with _within(operation_timeout):
                await _require_final_dir(sftp, dest)
                baseline = await _listing(sftp, final_path)
            await _record(record_evidence, {"step": "baseline", "final": baseline.model_dump()})
            if baseline.exists:
                decision, why = "FinalNameOccupied", "an original's name is unique to its key"
                if replacement is not None:
                    # A replacement reuses its original's name: the file may be the original's own delivery.
                    identified, why = await _identify(sftp, dest, final_path, final_name, baseline, replacement,
                                                      operation_timeout)
                    if identified:
                        decision = "OriginalDelivered"
                    elif replacement.overwrite_agreed:
                        decision, overwrite = "Overwrite", True
                await _record(record_evidence, {"step": "decision", "decision": decision, "why": why,
                                                "final": baseline.model_dump()})
                if not overwrite:
                    # Someone else's file, or the original's: never touch it, and upload nothing at all.
                    occupied = DeliveryResult(
                        outcome="Failed", failure_reason=decision,
                        summary=f"not delivered: {final_name} already exists at the partner "
                                f"({baseline.size} bytes); {why}",
                    )
                    logger.warning("final name %s on %s is occupied (%s); nothing uploaded", final_path,
                                   dest.host, decision)
                    return occupied
            step = "upload"
            await _upload(
                sftp, local_path, temp_path, total, chunk_size=chunk_size,
                throttle_bytes_per_second=throttle_bytes_per_second, on_progress=on_progress,
                operation_timeout=operation_timeout,
            )
            await _record(record_evidence, {"step": "rename", "temp": temp_path, "final": final_path,
                                            "bytes": total})
            step = "rename"
            async with _within(operation_timeout):
                if overwrite:
                    # Only a replacement with the partner's recorded agreement may replace the final file.
                    await sftp.posix_rename(temp_path, final_path)
                else:
                    # SFTP v3 rename fails if the final name exists, so a file that appeared after the
                    # listing is never replaced.
                    await sftp.rename(temp_path, final_path)
            step = "confirm"
            async with _within(operation_timeout):
                receipt = await _listing(sftp, final_path)
            if receipt.exists and receipt.size == total:
                try:
                    content = await _content_sha256(sftp, dest, final_path, operation_timeout)
                    if content is None and overwrite:
                        acknowledged = await _acknowledged_sha256(sftp, dest, final_name, operation_timeout)
                except _CAUGHT as exc:
                    # The receipt stands; only the evidence by content is missing, and the outcome says so.
                    content_error = _describe(exc)
                    logger.warning("could not hash %s on %s: %s", final_path, dest.host, content_error)
    except _CAUGHT as exc:
        if occupied is not None:
            return occupied  # The decision was made before the failure (recording it or closing).
        if receipt is None:
            return await _after_failure(exc, step, dest, final_path, temp_path, record_evidence,
                                        after_failure_timeout)
        # Only closing the connection failed; the receipt was already taken and stands.
        logger.warning("closing the connection after delivering %s failed: %s", final_path, _describe(exc))

    await _record_quietly(record_evidence, {"step": "receipt", "final": receipt.model_dump(),
                                            "expected_bytes": total, "sha256": content,
                                            "sha256_error": content_error, "acknowledged_sha256": acknowledged,
                                            "expected_sha256": expected_sha256, "overwrite": overwrite})
    outcome, summary, confirmed_by = outcomes.after_rename(receipt_look(receipt, content, content_error, acknowledged),
                                             final_name=final_name, expected_bytes=total,
                                             expected_sha256=expected_sha256, overwrite=overwrite,
                                             content_promised=dest.contract.hash_evidence != "none")
    log = logger.info if outcome == "Completed" else logger.warning
    log("delivery of %s to %s: %s", final_path, dest.host, summary)
    return DeliveryResult(outcome=outcome, summary=summary, confirmed_by=confirmed_by,
                          receipt=receipt if outcome == "Completed" else None)


def receipt_look(final: RemoteFile, sha256: str | None, sha256_error: str | None,
                 acknowledged_sha256: str | None) -> outcomes.FinalLook:
    return outcomes.FinalLook(exists=final.exists, size=final.size, sha256=sha256, sha256_error=sha256_error,
                              acknowledged_sha256=acknowledged_sha256)


async def _after_failure(
    exc: BaseException,
    step: Step,
    dest: DestinationConfig,
    final_path: str,
    temp_path: str,
    record_evidence: Callable[[dict[str, Any]], Awaitable[None]],
    timeout: float,
) -> DeliveryResult:
    logger.warning("delivery of %s to %s failed at step %s: %s", final_path, dest.host, step, _describe(exc))
    if step in _NOTHING_WRITTEN_YET:
        result = classify(exc, step, None)
        await _record_quietly(record_evidence, {
            "step": "failure", "failed_step": step, "error": _describe(exc),
            "outcome": result.outcome, "failure_reason": result.failure_reason,
        })
        return result
    # A rename that was sent and not refused may still be under way in the server (OpenSSH links the new name and
    # then unlinks the old one): removing the temporary name now could make it take the final name back. So after
    # an uncertain rename, or once it was acknowledged, touch nothing; the partner sweep removes the temporary file
    # later, by its age.
    settled = step == "upload" or (step == "rename" and _refused_by_server(exc))
    listing, listing_error = await _fresh_listing_and_cleanup(dest, final_path, temp_path, timeout,
                                                              remove_temp=settled)
    result = classify(exc, step, listing)
    await _record_quietly(record_evidence, {
        "step": "fresh_listing", "failed_step": step, "error": _describe(exc),
        "final": listing.model_dump() if listing is not None else None, "listing_error": listing_error,
        "outcome": result.outcome, "failure_reason": result.failure_reason, "temp_left": not settled,
    })
    return result
