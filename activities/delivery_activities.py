"""The delivery side of an attempt, on the worker that built its file: cutoff 2 (`authorize_delivery`) and the
upload past it (`deliver`), which runs to its end and waits out a database outage for its evidence and terminal
write."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, cast
from uuid import UUID

from temporalio import activity

from activities import checkpoints, partner_delivery
from activities.builder import remove_local_file
from activities.contracts import AuthorizeInput, AuthorizeOutput, DeliverInput, DeliverOutput
from activities.delivery_connections import DeliveryConnections
from activities.destination import DestinationConfig, Replacement
from activities.evidence import EvidenceLog
from activities.export_base import ExportActivitiesBase, attempt_step
from activities.lease import LeaseKeeper, beats
from activities.outcomes import DeliveryResult
from activities.patience import retry_patiently, run_to_end
from activities.process import metrics
from store import errors
from store.jobs import PartnerSession
from store.models import AuthorizationResult, BuiltFile, FailureCode, JobRow, Status

log = logging.getLogger(__name__)


def hands_back(result: DeliveryResult, job: JobRow, holder: str | None, max_hand_backs: int) -> str | None:
    """The holder under which a delivery that ended without its rename hands its attempt back rather than end the
    export for a person, or None when it does not. Only an attempt that holds its row hands back; a replacement's
    too, since its next attempt looks at its final name again before sending anything. Two such ends:
    - it cannot tell how the final name looks (no fresh listing) or why (a file there that is not its own): handed
      back always, else OutcomeUnknown; the hand-back cap ends a partner that keeps doing it AttemptsExhausted;
    - it proved nothing delivered, but its tries met a fault that may pass (a cut, a timeout: `retry_safe`): handed
      back while the export has a hand-back left after this one, for its next attempt (a recovery interval later)
      to deliver, else NotDelivered, as the evidence says; that a partner that is never back ends so.
    A NotDelivered the partner's own refusal proves stands."""
    if not result.before_rename:
        return None
    if result.outcome == "OutcomeUnknown":
        return holder
    if result.retry_safe and job.handed_back_count + 1 < max_hand_backs:
        return holder
    return None


# How often an attempt asks again for a session at a partner whose sessions are all held.
_SESSION_RETRY_SECONDS = 1.0


