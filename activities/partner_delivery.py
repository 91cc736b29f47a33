"""One delivery of a local file to a partner's SFTP server, and what the partner side then is (`deliver`); the
temporary names it writes under, and the sweep of those the partner was left with.

The partner processes whatever appears under its final directory, so the file is written under a temporary
name that the partner ignores and then moved into place with the SFTP v3 `rename`, which refuses to replace an
existing name. That rename is the one irreversible step: everything before it can be proven undelivered by a
fresh listing, everything from it on can only be proven delivered by a listing that confirms it. What a failure
means is decided by the rules in activities/outcomes.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import posixpath
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypedDict, cast
from uuid import UUID

import asyncssh

from activities import outcomes
from activities.delivery_connections import DeliveryConnections
from activities.destination import DestinationConfig, Replacement
from activities.outcomes import NOTHING_WRITTEN_YET, DeliveryResult, RemoteFile, Step, classify, describe
from activities.partner_connection import connect, within
from activities.partner_files import acknowledged_sha256, content_sha256, identify, list_file, require_final_dir
from activities.process.tracing import spanned

logger = logging.getLogger(__name__)

# Bounds for the work done after a failure: a fresh listing, then removing the temporary file.
AFTER_FAILURE_TIMEOUT_SECONDS = 10.0

# What a delivery catches and classifies. Exception, not a list of transport errors: an unexpected error
# in the middle of an upload leaves the partner side just as uncertain, and the caller still needs an outcome.
_CAUGHT = (Exception, asyncio.CancelledError)


class RenameFenceRefused(Exception):
    """The export's row no longer lets this attempt rename (recovery took it back): the rename is never sent."""


class UploadIncomplete(Exception):
    """The temporary file does not hold exactly the bytes of the local file, so it must not be renamed."""


