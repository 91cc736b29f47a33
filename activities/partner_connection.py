"""The SSH/SFTP session with a partner: its client key from `credential_ref`, the destination's pinned host key as
the only trusted one, the ciphers the client prefers, and the bound on each request (`within`)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import asyncssh
from asyncssh.encryption import get_default_encryption_algs

from activities.destination import DestinationConfig
from activities.process.tracing import spanned

logger = logging.getLogger(__name__)


@asynccontextmanager
async def within(seconds: float) -> AsyncIterator[None]:
    """asyncio.timeout whose TimeoutError says what did not answer, and within how long."""
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError as exc:
        if str(exc):
            raise
        raise TimeoutError(f"no answer from the partner within {seconds:g} s") from None


class HostKeyMismatch(Exception):
    """The server presented a host key other than the pinned one."""


# Parsed keys by their source as it was read: parsing an RSA key makes `cryptography` check it, about 110 ms of CPU
# for 3,072 bits, on the event loop, and the key is asked for at every connection and every look. A rewritten file
# (another inode, size or time) or another text is parsed again. Bounded: a worker serves few credentials.
_PARSED_KEYS: OrderedDict[tuple[object, ...], asyncssh.SSHKey] = OrderedDict()
_PARSED_KEYS_KEPT = 64


def load_client_key(credential_ref: str) -> asyncssh.SSHKey:
    """The client's private key from "file:<path>" or "env:<VARNAME>", read again each time and parsed only when
    what was read differs from the last time. Errors never include the key text."""
    scheme, _, rest = credential_ref.partition(":")
    if scheme == "file" and rest:
        # The file as it is now (`~` expanded, as asyncssh's own reading does): a key it no longer gives is never used.
        with open(Path(rest).expanduser(), "rb") as file:
            stat = os.fstat(file.fileno())
            source: tuple[object, ...] = ("file", rest, stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns,
                                          stat.st_ctime_ns)
            if (key := _parsed(source)) is not None:
                return key
            data = file.read()
        key = asyncssh.import_private_key(data)
        key.set_filename(rest)  # as asyncssh.read_private_key names it
        return _keep(source, key)
    if scheme == "env" and rest:
        text = os.environ.get(rest)
        if not text:
            raise ValueError(f"credential_ref names environment variable {rest!r}, which is unset or empty")
        source = ("env", rest, hashlib.sha256(text.encode()).digest())
        if (key := _parsed(source)) is not None:
            return key
        return _keep(source, asyncssh.import_private_key(text))
    raise ValueError(
        f"unsupported credential_ref scheme {scheme!r}: expected 'file:<path>' or 'env:<VARNAME>'"
    )


def _parsed(source: tuple[object, ...]) -> asyncssh.SSHKey | None:
    key = _PARSED_KEYS.get(source)
    if key is not None:
        _PARSED_KEYS.move_to_end(source)
    return key


def _keep(source: tuple[object, ...], key: asyncssh.SSHKey) -> asyncssh.SSHKey:
    _PARSED_KEYS[source] = key
    while len(_PARSED_KEYS) > _PARSED_KEYS_KEPT:
        _PARSED_KEYS.popitem(last=False)
    return key


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


# Who connects to whom: a connection opened for one destination may serve another only if all of these match.
ConnectionKey = tuple[str, int, str, str, bytes]


def connection_key(dest: DestinationConfig, client_key: asyncssh.SSHKey) -> ConnectionKey:
    """The host, port, user name, pinned host key and client key (`client_key`, the one `dest.credential_ref`
    names) that an SSH connection to `dest` was opened with."""
    return dest.host, dest.port, dest.username, dest.host_key.strip(), client_key.public_data


# Fresh handshakes allowing only the pinned key's type that must all be cut or refused before a server whose key of
# another type answered is taken to lack the pinned type.
_PINNED_TYPE_TRIES = 2


async def _lacks_pinned_key_type(dest: DestinationConfig, pinned: asyncssh.SSHKey, timeout: float) -> bool:
    """Whether the server answers a handshake that allows any type with a key of another type, and cuts or refuses
    each of _PINNED_TYPE_TRIES fresh ones that allow only the pinned key's type.

    A cut by itself proves nothing: a server dropping excess connections (OpenSSH's MaxStartups) or a flaky link
    cuts too. So only what tells a refusal from a cut is asked, any type first: a probe that gets no answer, or a
    key of the pinned type (the server holds that type), leaves the first failure standing, a transient one."""
    try:
        offered = await server_host_key(dest, "default", timeout)
    except (asyncssh.Error, OSError):
        return False
    if offered is None or offered.get_algorithm() == pinned.get_algorithm():
        return False
    algorithms = [alg.decode() for alg in pinned.sig_algorithms]
    for _ in range(_PINNED_TYPE_TRIES):
        try:
            await server_host_key(dest, algorithms, timeout)
            return False  # a key of the pinned type: the server holds that type
        except asyncssh.KeyExchangeFailed as exc:
            if "host key" not in str(exc).lower():  # only a refusal of the type counts
                return False
        except (asyncssh.ConnectionLost, ConnectionResetError):
            pass  # sshd refuses by a cut, so does a flaky link: only a cut on every try counts
        except (asyncssh.Error, OSError):
            return False
    return True


# SSH keepalives (asyncssh's are off by default): a partner that goes silent (packets dropped, no reset) is given up
# on after this many unanswered keepalives, one each `connect_timeout / (KEEPALIVE_COUNT_MAX + 1)` of silence: within
# `connect_timeout` in all, not at the end of a request's own bound (up to a minute) or never between requests.
KEEPALIVE_COUNT_MAX = 3

# asyncssh's own ciphers, AES-GCM first: the client's order decides, and on a CPU with AES instructions AES-GCM
# moves about twice the bytes of ChaCha20-Poly1305 per second of CPU. Nothing is added or dropped.
CIPHERS = sorted((alg.decode() for alg in get_default_encryption_algs()), key=lambda alg: "-gcm@" not in alg)


@asynccontextmanager
async def connect(
    dest: DestinationConfig, *, connect_timeout: float = 10.0
) -> AsyncIterator[asyncssh.SFTPClient]:
    """An SFTP session with the partner, whose host key must be exactly `dest.host_key`, closed on exit.

    Raises HostKeyMismatch for any other key, ValueError for a bad credential_ref or host_key, asyncssh.Error
    or OSError (including TimeoutError) when the server cannot be reached within `connect_timeout`. Once
    connected, a server silent for `connect_timeout` (keepalives unanswered) ends the session: asyncssh's
    ConnectionLost.
    """
    conn, sftp = await open_session(dest, connect_timeout=connect_timeout)
    try:
        yield sftp
    finally:
        await close_session(dest, conn, sftp, timeout=connect_timeout)


async def close_session(dest: DestinationConfig, conn: asyncssh.SSHClientConnection,
                        sftp: asyncssh.SFTPClient | None, *, timeout: float) -> None:
    """Ends the session and its connection, waiting at most `timeout` for the goodbye."""
    try:
        if sftp is not None:
            sftp.exit()
    finally:
        conn.close()
        try:
            async with asyncio.timeout(timeout):
                await conn.wait_closed()
        except (asyncssh.Error, OSError) as exc:
            # The session's work is done or already failed; a slow goodbye changes nothing.
            logger.debug("closing the connection to %s:%d: %s", dest.host, dest.port, exc)


async def open_session(dest: DestinationConfig, *, connect_timeout: float = 10.0,
                       client_key: asyncssh.SSHKey | None = None,
                       ) -> tuple[asyncssh.SSHClientConnection, asyncssh.SFTPClient]:
    """`connect`'s session, for a caller that closes it (`close_session`) when it will: its connection and its
    SFTP client. `client_key`, when given, is the one `dest.credential_ref` names, already loaded."""
    client_key = client_key if client_key is not None else load_client_key(dest.credential_ref)
    pinned = _pinned_host_key(dest.host_key)
    logger.info("connecting to partner %s:%d as %s", dest.host, dest.port, dest.username)
    try:
        conn = await spanned("sftp connect", **{"rpc.system": "sftp"})(asyncssh.connect)(
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
            keepalive_interval=connect_timeout / (KEEPALIVE_COUNT_MAX + 1),
            keepalive_count_max=KEEPALIVE_COUNT_MAX,
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
        # close before its reason is read; only asking again tells that apart from a connection that failed, and
        # anything short of a clear refusal leaves this failure standing: transient, never a mismatch.
        if await _lacks_pinned_key_type(dest, pinned, connect_timeout):
            raise _no_key_of_pinned_type(dest, pinned) from exc
        raise
    try:
        async with asyncio.timeout(connect_timeout):
            return conn, await conn.start_sftp_client()
    except BaseException:
        await close_session(dest, conn, None, timeout=connect_timeout)
        raise