class DeliveryActivities(ExportActivitiesBase):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Connections one delivery hands on to the next at the same partner (activities/delivery_connections.py).
        self.delivery_connections = DeliveryConnections()

    async def close(self) -> None:
        await super().close()
        await self.delivery_connections.close()

    @activity.defn
    @attempt_step
    async def authorize_delivery(self, request: AuthorizeInput) -> AuthorizeOutput:
        """Cutoff 2, and what its refusal means. The file is removed unless delivery was authorized; the lease is
        handed on to the delivery only then. It heartbeats, so that a worker that dies here is noticed within a
        lease (its heartbeat timeout), not after the step's whole timeout."""
        details: dict[str, Any] = {}
        async with self._heartbeating(lambda: dict(details) or None):
            return await self._authorize_delivery(request, details)

    async def _authorize_delivery(self, request: AuthorizeInput, details: dict[str, Any]) -> AuthorizeOutput:
        job, attempt_id, file = request.job, request.attempt_id, request.file
        gone = asyncio.Event()
        lease = self._keeper(job.id, attempt_id, file.holder, gone.set, on_lapsing=gone.set)
        result = AuthorizationResult.UNKNOWN
        try:
            # Cutoff 2 only with an upload slot here (LD2) and a session at the partner (LD3) held: an authorized
            # attempt's upload can always start. The slot first: a session counts across every worker, and one held
            # while its attempt waited for this worker's slot (behind uploads to a slow partner) kept that partner's
            # exports waiting on every worker. A slot held while waiting for a session costs only this worker, and
            # at most its destination's share of its slots (LD4; by default one less than them all).
            stopped_waiting = await self._unless_interrupted(
                self._slot(self.capacity.uploads, job, attempt_id, details), gone)
            if stopped_waiting is None:
                stopped_waiting = await self._unless_interrupted(self._partner_session(job, attempt_id, details), gone)
            if stopped_waiting is not None:
                result = await self._stopped_waiting(job.id, attempt_id, file, stopped_waiting, lease)
                remove_local_file(file.path)
                return AuthorizeOutput(result=result)
            await self.checkpoints.reached(checkpoints.BEFORE_CUTOFF_2, job.id)
            heard = beats()
            not_after = heard.bound() if heard is not None else None
            try:
                if _past(not_after):
                    result = AuthorizationResult.LEASE_LAPSED  # not even asked: see below
                else:
                    result = await self.store.authorize_delivery(job, attempt_id, file, not_after=not_after)
                if result is AuthorizationResult.UNKNOWN:
                    # The write's answer and its re-read were both lost (a failover, say): the row alone says which
                    # side of cutoff 2 the attempt is on, so it is asked again, patiently, for as long as the keeper
                    # holds the lease (until it is lost or lapsing), rather than leaving an attempt that may be
                    # authorized for recovery to take back. Half a lease was too short for a failover that the
                    # lease outlives (LV4).
                    result = await retry_patiently(
                        lambda: self.store.authorization_on_record(job.id, attempt_id, file.holder),
                        retryable=errors.is_transient, patience=self.settings.lease_seconds, first_delay=0.5,
                        max_delay=2.0, what=f"cutoff 2 of {job.id} attempt {attempt_id}, its answer lost",
                        give_up=gone)
                if result is AuthorizationResult.LEASE_LAPSED and not _past(not_after) and await lease.renew_now():
                    # Still the owner, only late: the renewal succeeds only if no takeover committed. Retry once.
                    result = await self.store.authorize_delivery(job, attempt_id, file, not_after=not_after)
            except Exception:
                # Whatever the row now says, this attempt will not deliver this file: recovery reads the row.
                remove_local_file(file.path)
                raise
            late = _past(not_after)  # read once: the branch and the metric's reason must agree
            if result is not AuthorizationResult.AUTHORIZED and (late or result is AuthorizationResult.NOT_OWNER):
                # The step reached the database after its bound (its worker was paused with the task in hand), or
                # after its run said it gave the step up (Temporal's timeout; the heartbeats it sent on time reached
                # no server): the run has moved on, so it authorized nothing, and it hands the attempt back at once
                # (the lease ends now) for recovery to requeue, rather than letting it lapse a lease later. An
                # attempt truly another's matches nothing in release_lease.sql.
                metrics.CUTOFF_2_REFUSED.labels(reason="late" if late else "not_owner").inc()
                log.warning("cutoff 2 of export %s attempt %s %s: authorized nothing; the attempt is handed back",
                            job.id, attempt_id,
                            f"came past its bound ({not_after})" if late
                            else "was no longer this step's (its run gave the step up, or it was taken back)")
                if file.holder is not None:
                    await self.store.release_lease(job.id, attempt_id, file.holder)
            elif result is AuthorizationResult.STOP_RECORDED:
                async with lease.terminal_write():
                    await self.store.finish_stopped(job.id, attempt_id, "BeforeDelivery", holder=file.holder)
            elif result is AuthorizationResult.ORIGINAL_COMPLETED:
                async with lease.terminal_write():
                    await self.store.finish_failed(job.id, attempt_id, FailureCode.ORIGINAL_DELIVERED,
                                                   holder=file.holder)
            # LeaseLapsed again, NotOwner or Unknown: write nothing to the row; recovery takes it from there.
            if result is AuthorizationResult.AUTHORIZED:
                await self.checkpoints.reached(checkpoints.AFTER_CUTOFF_2, job.id)
                self._hand_over(lease)
            else:
                remove_local_file(file.path)
            return AuthorizeOutput(result=result)
        finally:
            # Cutoff 2 is decided: the attempt builds no more here (an authorized one holds its upload slot now).
            self.capacity.builds.release((job.id, attempt_id))
            if result is not AuthorizationResult.AUTHORIZED:
                await lease.finish()

    async def _unless_interrupted(self, waiting: Awaitable[None], gone: asyncio.Event) -> str | None:
        """None once `waiting` is done; else why it stopped first: the worker shuts down ("shutdown"), or the
        attempt's lease was lost or is lapsing ("lease")."""
        waited = asyncio.ensure_future(waiting)
        # A step called directly (outside an activity) has no worker to shut down.
        shutdown = asyncio.create_task(activity.wait_for_worker_shutdown() if activity.in_activity()
                                       else asyncio.Event().wait())
        lost = asyncio.create_task(gone.wait())
        try:
            await asyncio.wait({waited, shutdown, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            shutdown.cancel()
            lost.cancel()
            if not waited.done():
                waited.cancel()
            await asyncio.gather(waited, shutdown, lost, return_exceptions=True)
        if waited.done() and not waited.cancelled() and waited.exception() is None:
            return None
        if waited.done() and not waited.cancelled() and waited.exception() is not None:
            raise cast(BaseException, waited.exception())
        return "shutdown" if shutdown.done() and not shutdown.cancelled() else "lease"

    async def _partner_session(self, job: JobRow, attempt_id: UUID, details: dict[str, Any]) -> None:
        """A session at the destination's partner, where its contract limits them (LD3), the limit read first."""
        destination = await retry_patiently(
            lambda: self.store.read_destination(job.tenant_id, job.destination_id), retryable=errors.is_transient,
            patience=self.settings.lease_seconds, first_delay=0.5, max_delay=_SESSION_RETRY_SECONDS,
            what=f"cutoff 2 of {job.id} reads its destination")
        await self._session_under(None if destination is None else destination.get("max_sessions"), job, attempt_id,
                                  details)

    async def _session_under(self, limit: int | None, job: JobRow, attempt_id: UUID, details: dict[str, Any]) -> None:
        """A session at the partner under the contract's `limit` (None: none): taken with one statement, asked
        again every second while all are held (the lease kept, the wait in the heartbeat details), and through an
        outage of the database as long as the lease outlives it (the wait ends once the lease is lost or lapsing):
        giving up sooner lost an attempt its keeper still held (a failover). Each answer says the limit as it is
        then, so a limit cleared or raised meanwhile ends the wait."""
        if limit is None:
            return
        await self._session_released((job.id, attempt_id))
        waited = False
        try:
            while True:
                try:
                    answer = await self.store.take_partner_session(job.destination_id, job.id, attempt_id)
                except Exception as exc:
                    if not errors.is_transient(exc):
                        raise
                    answer = PartnerSession(limit=limit, slot=None)
                if answer.slot is not None:
                    self.partner_sessions.add((job.id, attempt_id))
                if answer.slot is not None or answer.limit is None:
                    return
                if not waited:
                    waited = True
                    log.info("export %s attempt %s waits for a session at its partner (%d at once)", job.id,
                             attempt_id, answer.limit)
                    metrics.slot_wait("partner_session")
                details["waiting"] = f"for a session at the partner ({answer.limit} at once)"
                await asyncio.sleep(_SESSION_RETRY_SECONDS)
        finally:
            details.pop("waiting", None)

    async def _upload_capacity(self, limit: int | None, job: JobRow, attempt_id: UUID,
                               details: dict[str, Any]) -> None:
        """What an upload needs before it connects, when this step came after its lease keeper had given up
        waiting for it and given back what cutoff 2 took: an upload slot here, then a session at its partner under
        the contract's limit, waited for as cutoff 2 waits (and in its order). A session row the keeper failed to give
        back is given back first: still live (the row names the attempt), it would be held while this waits for a
        slot, and an attempt holding that slot here could be waiting for it."""
        if limit is not None:  # the keeper's own release, if still under way, is waited for by the take below
            await retry_patiently(lambda: self.store.release_partner_session(job.id, attempt_id),
                                  retryable=errors.is_transient, patience=self.settings.lease_seconds, first_delay=0.5,
                                  max_delay=_SESSION_RETRY_SECONDS,
                                  what=f"the late upload of {job.id} gives back its earlier session")
        await self._slot(self.capacity.uploads, job, attempt_id, details)
        await self._session_under(limit, job, attempt_id, details)

    async def _keep_partner_session(self, key: tuple[UUID, UUID]) -> None:
        """While the upload runs, its partner session stays its own whatever its row says (recovery may take the
        attempt back meanwhile: the upload goes on): renewed a lease ahead at each renewal interval. A renewal lost
        to an outage is tried at the next; the hold lapses a lease after the last that took."""
        while True:
            try:
                await self.store.keep_partner_session(*key)
            except Exception as exc:  # noqa: BLE001 - the next renewal tries again
                log.info("export %s attempt %s: its partner session not renewed this time: %s", *key,
                         errors.describe(exc))
            await asyncio.sleep(self.settings.renew_every_seconds)

    async def _stopped_waiting(self, job_id: UUID, attempt_id: UUID, file: BuiltFile, why: str,
                               lease: LeaseKeeper) -> AuthorizationResult:
        """An attempt that stopped waiting for a partner session or an upload slot authorizes nothing. A worker
        shutting down hands it back at once (its lease ends, recovery requeues it), as it does a build (LV6); a
        lease lost or lapsing is left to recovery."""
        if why != "shutdown":
            log.warning("export %s attempt %s: its lease was lost or lapsed while it waited for a partner session "
                        "or an upload slot; authorized nothing", job_id, attempt_id)
            return AuthorizationResult.LEASE_LAPSED
        await lease.finish()
        if file.holder is not None:
            try:
                await self.store.release_lease(job_id, attempt_id, file.holder)
            except Exception as exc:  # noqa: BLE001 - the lease lapses by itself: recovery requeues the attempt then
                log.warning("export %s attempt %s: handing back left to the lease's lapse: %s", job_id, attempt_id,
                            errors.describe(exc))
        log.info("worker shutting down: export %s attempt %s handed back while it waited for a partner session "
                 "or an upload slot", job_id, attempt_id)
        return AuthorizationResult.UNKNOWN

    async def _replacement(self, job: JobRow) -> Replacement | None:
        """For a replacement, what identifies its original's file, and whether an overwrite was agreed."""
        if job.replaces_job_id is None:
            return None
        original = await self.store.read_job(job.replaces_job_id, tenant_id=job.tenant_id)
        return Replacement(
            original_bytes=original.expected_file_bytes if original else None,
            original_sha256=original.expected_file_sha256.hex() if original and original.expected_file_sha256
            else None,
            overwrite_agreed=job.overwrite_agreement_ref is not None,
        )

    @activity.defn
    @attempt_step
    async def deliver(self, request: DeliverInput) -> DeliverOutput:
        """Past the point of no return: stop requests are recorded, not obeyed, a lost lease does not stop the
        upload, and neither does the activity's cancellation (a terminated workflow, a shutdown): the upload
        runs shielded to its end, so that its evidence and terminal write are made."""
        cancelled = asyncio.Event()

        def on_cancel() -> None:
            cancelled.set()
            log.warning("export %s: cancellation during delivery is ignored; the upload finishes", request.job.id)

        return await run_to_end(self._deliver(request, cancelled), on_cancel=on_cancel)

    async def _deliver(self, request: DeliverInput, cancelled: asyncio.Event) -> DeliverOutput:
        job, attempt_id, file = request.job, request.attempt_id, request.file
        progress = {"sent": 0, "total": file.size}
        observed_by = f"{self.worker_id}/{attempt_id}"

        evidence = EvidenceLog(lambda detail: self.store.append_evidence(job.id, attempt_id, observed_by, detail,
                                                                         holder=file.holder),
                               attempt=attempt_id)
        record_evidence = evidence.record

        async def pass_rename_fence(before_rename: dict[str, Any]) -> None:
            await self.checkpoints.reached(checkpoints.BEFORE_RENAME_FENCE, job.id)
            async def evidence_then_fence() -> bool:
                await evidence.flush()  # the records kept through a blip come first, in order
                if file.holder is None:
                    return False  # a file that names no build (before 0.2.0) cannot prove it holds the row
                return await self.store.pass_rename_fence(job.id, attempt_id, file.holder, observed_by,
                                                          before_rename)

            # An outage is waited out as the terminal write waits one out: the row, not the clock, orders the fence
            # against recovery's take-back, so however late the fence comes it is safe, and a finished upload is
            # not given up for a blip (the keeper renews meanwhile).
            passed = await retry_patiently(
                evidence_then_fence, retryable=errors.is_transient,
                patience=self.settings.store_outage_patience_seconds,
                first_delay=0.5, max_delay=2.0, what=f"the rename fence of {job.id} attempt {attempt_id}")
            if not passed:
                raise partner_delivery.RenameFenceRefused(
                    f"the rename fence refused attempt {attempt_id}: recovery took it back")

        key = (job.id, attempt_id)
        self.uploading.add(key)
        gone = asyncio.Event()
        lease = self._keeper(job.id, attempt_id, file.holder, gone.set, on_lapsing=gone.set)
        keeping: asyncio.Task[None] | None = None
        try:
            async with self._heartbeating(lambda: dict(progress)):
                await self.checkpoints.reached(checkpoints.BEFORE_UPLOAD, job.id)
                # Nothing irreversible without a lease confirmed now: a renewal that matches exactly one row.
                if not await lease.confirm(within=self.settings.lease_seconds):
                    summary = "not uploaded: the attempt could not confirm its lease before connecting"
                    log.warning("export %s attempt %s: %s", job.id, attempt_id, summary)
                    await record_evidence({"step": "not_uploaded", "why": summary})
                    return DeliverOutput(summary=summary, written=False)
                async def read_for_upload() -> tuple[dict[str, Any] | None, Replacement | None]:
                    destination = await self.store.read_destination(job.tenant_id, job.destination_id)
                    return destination, (await self._replacement(job) if destination is not None else None)

                # Nothing is sent yet: a read lost to an outage is read again for as long as a lease (the keeper
                # renews meanwhile), rather than leave an authorized attempt that never uploaded for recovery to
                # call OutcomeUnknown.
                destination, replacement = await retry_patiently(
                    read_for_upload, retryable=errors.is_transient, patience=self.settings.lease_seconds,
                    first_delay=0.5, max_delay=1.0, what=f"the upload of {job.id} attempt {attempt_id} reads")
                if destination is None:
                    result = DeliveryResult(
                        outcome="Failed", failure_reason="NotDelivered", summary="destination vanished before upload"
                    )
                else:
                    if not self.capacity.uploads.holds(key):
                        # The keeper gave up waiting for this step, and gave back what cutoff 2 took: taken again,
                        # in cutoff 2's order (never a partner session held while waiting for an upload slot).
                        stopped = await self._unless_interrupted(
                            self._upload_capacity(destination.get("max_sessions"), job, attempt_id, progress), gone)
                        if stopped is None and not await lease.confirm(within=self.settings.lease_seconds):
                            stopped = "lease"
                        if stopped is not None:
                            summary = ("not uploaded: the worker shut down or the attempt's lease was lost while it "
                                       "waited for a partner session or an upload slot")
                            log.warning("export %s attempt %s: %s", job.id, attempt_id, summary)
                            await record_evidence({"step": "not_uploaded", "why": summary})
                            return DeliverOutput(summary=summary, written=False)
                    if key in self.partner_sessions:
                        keeping = asyncio.create_task(self._keep_partner_session(key))
                    config = DestinationConfig.from_row(destination)
                    for number in range(1, self.settings.delivery_tries + 1):
                        result = await metrics.timed_delivery(job.destination_id, file.size, partner_delivery.deliver(
                            config,
                            file.path,
                            file.final_name,
                            partner_delivery.temp_file_name(file.final_name, attempt_id),
                            record_evidence=record_evidence,
                            on_progress=lambda sent, total: progress.update(sent=sent),
                            throttle_bytes_per_second=self.settings.upload_throttle_bytes_per_second,
                            expected_sha256=file.sha256_hex,
                            replacement=replacement,
                            pass_rename_fence=pass_rename_fence,
                            connections=self.delivery_connections,
                        ))
                        if not await self._try_again(result, number, lease, record_evidence, job.id, attempt_id):
                            break
                if (holder := hands_back(result, job, file.holder, self.settings.max_hand_backs)) is not None:
                    return await self._hand_back(job.id, attempt_id, holder, result, lease, evidence)
                await self.checkpoints.reached(checkpoints.AFTER_RECEIPT, job.id)
                outcome = Status(result.outcome)
                failure = FailureCode(result.failure_reason) if result.failure_reason else None
                async def evidence_then_outcome() -> bool:
                    await evidence.flush()
                    # Wake the export where its run may never read this write: cancelled (the run may be gone,
                    # terminated), or past the step's bound (a paused worker: Temporal gave the step up, and the run
                    # read the row still Delivering and waits for a wake-up).
                    heard = beats()
                    given_up = heard is not None and _past(heard.bound())
                    return await self.store.finish_delivery(job.id, attempt_id, outcome, failure, result.summary,
                                                            holder=file.holder, confirmed_by=result.confirmed_by,
                                                            wake=cancelled.is_set() or given_up)

                # Only this attempt knows what happened at the partner: wait out an outage rather than leave
                # recovery to judge without the receipt. The keeper keeps renewing meanwhile.
                async with lease.terminal_write():
                    written = await retry_patiently(
                        evidence_then_outcome, retryable=errors.is_transient,
                        patience=self.settings.store_outage_patience_seconds, first_delay=0.5, max_delay=5.0,
                        what=f"the outcome of {job.id} attempt {attempt_id} waits for the database")
        finally:
            if keeping is not None:
                keeping.cancel()
                await asyncio.gather(keeping, return_exceptions=True)
            remove_local_file(file.path)
            await lease.finish()
            self.uploading.discard(key)
            if key not in self.keepers:  # its keeper ended during the upload (a lost lease) and left both to it
                self._free(key)
        if not written:
            log.warning("terminal write of %s attempt %s matched nothing; recovery reconciles from evidence",
                        job.id, attempt_id)
        return DeliverOutput(outcome=outcome, failure_reason=failure, summary=result.summary, written=written,
                             row=await self._row_after(job.id) if written else None)

    async def _hand_back(self, job_id: UUID, attempt_id: UUID, holder: str, result: DeliveryResult,
                         lease: LeaseKeeper, evidence: EvidenceLog) -> DeliverOutput:
        """No terminal write: the lease ends now, with the rename fence still open, so recovery's next run takes the
        attempt back and the export goes round again (up to its attempt cap), as after a lost worker. Best effort:
        if the database does not take it, the lease lapses on its own, the keeper being stopped."""
        summary = f"handed back, the rename never sent: {result.summary}"
        log.warning("export %s attempt %s: %s", job_id, attempt_id, summary)
        await lease.finish()
        try:
            await evidence.record({"step": "handed_back", "why": result.summary})
            await evidence.flush()
            await self.store.release_lease(job_id, attempt_id, holder)
        except Exception as exc:  # noqa: BLE001 - the lease lapses by itself: recovery takes the attempt back then
            log.warning("export %s attempt %s: handing back left to the lease's lapse: %s", job_id, attempt_id,
                        errors.describe(exc))
        return DeliverOutput(summary=summary, written=False)

    async def _try_again(self, result: DeliveryResult, number: int, lease: LeaseKeeper,
                         record_evidence: Callable[[dict[str, Any]], Awaitable[None]], job_id: UUID,
                         attempt_id: UUID) -> bool:
        """Whether the attempt tries its delivery again: only a try proven not delivered (nothing at the final name
        from it) by a fault that may pass, within the configured tries, and only with a lease confirmed now, as
        before the first. The pause before it doubles from `delivery_retry_delay_seconds`."""
        if not result.retry_safe or number >= self.settings.delivery_tries:
            return False
        pause = self.settings.delivery_retry_delay_seconds * 2 ** (number - 1)
        log.warning("export %s attempt %s: try %d of %d not delivered (%s); trying again in %g s", job_id,
                    attempt_id, number, self.settings.delivery_tries, result.summary, pause)
        await asyncio.sleep(pause)
        # Confirmed after the pause, right before the try: a worker paused meanwhile must not upload for an
        # attempt recovery has taken over.
        if not await lease.confirm(within=self.settings.lease_seconds):
            log.warning("export %s attempt %s: not tried again, its lease could not be confirmed", job_id, attempt_id)
            return False
        await record_evidence({"step": "retry", "try": number + 1, "after": result.summary, "pause": pause})
        return True

    async def _row_after(self, job_id: UUID) -> JobRow | None:
        """The row as the terminal write left it; None if it cannot be read now (the workflow reads it then)."""
        try:
            async with asyncio.timeout(self.settings.reread_timeout_seconds):
                return await self.store.read_job(job_id)
        except Exception as exc:  # noqa: BLE001 - only a shortcut is lost: the workflow re-reads the row itself
            log.info("could not read %s back after its terminal write: %s", job_id, exc)
            return None


def _past(bound: datetime | None) -> bool:
    return bound is not None and datetime.now(UTC) >= bound
