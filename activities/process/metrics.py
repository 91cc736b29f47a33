"""The worker's own metrics, in Prometheus format (prometheus_client), served with the SDK's at /metrics.

Counters and histograms are bumped in memory where the event happens (one call, no I/O): nothing here may slow
an export. The gauges that only PostgreSQL knows (the outbox backlog, the age of its oldest unpublished row,
the exports in each state) are read by one background task every
`metrics_refresh_seconds`, as the application role (it may SELECT outbox and export_jobs), never at scrape time
and never per export. A read that fails is logged and counted, the gauges keep their last values, and the worker
goes on.

Labels stay bounded: a status, a kind, a failure class, a destination ID; never a job or an attempt ID.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from uuid import UUID

import asyncpg
from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics

from store.models import Status

# The logger keeps the name it had before the module moved into process/: log filters and alerts match on it.
log = logging.getLogger("activities.metrics")

T = TypeVar("T")

# A `_created` series per counter and histogram doubles the series count for nothing a dashboard reads.
disable_created_metrics()  # type: ignore[no-untyped-call]  # untyped in prometheus_client

_BYTES = (1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10)
_SECONDS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
_STOP_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

ENDED = Counter("exports_ended", "Terminal writes this worker made, by the state they wrote", ["status"])
TAKEOVERS = Counter("exports_recovery_takeovers", "Recovery takeovers that committed, by the event recorded",
                    ["kind"])
RENEWALS_FAILED = Counter("exports_lease_renewals_failed",
                          "Lease renewals that failed: error (threw or had no answer in time; retried soon), lost "
                          "(matched no row) or lapsing (none answered and the lease was about to lapse)", ["reason"])
# Each reason at 0 from the start: an alert's rate() needs the series before its first failure.
for _reason in ("error", "lost", "lapsing"):
    RENEWALS_FAILED.labels(reason=_reason)
CUTOFF_2_REFUSED = Counter("exports_cutoff_2_refused",
                           "Cutoff 2 steps that authorized nothing because their run had moved on: late (the step "
                           "reached the database past its own bound: its worker was paused) or not_owner (the row no "
                           "longer let it: its run gave the step up, or the attempt was taken back)", ["reason"])
for _reason in ("late", "not_owner"):
    CUTOFF_2_REFUSED.labels(reason=_reason)
STOP_LATENCY = Histogram("exports_stop_latency_seconds",
                         "From the stop watcher confirming a stop to the build's Stopped write", buckets=_STOP_SECONDS)
BUILD_BYTES = Histogram("exports_build_bytes", "Size of each file built", buckets=_BYTES)
BUILD_SECONDS = Histogram("exports_build_seconds", "Duration of each build that finished", buckets=_SECONDS)
UPLOAD_BYTES = Histogram("exports_upload_bytes", "Size of each file delivered (outcome Completed)", buckets=_BYTES)
DELIVERY_SECONDS = Histogram("exports_delivery_seconds", "Duration of each delivery, by outcome", ["outcome"],
                             buckets=_SECONDS)
DELIVERY_FAILURES = Counter("exports_delivery_failures",
                            "Deliveries that did not complete, by destination and failure class",
                            ["destination", "failure"])
EVIDENCE_SKIPPED = Counter("exports_recovery_evidence_skipped",
                           "Evidence records recovery did not judge by: malformed, or not by the attempt's holder",
                           ["why"])
VIEWS_BEHIND = Counter("exports_recovery_views_woken",
                       "Exports whose last run had closed with a state the row no longer has, woken by recovery")
FOLLOW_UP_LOOKS = Counter("exports_follow_up_looks",
                          "The evidence follow-up's looks at OutcomeUnknown exports, by what each concluded "
                          "(Completed: settled by proof; OutcomeUnknown: not settled; Unreachable: no look had)",
                          ["concluded"])
SLOTS_IN_USE = Gauge("exports_worker_slots_in_use", "This worker's build and upload slots held by attempts",
                     ["kind"])
SLOTS_LIMIT = Gauge("exports_worker_slots_limit", "This worker's build and upload slots (EXPORTS_MAX_BUILDS, "
                    "EXPORTS_MAX_UPLOADS)", ["kind"])
SLOTS_WAITING = Gauge("exports_worker_slots_waiting", "Steps on this worker waiting for a build or upload slot, "
                      "their leases kept", ["kind"])
SLOT_WAITS = Counter("exports_worker_slot_waits", "Steps that had to wait for a build or upload slot", ["kind"])
SWEEPS = Counter("exports_sweeps", "Sweep runs, by kind", ["kind"])
SWEPT = Counter("exports_swept", "What the sweeps changed: queued rows woken, temporary files removed", ["kind"])

OUTBOX_BACKLOG = Gauge("exports_outbox_backlog", "Outbox rows not yet published")
OUTBOX_OLDEST = Gauge("exports_outbox_oldest_unpublished_age_seconds",
                      "Age of the oldest unpublished outbox row (0 when none)")
# Every state, whoever wrote it: a queued export's Canceled is written by `exports cancel` (no worker's counter sees
# it), and a state written while no worker ran is here too.
JOBS = Gauge("exports_jobs", "Exports whose row is in each state, as last read", ["status"])
STORE_READ_FAILURES = Counter("exports_metrics_store_read_failures", "Failed reads of the gauges above")
STORE_READ_AT = Gauge("exports_metrics_store_read_timestamp_seconds", "When the gauges above were last read")


def slots(kind: str, *, in_use: int, waiting: int, limit: int) -> None:
    SLOTS_IN_USE.labels(kind).set(in_use)
    SLOTS_WAITING.labels(kind).set(waiting)
    SLOTS_LIMIT.labels(kind).set(limit)


def slot_wait(kind: str) -> None:
    SLOT_WAITS.labels(kind).inc()


def ended(status: Any) -> None:
    """A settled state recorded: the worker's store classes' `on_ended` (JobStore, Recovery)."""
    ENDED.labels(status=str(status)).inc()


def takeover(kind: str | None) -> None:
    if kind is not None:
        TAKEOVERS.labels(kind=kind).inc()


def swept(kind: str, count: int) -> int:
    SWEEPS.labels(kind=kind).inc()
    SWEPT.labels(kind=kind).inc(count)
    return count


async def timed_build(build: Awaitable[tuple[int, str]]) -> tuple[int, str]:
    started = time.monotonic()
    size, sha256_hex = await build
    BUILD_SECONDS.observe(time.monotonic() - started)
    BUILD_BYTES.observe(size)
    return size, sha256_hex


async def timed_delivery(destination_id: UUID, size: int, delivery: Awaitable[T]) -> T:
    """Times a delivery and counts how it ended; `delivery` returns an outcomes.DeliveryResult."""
    started = time.monotonic()
    result = await delivery
    outcome = str(getattr(result, "outcome", "Unknown"))
    DELIVERY_SECONDS.labels(outcome=outcome).observe(time.monotonic() - started)
    if outcome == "Completed":
        UPLOAD_BYTES.observe(size)
    else:
        failure = getattr(result, "failure_reason", None) or outcome
        DELIVERY_FAILURES.labels(destination=str(destination_id), failure=str(failure)).inc()
    return result


# Stops confirmed and not yet written, by attempt: bounded, since a stop whose write never comes (a lost
# ownership, a crash of the write) leaves its entry behind.
_stops_heard: dict[tuple[UUID, UUID], float] = {}
_MAX_STOPS_HEARD = 1000


def timed_stop(job_id: UUID, attempt_id: UUID, on_stop: Callable[[], None]) -> Callable[[], None]:
    """`on_stop`, noting when the stop watcher confirmed the stop."""

    def heard() -> None:
        if len(_stops_heard) >= _MAX_STOPS_HEARD:
            _stops_heard.clear()
        _stops_heard[(job_id, attempt_id)] = time.monotonic()
        on_stop()

    return heard


def stop_written(job_id: UUID, attempt_id: UUID) -> None:
    """A build's Stopped write committed: timed from when its stop was confirmed (the store counts the write)."""
    heard_at = _stops_heard.pop((job_id, attempt_id), None)
    if heard_at is not None:
        STOP_LATENCY.observe(time.monotonic() - heard_at)