async def deliver(
    dest: DestinationConfig,
    local_path: str,
    final_name: str,
    temp_name: str,
    *,
    record_evidence: Callable[[dict[str, Any]], Awaitable[None]],
    on_progress: Callable[[int, int], None] | None = None,
    throttle_bytes_per_second: int = 0,
    chunk_size: int | None = None,
    operation_timeout: float = 60.0,
    after_failure_timeout: float = AFTER_FAILURE_TIMEOUT_SECONDS,
    expected_sha256: str | None = None,
    replacement: Replacement | None = None,
    pass_rename_fence: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
    connections: DeliveryConnections | None = None,
) -> DeliveryResult:
    """Upload `local_path` to `temp_dir/temp_name`, then rename it to `final_dir/final_name` (no overwrite).

    Always returns a DeliveryResult, never raises for what happens at the partner, and never re-raises
    asyncio.CancelledError: a cancelled delivery is classified like any other failure, because the caller must
    still record the outcome. The task's cancellation request stays counted (Task.cancelling()), so the caller
    can tell.

    `pass_rename_fence`, given the "step rename" evidence, is the last thing before the rename request: it raises
    unless the attempt may still rename (the activity's conditional write on the export's row), and the failure is
    then one before the rename was sent. Without it, that record is appended like any other (callers with no row).

    `connections`, when given, are the worker's kept connections: the session opens on one where it may
    (activities/delivery_connections.py). Without them, on a connection of its own.

    `chunk_size` is the size of one SFTP write; by default the partner's own limit (see `write_size`).
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
        async with connect(dest) if connections is None else connections.session(dest) as sftp:
            step = "baseline"
            occupied, overwrite = await _baseline(sftp, dest, final_path, final_name, replacement, record_evidence,
                                                  operation_timeout)
            if occupied is not None:
                return occupied
            step = "upload"
            await _upload(
                sftp, local_path, temp_path, total, chunk_size=chunk_size,
                throttle_bytes_per_second=throttle_bytes_per_second, on_progress=on_progress,
                operation_timeout=operation_timeout,
            )
            before_rename = {"step": "rename", "temp": temp_path, "final": final_path, "bytes": total}
            if pass_rename_fence is None:
                await _record(record_evidence, before_rename)
            else:
                await pass_rename_fence(before_rename)  # raises unless the row still lets this attempt rename
            step = "rename"
            await _rename(sftp, temp_path, final_path, overwrite, operation_timeout)
            step = "confirm"
            async with within(operation_timeout):
                receipt = await list_file(sftp, final_path)
            if receipt.exists and receipt.size == total:
                content, content_error, acknowledged = await _evidence_by_content(
                    sftp, dest, final_path, final_name, overwrite, operation_timeout)
    except _CAUGHT as exc:
        if occupied is not None:
            return occupied  # The decision was made before the failure (recording it or closing).
        if receipt is None:
            return await _after_failure(exc, step, dest, final_path, temp_path, record_evidence,
                                        after_failure_timeout)
        # Only closing the connection failed; the receipt was already taken and stands.
        logger.warning("closing the connection after delivering %s failed: %s", final_path, describe(exc))

    await _record_quietly(record_evidence, {"step": "receipt", "final": receipt.model_dump(),
                                            "expected_bytes": total, "sha256": content,
                                            "sha256_error": content_error, "acknowledged_sha256": acknowledged,
                                            "expected_sha256": expected_sha256, "overwrite": overwrite})
    outcome, summary, confirmed_by = outcomes.after_rename(
        outcomes.receipt_look(receipt, content, content_error, acknowledged), final_name=final_name,
        expected_bytes=total, expected_sha256=expected_sha256, overwrite=overwrite,
        content_promised=dest.contract.hash_evidence != "none")
    log = logger.info if outcome == "Completed" else logger.warning
    log("delivery of %s to %s: %s", final_path, dest.host, summary)
    return DeliveryResult(outcome=outcome, summary=summary, confirmed_by=confirmed_by,
                          receipt=receipt if outcome == "Completed" else None)


async def _baseline(
    sftp: asyncssh.SFTPClient, dest: DestinationConfig, final_path: str, final_name: str,
    replacement: Replacement | None, record_evidence: Callable[[dict[str, Any]], Awaitable[None]],
    operation_timeout: float,
) -> tuple[DeliveryResult | None, bool]:
    """List the final name before anything is written, and record it. Returns the result that ends the delivery
    here (an occupied name, never touched), or None and whether the rename may overwrite (an agreed one)."""
    async with within(operation_timeout):
        await require_final_dir(sftp, dest)
        baseline = await list_file(sftp, final_path)
    await _record(record_evidence, {"step": "baseline", "final": baseline.model_dump()})
    if not baseline.exists:
        return None, False
    identified = None
    if replacement is not None:
        identified = await identify(sftp, dest, final_path, final_name, baseline, replacement, operation_timeout)
    decision, why, occupied = outcomes.occupied_final_name(
        final_name, baseline, identified, overwrite_agreed=replacement is not None and replacement.overwrite_agreed)
    await _record(record_evidence, {"step": "decision", "decision": decision, "why": why,
                                    "final": baseline.model_dump()})
    if occupied is not None:
        logger.warning("final name %s on %s is occupied (%s); nothing uploaded", final_path, dest.host, decision)
    return occupied, occupied is None


@spanned("sftp rename", **{"rpc.system": "sftp"})
async def _rename(sftp: asyncssh.SFTPClient, temp_path: str, final_path: str, overwrite: bool,
                  operation_timeout: float) -> None:
    """The one irreversible step: the temporary file takes the final name."""
    async with within(operation_timeout):
        if overwrite:
            # Only a replacement with the partner's recorded agreement may replace the final file.
            await sftp.posix_rename(temp_path, final_path)
        else:
            # SFTP v3 rename fails if the final name exists, so a file that appeared after the
            # listing is never replaced.
            await sftp.rename(temp_path, final_path)


@spanned("sftp evidence read", **{"rpc.system": "sftp"})
async def _evidence_by_content(sftp: asyncssh.SFTPClient, dest: DestinationConfig, final_path: str,
                               final_name: str, overwrite: bool,
                               operation_timeout: float) -> tuple[str | None, str | None, str | None]:
    """The received file's SHA-256 as the contract offers it, why it could not be had, and (after an overwrite
    without one) the partner's acknowledgment. The receipt stands either way."""
    content = error = acknowledged = None
    try:
        content = await content_sha256(sftp, dest, final_path, operation_timeout)
        if content is None and overwrite:
            acknowledged = await acknowledged_sha256(sftp, dest, final_name, operation_timeout)
    except _CAUGHT as exc:
        # Only the evidence by content is missing, and the outcome says so.
        error = describe(exc)
        logger.warning("could not hash %s on %s: %s", final_path, dest.host, error)
    return content, error, acknowledged


