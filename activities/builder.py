"""The builder: a tenant's contacts streamed to a local CSV with COPY, sized and hashed while it streams.

Reversible work: a local file. Cancellation of the calling task propagates unwrapped and removes the partial
file; every other failure is wrapped in BuildError.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import BinaryIO
from uuid import UUID

import asyncpg

from activities.patience import run_to_end
from store import errors
from store.db import Bounds, RawConnections

log = logging.getLogger(__name__)

CONTACTS_QUERY = (
    "SELECT id, email, first_name, last_name, phone, updated_at FROM contacts WHERE tenant_id = $1 ORDER BY id"
)


def contacts_query(tenant_id: UUID) -> str:
    """CONTACTS_QUERY for one tenant, its ID written in: COPY takes no parameters, and asyncpg's copy_from_query
    with arguments asks the server to quote them (a round trip per build). A UUID's text is hex digits and
    hyphens only, so it needs no quoting of its own."""
    return CONTACTS_QUERY.replace("$1", f"'{UUID(str(tenant_id))}'::uuid")


class BuildError(Exception):
    """The build failed for a reason other than a stop; nothing has left the process."""

    @property
    def disk_full(self) -> bool:
        """The local disk (or the user's quota) had no room: space another build holds may be freed soon."""
        cause: BaseException | None = self.__cause__
        while cause is not None:
            if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
                return True
            cause = cause.__cause__ or cause.__context__
        return False

    @property
    def database_away(self) -> bool:
        """PostgreSQL went away mid-build (a cut connection, a restart, a timeout): another try may succeed. Not a
        local file's error (an OSError that is no connection's), nor the server's answer to the query."""
        cause = self.__cause__
        if cause is None or (isinstance(cause, OSError) and not isinstance(cause, (ConnectionError, TimeoutError))):
            return False
        return isinstance(cause, asyncpg.ConnectionDoesNotExistError) or errors.is_transient(cause)


class _HashingSink:
    def __init__(self, handle: BinaryIO, on_progress: Callable[[int], None], throttle_bytes_per_second: int) -> None:
        self.handle = handle
        self.sha256 = hashlib.sha256()
        self.size = 0
        self.on_progress = on_progress
        self.throttle = throttle_bytes_per_second
        self.started = time.monotonic()

    async def __call__(self, chunk: bytes) -> None:
        if not self.throttle:
            self._write(chunk)
            return
        # asyncpg hands over whatever one socket read returned, the whole file at once when the server is ahead;
        # a throttled build (a setting for demos and tests) paces tenth-of-a-second slices so progress stays smooth.
        step = max(1, self.throttle // 10)
        for start in range(0, len(chunk), step):
            self._write(chunk[start:start + step])
            ahead = self.size / self.throttle - (time.monotonic() - self.started)
            if ahead > 0:
                await asyncio.sleep(ahead)

    def _write(self, chunk: bytes) -> None:
        self.handle.write(chunk)
        self.sha256.update(chunk)
        self.size += len(chunk)
        self.on_progress(self.size)


def copy_connections(url: str, bounds: Bounds | None = None, *, most: int) -> RawConnections:
    """Connections for builds' COPYs, `most` at once, kept between builds. No statement bound: a COPY may rightly
    run long. Keepalives see a server gone silent during a COPY; a kept connection is asked a bounded question
    before its next one (store/db.py)."""
    return RawConnections("COPY", url, replace(bounds or Bounds.defaults(), statement_seconds=None), most=most)


async def build_contacts_csv(
    connections: RawConnections,
    tenant_id: UUID,
    path: Path,
    *,
    on_progress: Callable[[int], None] = lambda size: None,
    throttle_bytes_per_second: int = 0,
) -> tuple[int, str]:
    """Write the tenant's contacts to `path`, through one of `connections` (`copy_connections`); returns (bytes,
    sha256 hex). The file is written under `partial_path(path)` and renamed to `path` once whole and synced, so a
    file under `path` is always a finished build (a resumption may deliver it: see the build activity). A COPY
    abandoned midway leaves its connection unusable: `connections` terminates it rather than wait on it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(path)
    finished = False
    try:
        async with connections.connection() as conn:
            with open(partial, "wb") as handle:
                sink = _HashingSink(handle, on_progress, throttle_bytes_per_second)
                await conn.copy_from_query(contacts_query(tenant_id), output=sink, format="csv", header=True)
                await _synced(handle)
        os.replace(partial, path)
        finished = True
        return sink.size, sink.sha256.hexdigest()
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        raise BuildError(f"{type(exc).__name__}: {exc}") from exc
    finally:
        if not finished:
            remove_local_file(partial)


# The builds' syncs have threads of their own: a stalled disk holds these, never the loop's default executor, which
# also resolves host names for every new PostgreSQL and SFTP connection.
_SYNCS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="build-sync")


async def _synced(handle: BinaryIO) -> None:
    """Flush and fsync the file in a thread: on a disk that stalls (a network volume, a failing device) a sync on
    the event loop stood the whole worker still, its heartbeats, renewals and stops with it. A cancellation (a stop)
    waits for the sync to return, so that the file is not closed under it, and is then raised."""
    cancelled = False

    def note_cancel() -> None:
        nonlocal cancelled
        cancelled = True

    syncing = asyncio.get_running_loop().run_in_executor(_SYNCS, _flush_and_fsync, handle)
    await run_to_end(syncing, on_cancel=note_cancel)
    if cancelled:
        raise asyncio.CancelledError


def _flush_and_fsync(handle: BinaryIO) -> None:
    handle.flush()
    os.fsync(handle.fileno())


def partial_path(path: Path) -> Path:
    return path.with_name(path.name + ".partial")


def size_and_sha256(path: Path) -> tuple[int, str]:
    """What a finished build file holds, read back from the disk."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def remove_local_file(path: Path | str) -> bool:
    """Best effort, never raises. A failure is logged for the scavenger: it is contact data on disk."""
    try:
        Path(path).unlink(missing_ok=True)
        return True
    except OSError as exc:
        log.error("could not remove local export file %s, leaving it for the scavenger: %s", path, exc)
        return False
