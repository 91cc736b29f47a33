"""The export's activities. Built once per worker with its dependencies; each changes a job only through store/."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Coroutine
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar
from uuid import UUID

import asyncssh
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities import checkpoints, metrics, partner
from activities.builder import BuildError, build_contacts_csv, remove_local_file, size_and_sha256
from activities.contracts import (
    MAX_NAME,
    MAX_REASON,
    TEMPORAL_CANCEL_OPERATOR,
    Admission,
    AdmitInput,
    AttemptInput,
    AuthorizeInput,
    AuthorizeOutput,
    BuildOutput,
    CancelOutput,
    CancelRequest,
    ClaimInput,
    ClaimOutput,
    CreateExport,
    DeliverInput,
    DeliverOutput,
    Evaluation,
)
from activities.evidence import EvidenceLog
from activities.lease import LeaseKeeper, heartbeating
from activities.stop_watch import StopWatch
from store import errors
from store.db import asyncpg_dsn
from store.jobs import JobStore
from store.models import AuthorizationResult, BuiltFile, ClaimResult, FailureCode, JobRow, Status
from store.settings import Settings

log = logging.getLogger(__name__)

T = TypeVar("T")
# Allowance for the worker's clock against the Temporal server's (NTP keeps them within milliseconds), in the
# schedule-to-start check of a build: small, since a paused worker's task may reach it just after the bound.
_CLOCK_MARGIN_SECONDS = 0.1


async def run_to_end(work: Coroutine[Any, Any, T], on_cancel: Callable[[], None] = lambda: None) -> T:
    """Await `work` to its end however often the caller is cancelled meanwhile: for steps whose effect must be
    recorded once begun (an upload and its evidence, a stop's terminal write)."""
    task = asyncio.ensure_future(work)
    while True:
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                raise
            on_cancel()


async def retry_patiently(step: Callable[[], Coroutine[Any, Any, T]], *, retryable: Callable[[Exception], bool],
                          patience: float, first_delay: float, max_delay: float, what: str) -> T:
    """`step` again while its error is `retryable`, one log line a try, backing off from `first_delay` to
    `max_delay`, for at most `patience` seconds; then its last error."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience
    delay = first_delay
    while True:
        try:
            return await step()
        except Exception as exc:
            if not retryable(exc) or loop.time() + delay > deadline:
                raise
            log.warning("%s: %s; trying again in %.1f s", what, errors.describe(exc), delay)
        await asyncio.sleep(delay)
        delay = min(delay * 2, max_delay)


class ExportActivities:
    def __init__(self, store: JobStore, settings: Settings, *, worker_id: str, worker_task_queue: str) -> None:
        self.store = store
        self.settings = settings
        self.worker_id = worker_id
        self.worker_task_queue = worker_task_queue
        self.checkpoints = checkpoints.Checkpoints()
        # Each attempt's lease keeper on this worker, from its build's start to its terminal write.
        self.keepers: dict[tuple[UUID, UUID], LeaseKeeper] = {}

    def all(self) -> list[Any]:
        return [
            self.create_export,
            self.evaluate_policy,
            self.claim,
            self.claim_if_allowed,
            self.build,
            self.stop_attempt,
            self.authorize_delivery,
            self.deliver,
            self.record_cancellation,
        ]

    # --- shared task queue ------------------------------------------------------------------------------------

    @activity.defn
    async def create_export(self, request: CreateExport) -> None:
        """The creation statement, for a platform team that starts the workflow directly. Idempotent: a retry
        that finds its own job already created succeeds."""
        try:
            await self.store.create_job(
                job_id=request.job_id,
                tenant_id=request.tenant_id,
                destination_id=request.destination_id,
                delivery_key=request.delivery_key,
                created_by=request.created_by,
            )
        except errors.JobAlreadyExists:
            existing = await self.store.read_job(request.job_id, tenant_id=request.tenant_id)
            if existing is None or existing.delivery_key != request.delivery_key:
                raise ApplicationError("an export with this ID already exists", non_retryable=True) from None
        except errors.ConstraintViolation as exc:
            raise ApplicationError(str(exc), type=type(exc).__name__, non_retryable=True) from exc

    @activity.defn
    async def evaluate_policy(self, job_id: str) -> Evaluation:
        """Runs of the workflow that began before `claim_if_allowed` existed evaluate and claim in two steps."""
        return await self._evaluate(_uuid(job_id))

    @activity.defn
    async def claim(self, request: ClaimInput) -> ClaimOutput:
        return await self._claim(request.job_id, request.checked_version, request.attempt_id)

    @activity.defn
    async def claim_if_allowed(self, request: AdmitInput) -> Admission:
        """Read the row, evaluate policy (its only write is the conditional rejection) and, if allowed, claim at the
        version read (cutoff 1): two documented statements, one step. A retry whose first try's claim committed
        finds its attempt in the row; one whose attempt ID a requeue has spent since is Lost."""
        evaluation = await self._evaluate(request.job_id)
        row = evaluation.row
        if row is not None and row.status is Status.RUNNING and row.attempt_id == request.attempt_id:
            return Admission(evaluation=evaluation, claim=self._claim_output(ClaimResult.CLAIMED),
                             attempt=row.attempt_count)
        if row is None or not evaluation.allowed:
            return Admission(evaluation=evaluation)
        claim = await self._claim(row.id, row.version, request.attempt_id)
        return Admission(evaluation=evaluation, claim=claim, attempt=row.attempt_count + 1)

    async def _evaluate(self, job_id: UUID) -> Evaluation:
        """Reads and decides; its only write is the conditional rejection, so a repeated wake-up is harmless."""
        row = await self.store.read_job(job_id)
        if row is None or row.status is not Status.QUEUED:
            return Evaluation(row=row)
        destination = await self.store.read_destination(row.tenant_id, row.destination_id)
        if destination is None:
            reason = "the destination does not exist for this tenant"
        elif not destination["enabled"]:
            reason = f"destination {destination['name']!r} is disabled"
        else:
            # A contract the delivery could not act on (a known_hosts line for a host key, say) would fail only
            # at the connect after cutoff 2: refuse it now, before anything is claimed.
            try:
                partner.validate_destination(destination)
            except partner.InvalidDestination as exc:
                reason = f"destination {destination['name']!r} is not valid: {exc}"
            else:
                return Evaluation(row=row, allowed=True)
        if await self.store.reject(row.id, row.version, reason[:MAX_REASON]):
            log.info("export %s rejected at version %s: %s", row.id, row.version, reason)
        return Evaluation(row=await self.store.read_job(row.id), reason=reason)

    async def _claim(self, job_id: UUID, checked_version: int, attempt_id: UUID) -> ClaimOutput:
        await self.checkpoints.reached(checkpoints.CLAIM, job_id)
        result = await self.store.claim(job_id, checked_version, attempt_id, self.worker_id)
        await self.checkpoints.reached(checkpoints.AFTER_CLAIM, job_id)
        return self._claim_output(result)

    def _claim_output(self, result: ClaimResult) -> ClaimOutput:
        return ClaimOutput(result=result, worker_task_queue=self.worker_task_queue,
                           lease_seconds=self.settings.lease_seconds)

    @activity.defn
    async def record_cancellation(self, request: CancelRequest) -> CancelOutput:
        job_id = _uuid(activity.info().workflow_id.removeprefix("export-"))
        requested_by = request.requested_by
        if requested_by == TEMPORAL_CANCEL_OPERATOR:
            requested_by = await self._temporal_cancel_operator()
        result = await self.store.request_cancellation(
            tenant_id=request.tenant_id,
            job_id=job_id,
            request_id=request.request_id,
            requested_by=requested_by,
            reason=request.reason,
        )
        return CancelOutput(result=result)

    async def _temporal_cancel_operator(self) -> str:
        """Who cancelled the workflow, as Temporal recorded it in the cancel request's history event."""
        info = activity.info()
        identity = ""
        handle = activity.client().get_workflow_handle(info.workflow_id, run_id=info.workflow_run_id)
        async for event in handle.fetch_history_events():
            if event.HasField("workflow_execution_cancel_requested_event_attributes"):
                identity = event.workflow_execution_cancel_requested_event_attributes.identity
                break
        return f"{TEMPORAL_CANCEL_OPERATOR}: {identity}"[:MAX_NAME] if identity else TEMPORAL_CANCEL_OPERATOR

    # --- the claiming worker's own task queue -----------------------------------------------------------------

    def _keeper(self, job_id: UUID, attempt_id: UUID, holder: str | None,
                on_lost: Callable[[], None] = lambda: None) -> LeaseKeeper:
        """The attempt's lease keeper on this worker, adopted by the current step: the one the previous step handed
        over, or a new one (the first step, or one whose keeper gave up waiting)."""
        key = (job_id, attempt_id)
        keeper = self.keepers.get(key)
        if keeper is None or keeper.done or keeper.holder != holder:
            keeper = LeaseKeeper(self.store, job_id, attempt_id, holder, renew_every=self.settings.renew_every_seconds,
                                 on_done=lambda done: self._forget(key, done)).start()
            self.keepers[key] = keeper
        keeper.adopt(on_lost)
        return keeper

    async def close(self) -> None:
        """The worker shuts down: stop every lease keeper still renewing here."""
        for keeper in list(self.keepers.values()):
            await keeper.finish()

    def _forget(self, key: tuple[UUID, UUID], keeper: LeaseKeeper) -> None:
        if self.keepers.get(key) is keeper:
            del self.keepers[key]

    def _hand_over(self, keeper: LeaseKeeper) -> None:
        # The next step of the attempt is scheduled on this worker with a schedule-to-start timeout of one lease.
        keeper.hand_over(within=self.settings.lease_seconds + self.settings.renew_every_seconds)

    def _heartbeating(self, details: Callable[[], Any]) -> Any:
        return heartbeating(self.settings.heartbeat_throttle_seconds, details)

    @activity.defn
    async def build(self, request: AttemptInput) -> BuildOutput:
        """Build the file, with the lease kept and stop requests heard. Also how a build resumes elsewhere (or
        again here) after its worker went quiet: it first takes the attempt's build slot, which fences any earlier
        build of the attempt and fails once a takeover has committed."""
        job, attempt_id = request.job, request.attempt_id
        if activity.is_worker_shutdown():
            return BuildOutput(ended="HandedBack")  # taken as this worker began to shut down: touch nothing
        late = self._started_late()
        if late is not None:
            # A task handed to this worker while it was paused (a poll it had open): Temporal already timed it out
            # and the workflow moved on, so taking the build slot now would only fence the build that replaced it.
            log.warning("build of %s attempt %s reached this worker %.1f s after it was scheduled, past its "
                        "schedule-to-start bound; it does nothing", job.id, attempt_id, late)
            return BuildOutput(ended="StartedLate")
        token = uuid.uuid4().hex[:12]
        holder = f"{self.worker_id}/{token}"
        # One file per build, so a fenced build never writes the file a later one built.
        path = Path(self.settings.work_dir) / f"{job.id}-{attempt_id}-{token}.csv"
        progress = {"bytes": 0}
        build_task = asyncio.current_task()
        lost = asyncio.Event()

        def on_lost() -> None:
            lost.set()
            if build_task is not None:
                build_task.cancel()

        def on_stop() -> None:
            if build_task is not None:
                build_task.cancel()

        shutting_down = asyncio.Event()

        async def hand_back_on_shutdown() -> None:
            await activity.wait_for_worker_shutdown()
            shutting_down.set()
            on_stop()

        detail = ("first build" if request.resumption == 0
                  else f"resumed ({request.resumption}) after its build went quiet")
        # A build of this attempt that finished here but whose completion Temporal never heard of (it was away):
        # the resumption delivers that file instead of reading the contacts again. Renamed to this build's name
        # first, so that from this build's start it is this build's file.
        reused = self._take_finished_build(job.id, attempt_id, path) if request.resumption else False
        if reused:
            detail += ", with the file an earlier build of it finished on this worker"
        if not await self.store.start_build(job.id, attempt_id, holder, detail):
            return BuildOutput(ended="LostOwnership")  # write nothing: another attempt owns the row now
        lease = self._keeper(job.id, attempt_id, holder, on_lost)
        handed_over = False
        shutdown_watch = asyncio.create_task(hand_back_on_shutdown())
        try:
            async with self._heartbeating(lambda: dict(progress)):
                refusal = await self._preflight(job)
                if refusal is not None:
                    code, why = refusal
                    async with lease.terminal_write():
                        await self.store.finish_failed(job.id, attempt_id, code, why, holder=holder)
                    return BuildOutput(ended=code.value)
                try:
                    async with StopWatch(self.store, asyncpg_dsn(self.settings.database_url), job.id, attempt_id,
                                         metrics.timed_stop(job.id, attempt_id, on_stop)):
                        if reused and path.exists():
                            size, sha256_hex = await asyncio.to_thread(size_and_sha256, path)
                            log.info("export %s attempt %s: delivering the file an earlier build finished (%d "
                                     "bytes)", job.id, attempt_id, size)
                        else:
                            await self.checkpoints.reached(checkpoints.BUILD_STARTED, job.id)
                            size, sha256_hex = await metrics.timed_build(
                                self._build_with_room(job, attempt_id, path, progress))
                except asyncio.CancelledError:
                    # The stop watcher and the workflow's cancel of this activity may both fire: the second cancel
                    # must not cut off the stop's write halfway, so the write runs to its end.
                    ended = await run_to_end(self._after_build_cancelled(lease, lost, job.id, attempt_id, holder,
                                                                         shutting_down.is_set()))
                    if ended is None:
                        raise
                    return ended
                except BuildError as exc:
                    log.error("build of %s attempt %s failed: %s", job.id, attempt_id, exc)
                    async with lease.terminal_write():
                        await self.store.finish_failed(job.id, attempt_id, FailureCode.BUILD_FAILED, str(exc),
                                                       holder=holder)
                    return BuildOutput(ended="BuildFailed")
            self._hand_over(lease)
            handed_over = True
            return BuildOutput(
                file=BuiltFile(path=str(path), final_name=job.final_name, size=size, sha256_hex=sha256_hex,
                               holder=holder),
                worker_task_queue=self.worker_task_queue,
            )
        except asyncio.CancelledError:
            if not shutting_down.is_set():
                raise
            # The shutdown came before the build itself began (in the preparation): hand the attempt back too.
            return await run_to_end(self._after_build_cancelled(lease, lost, job.id, attempt_id, holder, True))
        finally:
            shutdown_watch.cancel()
            if not handed_over:
                await lease.finish()

    async def _build_with_room(self, job: JobRow, attempt_id: UUID, path: Path,
                               progress: dict[str, int]) -> tuple[int, str]:
        """The build, tried again while the disk is full (backing off to 30 s) for at most
        `disk_full_patience_seconds`; any other failure at once."""

        async def build() -> tuple[int, str]:
            progress.update(bytes=0)
            return await build_contacts_csv(
                asyncpg_dsn(self.settings.database_url), job.tenant_id, path,
                on_progress=lambda size: progress.update(bytes=size),
                throttle_bytes_per_second=self.settings.build_throttle_bytes_per_second,
            )

        return await retry_patiently(
            build, retryable=lambda exc: isinstance(exc, BuildError) and exc.disk_full,
            patience=self.settings.disk_full_patience_seconds, first_delay=1.0, max_delay=30.0,
            what=f"build of {job.id} attempt {attempt_id} in {path.parent}")

    def _started_late(self) -> float | None:
        """Seconds since the task was scheduled, if past its schedule-to-start bound (one lease) and a margin."""
        elapsed = (datetime.now(timezone.utc) - activity.info().current_attempt_scheduled_time).total_seconds()
        return elapsed if elapsed > self.settings.lease_seconds + _CLOCK_MARGIN_SECONDS else None

    def _take_finished_build(self, job_id: UUID, attempt_id: UUID, path: Path) -> bool:
        """Rename a finished build file of this attempt on this worker (the newest, if several) to `path`."""
        found = sorted(Path(self.settings.work_dir).glob(f"{job_id}-{attempt_id}-*.csv"),
                       key=lambda p: p.stat().st_mtime if p.exists() else 0)
        for candidate in reversed(found):
            try:
                candidate.rename(path)
                return True
            except OSError:  # removed meanwhile (the scavenger): try the next, or build
                continue
        return False

    async def _after_build_cancelled(
        self, lease: LeaseKeeper, lost: asyncio.Event, job_id: UUID, attempt_id: UUID, holder: str,
        shutting_down: bool,
    ) -> BuildOutput | None:
        await self.checkpoints.reached(checkpoints.BUILD_CANCELLED, job_id)
        await lease.finish()
        if lost.is_set():
            return BuildOutput(ended="LostOwnership")
        # A stop request, a terminated workflow or a shutdown: only a recorded stop request is a Stop, and only
        # this attempt's; anything else leaves the row for recovery, or, for a shutdown, for the workflow to
        # resume the build elsewhere at once (HandedBack), its lease ended so that nothing waits it out.
        if await self.store.finish_stopped(job_id, attempt_id, "WhileBuilding", holder=holder):
            metrics.stop_written(job_id, attempt_id)
            return BuildOutput(ended="Stopped")
        if shutting_down:
            try:
                released = await self.store.release_lease(job_id, attempt_id, holder)
            except Exception as exc:
                released = False
                log.warning("could not end the lease of %s attempt %s: %s", job_id, attempt_id,
                            errors.describe(exc))
            log.info("worker shutting down: build of %s attempt %s handed back%s", job_id, attempt_id,
                     "" if released else " (its lease lapses by itself)")
            return BuildOutput(ended="HandedBack")
        return None

    async def _preflight(self, job: JobRow) -> tuple[FailureCode, str] | None:
        """The preparation's look at the partner, before the build: what ends the attempt now, from Running (where a
        stop request can still win) and before cutoff 2 spends anything. An unreachable partner is not a reason:
        the delivery looks again and records the baseline that counts."""
        destination = await self.store.read_destination(job.tenant_id, job.destination_id)
        if destination is None:
            return None
        config = partner.DestinationConfig.from_row(destination)
        try:
            final = await partner.preflight(config, job.final_name)
        except (partner.HostKeyMismatch, partner.FinalDirMissing, asyncssh.PermissionDenied, ValueError) as exc:
            return FailureCode.NOT_DELIVERED, f"preparation: {type(exc).__name__}: {exc}"
        except Exception as exc:
            log.warning("preparation could not look at %s for %s: %s", job.final_name, job.id, exc)
            return None
        if final.exists and job.replaces_job_id is None:
            # An original's name is unique to its key, so a file there is a conflict: nothing is uploaded.
            return FailureCode.FINAL_NAME_OCCUPIED, f"{job.final_name} exists at the partner before delivery"
        return None

    @activity.defn
    async def stop_attempt(self, request: AttemptInput) -> bool:
        """A stop recorded while no build runs for the attempt: the conditional Running -> Stopped."""
        return await self.store.finish_stopped(request.job.id, request.attempt_id, "BeforeBuild")

    @activity.defn
    async def authorize_delivery(self, request: AuthorizeInput) -> AuthorizeOutput:
        """Cutoff 2, and what its refusal means. The file is removed unless delivery was authorized; the lease is
        handed on to the delivery only then."""
        job, attempt_id, file = request.job, request.attempt_id, request.file
        lease = self._keeper(job.id, attempt_id, file.holder)
        result = AuthorizationResult.UNKNOWN
        try:
            await self.checkpoints.reached(checkpoints.BEFORE_CUTOFF_2, job.id)
            try:
                result = await self.store.authorize_delivery(job, attempt_id, file)
                if result is AuthorizationResult.LEASE_LAPSED and await lease.renew_now():
                    # Still the owner, only late: the renewal succeeds only if no takeover committed. Retry once.
                    result = await self.store.authorize_delivery(job, attempt_id, file)
            except Exception:
                # Whatever the row now says, this attempt will not deliver this file: recovery reads the row.
                remove_local_file(file.path)
                raise
            if result is AuthorizationResult.STOP_RECORDED:
                async with lease.terminal_write():
                    await self.store.finish_stopped(job.id, attempt_id, "BeforeDelivery", holder=file.holder)
            elif result is AuthorizationResult.ORIGINAL_COMPLETED:
                async with lease.terminal_write():
                    await self.store.finish_failed(job.id, attempt_id, FailureCode.ORIGINAL_DELIVERED,
                                                   holder=file.holder)
            # LeaseLapsed again, NotOwner or Unknown: write nothing to the row; recovery takes it from there.
            if result is AuthorizationResult.AUTHORIZED:
                self._hand_over(lease)
            else:
                remove_local_file(file.path)
            return AuthorizeOutput(result=result)
        finally:
            if result is not AuthorizationResult.AUTHORIZED:
                await lease.finish()

    async def _replacement(self, job: JobRow) -> partner.Replacement | None:
        """For a replacement, what identifies its original's file, and whether an overwrite was agreed."""
        if job.replaces_job_id is None:
            return None
        original = await self.store.read_job(job.replaces_job_id, tenant_id=job.tenant_id)
        return partner.Replacement(
            original_bytes=original.expected_file_bytes if original else None,
            original_sha256=original.expected_file_sha256.hex() if original and original.expected_file_sha256
            else None,
            overwrite_agreed=job.overwrite_agreement_ref is not None,
        )

    @activity.defn
    async def deliver(self, request: DeliverInput) -> DeliverOutput:
        """Past the point of no return: stop requests are recorded, not obeyed, a lost lease does not stop the
        upload, and neither does the activity's cancellation (a terminated workflow, a shutdown): the upload
        runs shielded to its end, so that its evidence and terminal write are made."""
        return await run_to_end(
            self._deliver(request),
            on_cancel=lambda: log.warning("export %s: cancellation during delivery is ignored; the upload finishes",
                                          request.job.id),
        )

    async def _deliver(self, request: DeliverInput) -> DeliverOutput:
        job, attempt_id, file = request.job, request.attempt_id, request.file
        progress = {"sent": 0, "total": file.size}
        observed_by = f"{self.worker_id}/{attempt_id}"

        evidence = EvidenceLog(lambda detail: self.store.append_evidence(job.id, attempt_id, observed_by, detail),
                               attempt=attempt_id)
        record_evidence = evidence.record

        lease = self._keeper(job.id, attempt_id, file.holder)
        try:
            async with self._heartbeating(lambda: dict(progress)):
                await self.checkpoints.reached(checkpoints.BEFORE_UPLOAD, job.id)
                # Nothing irreversible without a lease confirmed now: a renewal that matches exactly one row.
                if not await lease.confirm(within=self.settings.lease_seconds):
                    summary = "not uploaded: the attempt could not confirm its lease before connecting"
                    log.warning("export %s attempt %s: %s", job.id, attempt_id, summary)
                    await record_evidence({"step": "not_uploaded", "why": summary})
                    return DeliverOutput(summary=summary, written=False)
                destination = await self.store.read_destination(job.tenant_id, job.destination_id)
                if destination is None:
                    result = partner.DeliveryResult(
                        outcome="Failed", failure_reason="NotDelivered", summary="destination vanished before upload"
                    )
                else:
                    result = await metrics.timed_delivery(job.destination_id, file.size, partner.deliver(
                        partner.DestinationConfig.from_row(destination),
                        file.path,
                        file.final_name,
                        partner.temp_file_name(file.final_name, attempt_id),
                        record_evidence=record_evidence,
                        on_progress=lambda sent, total: progress.update(sent=sent),
                        throttle_bytes_per_second=self.settings.upload_throttle_bytes_per_second,
                        expected_sha256=file.sha256_hex,
                        replacement=await self._replacement(job),
                    ))
                await self.checkpoints.reached(checkpoints.AFTER_RECEIPT, job.id)
                outcome = Status(result.outcome)
                failure = FailureCode(result.failure_reason) if result.failure_reason else None
                async def evidence_then_outcome() -> bool:
                    await evidence.flush()
                    return await self.store.finish_delivery(job.id, attempt_id, outcome, failure, result.summary,
                                                            holder=file.holder, confirmed_by=result.confirmed_by)

                # Only this attempt knows what happened at the partner: wait out an outage rather than leave
                # recovery to judge without the receipt. The keeper keeps renewing meanwhile.
                async with lease.terminal_write():
                    written = await retry_patiently(
                        evidence_then_outcome, retryable=errors.is_transient,
                        patience=self.settings.store_outage_patience_seconds, first_delay=0.5, max_delay=5.0,
                        what=f"the outcome of {job.id} attempt {attempt_id} waits for the database")
        finally:
            remove_local_file(file.path)
            await lease.finish()
        if not written:
            log.warning("terminal write of %s attempt %s matched nothing; recovery reconciles from evidence",
                        job.id, attempt_id)
        return DeliverOutput(outcome=outcome, failure_reason=failure, summary=result.summary, written=written,
                             row=await self._row_after(job.id) if written else None)

    async def _row_after(self, job_id: UUID) -> JobRow | None:
        """The row as the terminal write left it; None if it cannot be read now (the workflow reads it then)."""
        try:
            async with asyncio.timeout(self.settings.reread_timeout_seconds):
                return await self.store.read_job(job_id)
        except Exception as exc:  # noqa: BLE001 - only a shortcut is lost: the workflow re-reads the row itself
            log.info("could not read %s back after its terminal write: %s", job_id, exc)
            return None


def _uuid(value: str) -> UUID:
    try:
        return UUID(str(value))
    except ValueError:
        raise ApplicationError(f"not an export ID: {value!r}", non_retryable=True) from None