async def _after_failure(
    exc: BaseException,
    step: Step,
    dest: DestinationConfig,
    final_path: str,
    temp_path: str,
    record_evidence: Callable[[dict[str, Any]], Awaitable[None]],
    timeout: float,
) -> DeliveryResult:
    logger.warning("delivery of %s to %s failed at step %s: %s", final_path, dest.host, step, describe(exc))
    before_rename = {"before_rename": step in (*NOTHING_WRITTEN_YET, "upload")}
    if step in NOTHING_WRITTEN_YET:
        result = _retry_safe_if_transient(classify(exc, step, None), exc).model_copy(update=before_rename)
        await _record_quietly(record_evidence, {
            "step": "failure", "failed_step": step, "error": describe(exc),
            "outcome": result.outcome, "failure_reason": result.failure_reason,
        })
        return result
    settled = outcomes.temp_file_removable(exc, step)
    listing, listing_error, removed = await _fresh_listing_and_cleanup(dest, final_path, temp_path, timeout,
                                                                       remove_temp=settled)
    result = classify(exc, step, listing).model_copy(update=before_rename)
    if step == "upload" and settled:
        result = _retry_safe_if_transient(result, exc)
    await _record_quietly(record_evidence, {
        "step": "fresh_listing", "failed_step": step, "error": describe(exc),
        "final": listing.model_dump() if listing is not None else None, "listing_error": listing_error,
        "outcome": result.outcome, "failure_reason": result.failure_reason, "temp_left": not removed,
    })
    return result


# Faults that may pass between two tries: the connection cut or reset, a timeout, a temporary file that came out
# short, a session that could not open because the connection closed meanwhile or the partner was short of
# resources. Not a host key, a credential, a missing directory or a refusal by the server (a session
# administratively prohibited): another try would meet them.
_TRANSIENT = (asyncssh.ConnectionLost, asyncssh.SFTPConnectionLost, asyncssh.SFTPNoConnection, ConnectionError,
              TimeoutError, UploadIncomplete)
_SESSION_NOT_OPENED_FOR_NOW = (asyncssh.OPEN_CONNECT_FAILED, asyncssh.OPEN_RESOURCE_SHORTAGE)


def _may_pass(exc: BaseException) -> bool:
    if isinstance(exc, asyncssh.ChannelOpenError):
        return exc.code in _SESSION_NOT_OPENED_FOR_NOW
    return isinstance(exc, _TRANSIENT)


def _retry_safe_if_transient(result: DeliveryResult, exc: BaseException) -> DeliveryResult:
    """A Failed/NotDelivered result (proven: nothing at the final name from this delivery) marked safe to try again,
    when its fault may pass. Never after a cancellation: the caller is being stopped."""
    if result.failure_reason != "NotDelivered" or isinstance(exc, asyncio.CancelledError):
        return result
    if not _may_pass(exc):
        return result
    return result.model_copy(update={"retry_safe": True})


