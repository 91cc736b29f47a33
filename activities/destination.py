"""A partner's destination as the delivery acts on it: where its SFTP server is, how to reach it, and the contract
agreed with it (the `destinations` row as a model), and the one check of that row (`validate_destination`), used by
`exports destinations add`/`update` and by the policy that rejects an export before its claim."""

from __future__ import annotations

import ipaddress
import posixpath
import re
import unicodedata
from collections.abc import Mapping
from typing import Any, Literal, TypeGuard, get_args

import asyncssh
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


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
    # How many sessions the partner accepts at once (its MaxSessions, say); None: no limit. No more uploads than
    # that run to it across all workers (migration 0011, take_partner_session.sql).
    max_sessions: int | None = Field(None, ge=1, le=1000)


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
                                     temp_file_max_age_seconds=row["temp_file_max_age_seconds"],
                                     max_sessions=row.get("max_sessions")),
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
MAX_SESSIONS = 1000  # the table's CHECK (migration 0011)
MAX_HOST = 253  # a DNS name
MAX_USERNAME = 200
MAX_PATH = 1024
MAX_HOST_KEY = 8192  # an RSA key of 16384 bits is a line of about 2,800 characters
MIN_TEMP_FILE_MAX_AGE_SECONDS = 43200  # the table's CHECK: far above the delivery's six-hour timeout
MAX_TEMP_FILE_MAX_AGE_SECONDS = 2**31 - 1  # an int column
HASH_EVIDENCE: tuple[str, ...] = get_args(PartnerContract.model_fields["hash_evidence"].annotation)

# A DNS name's label (underscores too, as some internal names have them): never empty, never at a hyphen's edge.
_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")
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
    if not _is_host(row["host"]):
        return f"host {row['host']!r} is not a host name or an IP address (a port goes in port)"
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
    sessions = row.get("max_sessions")
    if sessions is not None and (not _whole(sessions) or not 1 <= sessions <= MAX_SESSIONS):
        return f"max_sessions must be a whole number from 1 to {MAX_SESSIONS}, or none for no limit"
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


def _whole(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _directory(path: str) -> str:
    # One spelling per directory: "/out", "/out/", "//out" and "/a/../out/." are the same one.
    return "/" + posixpath.normpath(path).lstrip("/")


def _is_host(text: str) -> bool:
    """A DNS name or an IP address, nothing else: no port, no empty label, nothing that starts like an option."""
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        pass
    name = text.removesuffix(".")
    return 0 < len(name) <= MAX_HOST and all(_LABEL.fullmatch(label) for label in name.split("."))


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
