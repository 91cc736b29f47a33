"""The build side of an attempt, on the claiming worker's own task queue: the build (with its look at the partner
first, the lease kept and stop requests heard) and the stop of an attempt whose build is not running."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from uuid import UUID

import asyncssh
from temporalio import activity

from activities import checkpoints
from activities.builder import BuildError, build_contacts_csv, copy_connections, remove_local_file, size_and_sha256
from activities.contracts import AttemptInput, BuildOutput
from activities.destination import DestinationConfig
from activities.export_base import ExportActivitiesBase, attempt_step
from activities.lease import LeaseKeeper
from activities.partner_connection import HostKeyMismatch
from activities.partner_files import FinalDirMissing, preflight
from activities.partner_looks import PartnerLooks
from activities.patience import retry_patiently, run_to_end
from activities.process import metrics
from activities.stop_watch import StopListener, StopWatch
from store import errors
from store.db import Bounds, asyncpg_dsn
from store.jobs import build_holder
from store.models import BuiltFile, FailureCode, JobRow

log = logging.getLogger(__name__)

# Allowance for the worker's clock against the Temporal server's (NTP keeps them within milliseconds), in the
# schedule-to-start check of a build: small, since a paused worker's task may reach it just after the bound.
_CLOCK_MARGIN_SECONDS = 0.1


class BuildActivities(ExportActivitiesBase):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        bounds = Bounds.of(self.settings)
        # One listening connection for every build here, opened at the first (activities/stop_watch.py).
        self.stop_listener = StopListener(asyncpg_dsn(self.settings.database_url), bounds)
        # The builds' COPY connections, one per build slot, kept between builds.
        self.copy_connections = copy_connections(self.settings.database_url, bounds, most=self.settings.max_builds)
        # The preparation's looks at each partner, on a session the builds share (activities/partner_looks.py).
        self.partner_looks = PartnerLooks()

    async def close(self) -> None:
        await super().close()
        await self.stop_listener.close()
        await self.copy_connections.close()
        await self.partner_looks.close()

    @activity.defn
    @attempt_step
    async def build(self, request: AttemptInput) -> BuildOutput:
        """Build the file, with the lease kept and stop requests heard. Also how a build resumes elsewhere (or
        again here) after its worker went quiet: it first takes the attempt's build slot, which fences any earlier
        build of the attempt and fails once a takeover has committed."""
        job, attempt_id = request.job, request.attempt_id
        claimed = await self._end_claim_keeper(job.id, attempt_id)
        if activity.is_worker_shutdown():
            # Taken as this worker began to shut down: build nothing, and hand the claim back (its lease ends now).
            if claimed is not None:
                try:
                    await self.store.release_lease(job.id, attempt_id, self.worker_id)
                except Exception as exc:  # noqa: BLE001 - the lease lapses by itself: recovery requeues it then
                    log.warning("export %s attempt %s: handing back left to the lease's lapse: %s", job.id,
                                attempt_id, errors.describe(exc))
            return BuildOutput(ended="HandedBack")
        final_name = job.final_name
        if final_name is None:
            # A row that a run of 0.1.0 read, before the name was a column: the name is the row's (no role may
            # change it), and never one this worker would derive.
            stored = await self.store.read_job(job.id)
            if stored is None or stored.final_name is None:
                return BuildOutput(ended="LostOwnership")
            final_name = stored.final_name
        late = self._started_late()
        if late is not None:
            # A task handed to this worker while it was paused (a poll it had open): Temporal already timed it out
            # and the workflow moved on, so taking the build slot now would only fence the build that replaced it.
            log.warning("build of %s attempt %s reached this worker %.1f s after it was scheduled, past its "
                        "schedule-to-start bound; it does nothing", job.id, attempt_id, late)
            return BuildOutput(ended="StartedLate")
        holder = build_holder(self.worker_id, request.resumption)
        # One file per build, so a fenced build never writes the file a later one built.
        path = Path(self.settings.work_dir) / f"{job.id}-{attempt_id}-{holder.rpartition('/')[2]}.csv"
        progress: dict[str, Any] = {"bytes": 0}
        build_task = asyncio.current_task()
        lost = asyncio.Event()
        lapsing = asyncio.Event()

        def on_lost() -> None:
            lost.set()
            if build_task is not None:
                build_task.cancel()

        def on_lapsing() -> None:
            # No renewal answered and the lease is about to lapse: stop while the attempt is still this build's.
            lapsing.set()
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
        leased_at = asyncio.get_running_loop().time()  # build_start sets the lease, at the server, after this
        if not await self.store.start_build(job.id, attempt_id, holder, detail, generation=request.resumption):
            # Write nothing: another attempt owns the row now, or a build the run scheduled later holds the slot.
            remove_local_file(path)  # a file taken from an earlier build for this one
            return BuildOutput(ended="LostOwnership")
        lease = self._keeper(job.id, attempt_id, holder, on_lost, on_lapsing=on_lapsing, leased_at=leased_at)
        handed_over = False
        shutdown_watch = asyncio.create_task(hand_back_on_shutdown())
        try:
            async with self._heartbeating(lambda: dict(progress)):
                if self.capacity.builds.holds((job.id, attempt_id)) or (
                        self.capacity.builds.free and self.capacity.shares.has_room(job.destination_id,
                                                                                    (job.id, attempt_id))):
                    await self._slot(self.capacity.builds, job, attempt_id, progress)
                else:
                    # A build resumed on a busy worker waits for a slot (or its destination's place), Running and
                    # leased: a stop recorded meanwhile is heard now, not once one frees (minutes, behind slow builds).
                    try:
                        async with StopWatch(self.stop_listener, self.store, job.id, attempt_id,
                                             metrics.timed_stop(job.id, attempt_id, on_stop)):
                            await self._slot(self.capacity.builds, job, attempt_id, progress)
                    except asyncio.CancelledError:
                        ended = await run_to_end(self._after_build_cancelled(lease, lost, lapsing, job.id,
                                                                             attempt_id, holder,
                                                                             shutting_down.is_set()))
                        if ended is None:
                            raise
                        return ended
                refusal = await self._preflight(job, final_name)
                if refusal is not None:
                    code, why = refusal
                    async with lease.terminal_write():
                        await self.store.finish_failed(job.id, attempt_id, code, why, holder=holder)
                    return BuildOutput(ended=code.value)
                try:
                    async with StopWatch(self.stop_listener, self.store, job.id, attempt_id,
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
                    ended = await run_to_end(self._after_build_cancelled(lease, lost, lapsing, job.id, attempt_id,
                                                                         holder, shutting_down.is_set()))
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
                file=BuiltFile(path=str(path), final_name=final_name, size=size, sha256_hex=sha256_hex,
                               holder=holder),
                worker_task_queue=self.worker_task_queue,
            )
        except asyncio.CancelledError:
            if not (shutting_down.is_set() or lapsing.is_set()):
                raise
            # The shutdown (hand the attempt back too), or a lease about to lapse, came before the build itself
            # began (in the preparation).
            ended = await run_to_end(self._after_build_cancelled(lease, lost, lapsing, job.id, attempt_id, holder,
                                                                 shutting_down.is_set()))
            assert ended is not None  # it always ends so: Stopped, LostOwnership, LeaseLapsing or HandedBack
            return ended
        finally:
            shutdown_watch.cancel()
            if not handed_over:
                await lease.finish()

    async def _build_with_room(self, job: JobRow, attempt_id: UUID, path: Path,
                               progress: dict[str, Any]) -> tuple[int, str]:
        """The build, tried again while the disk is full (backing off to 30 s) for at most
        `disk_full_patience_seconds`, and while PostgreSQL is away for about a lease; any other failure at once."""

        async def build() -> tuple[int, str]:
            progress.update(bytes=0)
            return await build_contacts_csv(
                self.copy_connections, job.tenant_id, path,
                on_progress=lambda size: progress.update(bytes=size),
                throttle_bytes_per_second=self.settings.build_throttle_bytes_per_second,
            )

        async def build_through_blips() -> tuple[int, str]:
            # A transient fault is no reason to fail the export: tried again for about a lease, while the keeper
            # renews it (or ends the build if the attempt is lost meanwhile).
            return await retry_patiently(
                build, retryable=lambda exc: isinstance(exc, BuildError) and exc.database_away,
                patience=self.settings.lease_seconds, first_delay=0.5, max_delay=5.0,
                what=f"build of {job.id} attempt {attempt_id}: PostgreSQL away")

        return await retry_patiently(
            build_through_blips, retryable=lambda exc: isinstance(exc, BuildError) and exc.disk_full,
            patience=self.settings.disk_full_patience_seconds, first_delay=1.0, max_delay=30.0,
            what=f"build of {job.id} attempt {attempt_id} in {path.parent}")

    def _started_late(self) -> float | None:
        """Seconds since the task was scheduled, if past its schedule-to-start bound (one lease) and a margin."""
        elapsed = (datetime.now(UTC) - activity.info().current_attempt_scheduled_time).total_seconds()
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
        self, lease: LeaseKeeper, lost: asyncio.Event, lapsing: asyncio.Event, job_id: UUID, attempt_id: UUID,
        holder: str, shutting_down: bool,
    ) -> BuildOutput | None:
        await self.checkpoints.reached(checkpoints.BUILD_CANCELLED, job_id)
        await lease.finish()
        if lost.is_set():
            return BuildOutput(ended="LostOwnership")
        if lapsing.is_set():
            # PostgreSQL did not answer: nothing to write there now. The lease lapses and recovery takes the
            # attempt over, as after a lost worker.
            log.warning("build of %s attempt %s stopped: its lease was about to lapse unrenewed", job_id,
                        attempt_id)
            return BuildOutput(ended="LeaseLapsing")
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

    async def _preflight(self, job: JobRow, final_name: str) -> tuple[FailureCode, str] | None:
        """The preparation's look at the partner, before the build: what ends the attempt now, from Running (where a
        stop request can still win) and before cutoff 2 spends anything. An unreachable partner is not a reason:
        the delivery looks again and records the baseline that counts."""
        destination = await self.store.read_destination(job.tenant_id, job.destination_id)
        if destination is None:
            return None
        config = DestinationConfig.from_row(destination)
        try:
            final = await preflight(config, final_name, looks=self.partner_looks)
        except (HostKeyMismatch, FinalDirMissing, asyncssh.PermissionDenied, ValueError) as exc:
            return FailureCode.NOT_DELIVERED, f"preparation: {type(exc).__name__}: {exc}"
        except Exception as exc:
            log.warning("preparation could not look at %s for %s: %s", final_name, job.id, exc)
            return None
        if final.exists and job.replaces_job_id is None:
            # An original's name is unique to its key, so a file there is a conflict: nothing is uploaded.
            return FailureCode.FINAL_NAME_OCCUPIED, f"{final_name} exists at the partner before delivery"
        return None

    @activity.defn
    async def stop_attempt(self, request: AttemptInput) -> bool:
        """A stop recorded while no build runs for the attempt: the conditional Running -> Stopped."""
        return await self.store.finish_stopped(request.job.id, request.attempt_id, "BeforeBuild")