async def _fresh_listing_and_cleanup(
    dest: DestinationConfig, final_path: str, temp_path: str, timeout: float, *, remove_temp: bool
) -> tuple[RemoteFile | None, str | None, bool]:
    """List the final name on a new connection, then, if `remove_temp`, remove the temporary file over the same
    connection.

    The listing and the removal are bounded by `timeout` each. Returns the listing (None if it could not be
    taken), why it could not, and whether the temporary file is known gone (a removal that failed leaves it for
    the partner sweep, and the evidence says so). Errors and cancellation are absorbed: see `deliver`.
    """
    listing: RemoteFile | None = None
    removed = False
    try:
        async with asyncio.timeout(timeout) as deadline:
            async with connect(dest, connect_timeout=timeout) as sftp:
                listing = await list_file(sftp, final_path)
                if remove_temp:
                    deadline.reschedule(asyncio.get_running_loop().time() + timeout)
                    try:
                        await sftp.remove(temp_path)
                    except asyncssh.SFTPNoSuchFile:
                        pass  # Never created, or already renamed into place.
                    removed = True
    except _CAUGHT as exc:
        if listing is None:
            logger.warning("fresh listing of %s on %s failed: %s", final_path, dest.host, describe(exc))
            return None, describe(exc), False
        logger.warning("could not remove temporary file %s on %s: %s", temp_path, dest.host, describe(exc))
    return listing, None, removed


async def _record(
    record_evidence: Callable[[dict[str, Any]], Awaitable[None]], record: dict[str, Any]
) -> None:
    """Append evidence; a failed write is logged, never allowed to change what happens at the partner.

    CancelledError propagates: before the rename it must stop the delivery like any other cancellation.
    """
    try:
        await record_evidence(record)
    except Exception as exc:
        logger.warning("could not record delivery evidence (step %s): %s", record.get("step"), describe(exc))


async def _record_quietly(
    record_evidence: Callable[[dict[str, Any]], Awaitable[None]], record: dict[str, Any]
) -> None:
    """Append evidence once the outcome is decided: not even a cancellation may lose the outcome."""
    try:
        await _record(record_evidence, record)
    except asyncio.CancelledError:
        logger.warning("cancelled while recording delivery evidence (step %s); returning the outcome anyway",
                       record.get("step"))


# How much of one upload is in flight at once: 1 MiB keeps a loopback or LAN link full, within OpenSSH's 2 MiB
# channel window.
IN_FLIGHT_BYTES = 1024 * 1024
# The size of one SFTP write when the caller does not choose it: as large as the partner announces it accepts
# (limits@openssh.com; OpenSSH's sftp-server 255 KiB), between these bounds. This client's cost is per SSH packet,
# not per byte, and a write leaves as packets of the partner's size (32 KiB at OpenSSH), so a 64 KiB write costs
# two full packets and a 29-byte one: 255 KiB writes deliver about 30% more per CPU second (docs/design.md).
# Without the announcement, 64 KiB, which every server met so far accepts.
MIN_WRITE_BYTES = 64 * 1024
MAX_WRITE_BYTES = 256 * 1024
# A throttled upload (a demo's or a test's slow link) keeps small writes, so that its rate stays smooth.
THROTTLED_WRITE_BYTES = 64 * 1024


def write_size(sftp: asyncssh.SFTPClient) -> int:
    return min(MAX_WRITE_BYTES, max(MIN_WRITE_BYTES, sftp.limits.max_write_len))


