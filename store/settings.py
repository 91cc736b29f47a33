"""One settings class for every process, read from EXPORTS_* environment variables.

Durations are settings so that tests run in seconds what production runs in minutes. `exports dev` writes the
addresses of the local stack to `.exports/local.env`, so commands in another terminal find it.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from store import urls

LOCAL_ENV_FILE = Path(".exports/local.env")


def default_destination_share(max_builds: int, max_uploads: int) -> int:
    """A destination's share of a worker when none is set: half its builds and uploads together, and always at
    least one upload slot left for the other destinations (12 with the defaults). One destination alone then runs
    at most that many at once: the price of never letting it take the whole worker."""
    return max(1, min(max_uploads - 1, (max_builds + max_uploads) // 2))


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EXPORTS_", env_file=LOCAL_ENV_FILE, extra="ignore")

    # One URL per database role (ARCHITECTURE.md, "Database roles are real").
    database_url: str = Field("", description="application role: activities and the starter")
    dispatcher_database_url: str = Field("", description="dispatcher role: reads the outbox, sets published_at")
    reconciliation_database_url: str = Field("", description="reconciliation role: corrections")
    owner_database_url: str = Field("", description="owner: migrations and role setup")
    # How long a migration waits for each lock before it rolls back (exports migrate): bounded, so that its DDL
    # never queues every worker's statements on a table behind a long transaction.
    migration_lock_timeout_seconds: float = Field(10.0, gt=0)
    # Connection pools per role in a worker process (docs/database.md, "Connection budget"): the pool keeps
    # pool_size connections open and opens up to max_overflow more under load.
    database_pool_size: int = Field(5, ge=1)
    database_max_overflow: int = Field(5, ge=0)
    dispatcher_pool_size: int = Field(2, ge=1)
    dispatcher_max_overflow: int = Field(2, ge=0)

    temporal_address: str = "127.0.0.1:7233"
    temporal_namespace: str = "default"
    task_queue: str = "exports"
    worker_id: str = ""

    # How many builds and uploads one worker process runs at once (LD1, LD2; docs/database.md, "Connection budget":
    # each build holds two connections). A worker takes a claim only while it has a build slot free, and an attempt
    # holds its build slot until it has an upload slot, so slow partners stop claims rather than pile up files.
    max_builds: int = Field(8, ge=1, le=1000)
    max_uploads: int = Field(16, ge=1, le=1000)
    # glibc's mmap threshold in the worker, fixed at start (activities/process/allocator.py): a large block is mapped
    # on its own and given back when freed, so a burst (a flood of signals in one workflow task) does not stay in
    # the worker's memory (C2). 0: glibc's own threshold, which rises up to 32 MiB after large frees. Lower costs
    # uploads: at 128 KiB a delivery ran about 15% slower, at 32 KiB four times slower (an mmap per buffer).
    malloc_mmap_threshold_bytes: int = Field(1024 * 1024, ge=0, le=32 * 1024 * 1024)
    # How often the worker hands the heap's free pages back to the system (glibc's malloc_trim, from a thread of its
    # own; activities/process/allocator.py): what a burst freed among live blocks does not stay resident (C2). A
    # call costs milliseconds; 0: never.
    malloc_trim_interval_seconds: float = Field(10.0, ge=0, le=3600)
    # How many attempts to one destination a worker holds at once, from the claim to the end of the upload (LD4):
    # one slow partner takes no more than its share, and the others' exports go on. Unset:
    # `default_destination_share`.
    max_per_destination: int | None = Field(None, ge=1, le=1000)

    # Patches this release only understands, activated on this worker's new runs all the same (workflows/patches.py;
    # comma-separated names, e.g. `cancel-update`). The previous release cannot replay a run that recorded one: a
    # rollback then drains those runs first (CHANGELOG.md). Unset: none, the safe default.
    early_patches: str = ""

    lease_seconds: float = Field(60.0, gt=0)
    renew_every_seconds: float = Field(20.0, gt=0)
    # Attempts an export may lose alone (its worker killed, paused past its lease or cut off while holding nothing
    # else that lapsed) before it ends Failed/AttemptsExhausted. An attempt lost with its worker (another attempt
    # of the same worker lapsed with it: the worker was lost, most likely not through this export) counts against
    # max_shared_losses instead, a looser cap that still ends a job which kills a busy worker every time (migration
    # 0014). Either kind lost while a worker that never held the export was lost too (in the same lease and
    # recovery interval: workers are being lost whatever they hold) says nothing about the export and counts
    # against max_losses_amid_others, the ceiling (migration 0015). An attempt its own worker handed back before the
    # rename (the upload failed and the final name could not be looked at) is not lost: those are capped apart, by
    # max_hand_backs (migration 0013).
    max_attempts: int = Field(3, ge=1)
    max_shared_losses: int = Field(10, ge=1, le=1000)
    max_losses_amid_others: int = Field(30, ge=1, le=1000)
    max_hand_backs: int = Field(10, ge=1, le=1000)
    # How often a running step heartbeats to Temporal, which is also how often the SDK sends one (LD6). Unset: the
    # lease's renewal interval (a third of the lease at most, so that one late heartbeat is not a lost worker):
    # heartbeats mirror the lease. Each one that reaches the server is a billable action on Temporal Cloud and a
    # write on any cluster; a stop reaches a build through the database (docs/design.md §5.6), not in a reply. Set,
    # at most a third of the lease (checked below).
    heartbeat_throttle_seconds: float | None = Field(None, gt=0)
    lock_timeout_ms: int = Field(2000, ge=1)
    # Client-side bounds on PostgreSQL (docs/database.md, "Silent networks"): a network that drops packets
    # silently is seen in seconds. A bound that fires is an uncertain answer, as a lost connection is.
    database_statement_timeout_seconds: float = Field(
        15.0, gt=0, description="longest wait for a statement's answer (not a build's COPY, which keepalives bound)")
    database_connect_timeout_seconds: float = Field(
        5.0, gt=0, description="longest wait for a new connection, its TLS and authentication included")
    database_tcp_user_timeout_seconds: float = Field(
        10.0, ge=1, description="how long sent data or keepalive probes may go unacknowledged before the kernel "
                                "drops the connection (TCP_USER_TIMEOUT; keepalives start after half of it idle)")
    reread_timeout_seconds: float = Field(5.0, gt=0)
    dispatcher_poll_seconds: float = Field(2.0, gt=0)
    # Starts a pass publishes side by side: one Temporal round trip after another held a burst of exports to about
    # ten starts a second (P1). An export's own rows still go out one after another.
    dispatcher_concurrency: int = Field(16, ge=1, le=256)
    # The outbox lock's session is ended by PostgreSQL after this much silence (store/outbox.py): the longest one
    # paused or cut-off dispatcher holds the others back. A publication may take half of it.
    dispatcher_lock_idle_seconds: float = Field(5.0, ge=1)
    # Off only to drain a deployment before a rollback (CHANGELOG.md): no new run starts, and exports created
    # meanwhile wait in the database, Queued, for the next dispatcher.
    dispatcher_enabled: bool = True
    # Checks the worker's start may skip (starter/preflight.py): only `search-attributes`, for credentials that may
    # neither list nor query them, once an operator has checked them another way.
    preflight_skip: str = Field("", pattern=r"^\s*(search-attributes)?\s*$")
    sweeper_threshold_seconds: float = Field(1800.0, gt=0)
    sweeper_interval_seconds: float = Field(60.0, ge=1)
    sweeper_batch: int = Field(500, ge=1)
    recovery_interval_seconds: float = Field(30.0, ge=1)
    # An export's run that waits for a wake-up reads its row again after this long anyway (a lost wake-up costs
    # at most this); it reaches the run through the claim step's recorded result.
    idle_recheck_seconds: float = Field(300.0, ge=1)
    recovery_batch: int = Field(100, ge=1)
    # Each recovery run also looks for exports whose last run closed before their row settled (a terminated run)
    # among the runs closed this long ago at most, and wakes each once: a run then reads the row again.
    recovery_view_window_seconds: float = Field(86400.0, gt=0)
    # How often each partner's temporary directory is swept of our temporary files older than its contract allows.
    partner_sweep_interval_seconds: float = Field(3600.0, ge=1)
    # How long a workflow task waits on the sticky queue of the worker that has the run cached before any worker
    # may take it: a killed worker's runs wait this long first (Temporal's default, 10 s).
    sticky_queue_timeout_seconds: float = Field(10.0, gt=0, le=60)
    # The evidence follow-up (LV2): how often it looks again at OutcomeUnknown exports, for how long after each
    # became so (past it, an export is left for a person), and how many it looks at per run.
    follow_up_interval_seconds: float = Field(600.0, ge=1)
    follow_up_window_seconds: float = Field(86400.0, gt=0)
    follow_up_batch: int = Field(50, ge=1, le=1000)
    # How often a worker removes built files that no attempt can use any more (contact data on its disk).
    scavenge_interval_seconds: float = Field(300.0, gt=0)
    # How long a delivery waits for PostgreSQL to pass its rename fence (its upload done, the rename not sent) and,
    # once it has its outcome, to take its evidence and terminal write, before it leaves the attempt to recovery.
    store_outage_patience_seconds: float = Field(600.0, gt=0)
    # A delivery proven not delivered by a fault that may pass (cut before the rename was sent, the final name
    # untouched) is tried again within its attempt, under its lease: at most this many tries in all, pausing
    # `delivery_retry_delay_seconds` before the second, twice that before the third, and so on.
    delivery_tries: int = Field(3, ge=1, le=10)
    delivery_retry_delay_seconds: float = Field(2.0, ge=0, le=60)
    # How long a build that finds the local disk full keeps trying (space another build holds may be freed)
    # before the attempt ends BuildFailed.
    disk_full_patience_seconds: float = Field(600.0, ge=0)
    # SIGTERM: builds are handed back at once; uploads in flight get this long to end (the SDK's graceful shutdown
    # timeout), and the process exits at most `shutdown_grace_seconds + 5` after the signal, leaving an upload
    # that has not ended to recovery, as after a crash. A pod's terminationGracePeriodSeconds must exceed both.
    shutdown_grace_seconds: float = Field(25.0, ge=0)

    work_dir: Path = Path(".exports/work")
    # Fault injection only: checkpoints (activities/checkpoints.py) where a worker holds, for a test to kill it.
    hold_at: str = ""
    # Pacing for demos and long-work tests; 0 means unthrottled.
    build_throttle_bytes_per_second: int = Field(0, ge=0)
    upload_throttle_bytes_per_second: int = Field(0, ge=0)

    # Observing the worker (docs/observing.md): one HTTP port for /metrics, /livez and /readyz (0: none). The SDK
    # serves its own metrics on a second address (port 0: a free loopback port), appended to this port's /metrics.
    # The gauges read from PostgreSQL are refreshed every `metrics_refresh_seconds`, never per export or scrape.
    # Tracing (OpenTelemetry): off, console or otlp (with the standard OTEL_EXPORTER_OTLP_ENDPOINT).
    http_port: int = Field(8080, ge=0, le=65535)
    http_bind_address: str = "0.0.0.0"
    sdk_metrics_port: int = Field(0, ge=0, le=65535)
    sdk_metrics_bind_address: str = "127.0.0.1"
    metrics_refresh_seconds: float = Field(30.0, gt=0)
    tracing: str = Field("off", pattern=r"^(off|console|otlp)$")

    # Logs (activities/process/logs.py, docs/operating.md): `text` for people, `json` for one object per line, for a log
    # collector; the level by name. Checked here, so a typo stops the process at start, in one line.
    log_format: str = "text"
    log_level: str = "INFO"

    @field_validator("database_url", "dispatcher_database_url", "reconciliation_database_url",
                     "owner_database_url")
    @classmethod
    def _hosts_read_whole(cls, value: str) -> str:
        # Several hosts (a primary and its standbys) in a form one reader would take for fewer: refused at start,
        # naming the form that works (store/urls.py), never read as one host.
        return urls.check(value)

    @field_validator("worker_id")
    @classmethod
    def _own_queue_not_admission(cls, value: str) -> str:
        # The worker's own queue is `<task_queue>-<worker_id>`: this one is every worker's admission queue.
        if value.strip() == "admission":
            raise ValueError("'admission' is the name of the claims' queue, not a worker's")
        return value

    @field_validator("early_patches")
    @classmethod
    def _patches_understood(cls, value: str) -> str:
        from workflows.patches import UNDERSTOOD  # the list of what this release can activate early

        names = {name.strip() for name in value.split(",") if name.strip()}
        if unknown := sorted(names - UNDERSTOOD):
            can = ", ".join(sorted(UNDERSTOOD)) or "none"
            raise ValueError(f"{', '.join(unknown)}: not a patch this release can activate early (it can: {can})")
        return ",".join(sorted(names))

    @field_validator("log_format")
    @classmethod
    def _known_log_format(cls, value: str) -> str:
        if value.strip().lower() not in ("text", "json"):
            raise ValueError(f"{value!r} is not text or json")
        return value.strip().lower()

    @field_validator("log_level")
    @classmethod
    def _known_log_level(cls, value: str) -> str:
        if value.strip().upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ValueError(f"{value!r} is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
        return value.strip().upper()

    @property
    def destination_share(self) -> int:
        """The most attempts to one destination a worker holds at once (`max_per_destination`)."""
        if self.max_per_destination is not None:
            return self.max_per_destination
        return default_destination_share(self.max_builds, self.max_uploads)

    @property
    def early_patch_ids(self) -> frozenset[str]:
        return frozenset(name for name in self.early_patches.split(",") if name)

    @property
    def heartbeat_seconds(self) -> float:
        """The heartbeat cadence in force (`heartbeat_throttle_seconds`)."""
        if self.heartbeat_throttle_seconds is not None:
            return self.heartbeat_throttle_seconds
        return min(self.renew_every_seconds, self.lease_seconds / 3)

    @model_validator(mode="after")
    def _renewal_fits_in_lease(self) -> Settings:
        if self.renew_every_seconds >= self.lease_seconds:
            raise ValueError("renew_every_seconds must be shorter than lease_seconds")
        # Temporal gives a step up after one lease without a heartbeat, and a step whose heartbeats come more than
        # half a lease apart is late at each (activities/lease.py, Beats): a third keeps one late heartbeat harmless.
        if self.heartbeat_throttle_seconds is not None and self.heartbeat_throttle_seconds > self.lease_seconds / 3:
            raise ValueError(f"heartbeat_throttle_seconds must be at most a third of lease_seconds "
                             f"({self.lease_seconds / 3:g}), not {self.heartbeat_throttle_seconds:g}")
        return self


def as_env(settings: Settings) -> dict[str, str]:
    """The EXPORTS_* variables that make another process read these same settings."""
    return {f"EXPORTS_{name.upper()}": str(value) for name, value in settings.model_dump().items()
            if value is not None}


@lru_cache
def get_settings() -> Settings:
    return Settings()


def setting_problem(exc: ValidationError) -> str:
    """The first setting that does not parse, and why, in one line: how the command line and a process's start
    say it."""
    first = exc.errors()[0]
    name = f"setting EXPORTS_{str(first['loc'][0]).upper()}" if first["loc"] else "settings"
    return f"{name}: {first['msg'].removeprefix('Value error, ')}"