# One statement: the unpublished outbox rows have their own partial index (ix_outbox_unpublished); export_jobs has
# no index on status, so its count by state is one scan, hence the long interval.
STORE_GAUGES_SQL = """
SELECT (SELECT count(*) FROM outbox WHERE published_at IS NULL) AS backlog,
       (SELECT coalesce(extract(epoch FROM now() - min(created_at)), 0)
          FROM outbox WHERE published_at IS NULL) AS oldest,
       (SELECT coalesce(jsonb_object_agg(status, n), '{}'::jsonb)::text
          FROM (SELECT status, count(*) AS n FROM export_jobs GROUP BY status) AS by_status) AS jobs
"""
_READ_TIMEOUT_SECONDS = 5.0


async def read_store_gauges(dsn: str) -> None:
    """One read of the gauges; raises on failure (the caller logs it)."""
    conn = await asyncpg.connect(dsn, timeout=_READ_TIMEOUT_SECONDS,
                                 server_settings={"application_name": "exports-metrics",
                                                  "statement_timeout": str(int(_READ_TIMEOUT_SECONDS * 1000))})
    try:
        row = await conn.fetchrow(STORE_GAUGES_SQL, timeout=_READ_TIMEOUT_SECONDS)
    finally:
        async with asyncio.timeout(_READ_TIMEOUT_SECONDS):  # see keep_reading_store_gauges: not wait_for
            await conn.close()
    if row is None:  # an aggregate query answers one row: this is only for the type
        raise RuntimeError("the gauges query returned no row")
    OUTBOX_BACKLOG.set(row["backlog"])
    OUTBOX_OLDEST.set(float(row["oldest"]))
    jobs = json.loads(row["jobs"])
    for status in Status:
        JOBS.labels(status=status.value).set(jobs.get(status.value, 0))
    STORE_READ_AT.set(time.time())


async def keep_reading_store_gauges(dsn: str, every: float) -> None:
    """Until cancelled. Never raises: metrics must never take the worker down."""
    while True:
        try:
            # Not asyncio.wait_for: on Python 3.11 a cancel that comes as the read ends is lost there, and this
            # loop went on to sleep, holding up whoever waited for it to end (the worker's exit, a test's close).
            async with asyncio.timeout(2 * _READ_TIMEOUT_SECONDS + 1):
                await read_store_gauges(dsn)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - logged and counted; the gauges keep their last values
            STORE_READ_FAILURES.inc()
            log.warning("could not read the metrics gauges from PostgreSQL: %s: %s", type(exc).__name__, exc)
        await asyncio.sleep(every)