def piece_size(chunk_size: int) -> int:
    """Bytes handed to one pipelined write: whole chunks, about IN_FLIGHT_BYTES."""
    return chunk_size * max(1, IN_FLIGHT_BYTES // chunk_size)


@spanned("sftp upload", **{"rpc.system": "sftp"})
async def _upload(
    sftp: asyncssh.SFTPClient,
    local_path: str,
    temp_path: str,
    total: int,
    *,
    chunk_size: int | None,
    throttle_bytes_per_second: int,
    on_progress: Callable[[int, int], None] | None,
    operation_timeout: float,
) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    sent = 0
    if chunk_size is None:
        chunk_size = THROTTLED_WRITE_BYTES if throttle_bytes_per_second > 0 else write_size(sftp)
    # Each piece goes out as parallel SFTP writes of `chunk_size` (asyncssh pipelines a large write), so the link
    # and the cipher stay busy instead of waiting out a round trip per chunk. A throttled upload sends pieces of
    # about a quarter second, so that its rate stays smooth.
    piece = piece_size(chunk_size)
    if throttle_bytes_per_second > 0:
        piece = max(chunk_size, min(piece, throttle_bytes_per_second // 4 // chunk_size * chunk_size))
    async with within(operation_timeout):
        # "wb" truncates: a temporary file left by an earlier attempt under the same name is simply replaced.
        remote = await sftp.open(temp_path, "wb", block_size=chunk_size, max_requests=piece // chunk_size)
    # On failure the handle is not closed here: closing the connection releases it.
    # Local reads are blocking but short (a page-cache read of one piece); a thread would cost more.
    with open(local_path, "rb") as local:
        while chunk := local.read(piece):
            async with within(operation_timeout):
                await remote.write(chunk, sent)
            sent += len(chunk)
            if on_progress is not None:
                on_progress(sent, total)
            if throttle_bytes_per_second > 0:
                # Sleep off any lead over the allowed average rate since the start of the upload.
                ahead = sent / throttle_bytes_per_second - (loop.time() - started)
                if ahead > 0:
                    await asyncio.sleep(ahead)
    async with within(operation_timeout):
        await remote.close()
        attrs = await sftp.stat(temp_path)
    # The rename publishes whatever the temporary file holds, so it must be exactly the measured file.
    if sent != total or attrs.size != total:
        raise UploadIncomplete(f"expected {total} bytes, sent {sent}, temporary file holds {attrs.size}")


# Our temporary names: ".<final name>.<attempt ID>.part" (see the deliver activity).
_UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
TEMP_NAME = re.compile(rf"^\.(?P<final>.+)\.(?P<attempt>{_UUID})\.part$")


def temp_file_name(final_name: str, attempt_id: UUID) -> str:
    return f".{final_name}.{attempt_id}.part"


class SweptFiles(TypedDict):
    """What a sweep of a partner's temporary directory did: the names removed, kept, and the failed removals."""

    removed: list[str]
    kept: list[str]
    failed: list[str]


async def sweep_temp_files(dest: DestinationConfig, *, is_ours: Callable[[str], Awaitable[bool]],
                           is_live: Callable[[UUID], Awaitable[bool]], timeout: float = 30.0) -> SweptFiles:
    """Remove our temporary files in the destination's temp_dir that are older than the partner's contract allows
    (recovery cannot tell a dead worker from a paused one, so only age can) and whose attempt is not live
    (`is_live`: still Delivering). Ours means named after a final name of this destination's exports (`is_ours`):
    another tenant's files in a shared directory, and files of other names, are never touched.
    Returns the names removed, kept (too young or live), and the removals that failed, with why."""
    found: SweptFiles = {"removed": [], "kept": [], "failed": []}
    async with asyncio.timeout(timeout):
        async with connect(dest, connect_timeout=timeout) as sftp:
            names = await sftp.readdir(dest.temp_dir)
            cutoff = time.time() - dest.contract.temp_file_max_age_seconds
            for entry in names:
                filename = cast(str, entry.filename)  # a directory named by a str lists str names
                match = TEMP_NAME.match(filename)
                if match is None or not await is_ours(match["final"]):
                    continue
                mtime = entry.attrs.mtime
                if mtime is None or mtime > cutoff or await is_live(UUID(match["attempt"])):
                    found["kept"].append(filename)
                    continue
                try:
                    await sftp.remove(posixpath.join(dest.temp_dir, filename))
                    found["removed"].append(filename)
                except (asyncssh.Error, OSError) as exc:
                    found["failed"].append(f"{filename}: {describe(exc)}")
    return found
