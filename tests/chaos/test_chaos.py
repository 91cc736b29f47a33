"""Chaos (case CH1): real worker processes killed (SIGKILL) and paused past their lease (SIGSTOP, then SIGCONT) at
random while exports run; their PostgreSQL connections cut through a real TCP proxy; the partner's SFTP connections
closed mid-transfer and around the rename; the Temporal server restarted on its database file; exports canceled
(some twice with one request ID, some concurrently, some through Temporal's own cancel) and sent hostile `cancel`
signals; an operator editing terms, replacing, reconciling and correcting; recovery runs every second. Then the
invariants, read from PostgreSQL, the partner's folders, the workers' folders and Temporal.

Each fault class is counted, and a run that injected fewer than its profile's minimum fails: a quiet run proves
nothing. Profiles (EXPORTS_CHAOS_PROFILE): `ci` (the default; about two minutes, run by `.ci/run`), `full`, and
`transient` (`transient_window`: one fault at a time, each aimed where it touches only exports that saw none, none
at its point of no return; every export not canceled or stopped must then end Completed; also run by `.ci/run`).

Outcomes that need a person (OutcomeUnknown, Failed but OriginalDelivered) are counted per 1,000 exports and each
is attributed to the injected fault that caused it (tests/helpers/chaos_accounting.py says how): the run fails on
one that no injected fault explains, and when too few deliveries were confirmed by the system (the profile's
`confirmed_floor`: confirmations that never happen).

Runs only with EXPORTS_CHAOS=1. Seeded: the seed is printed, and EXPORTS_CHAOS_SEED=<seed> replays the same
sequence of actions (their timing against the workers is, of course, not replayed exactly).

    EXPORTS_CHAOS=1 .venv/bin/pytest tests/chaos/test_chaos.py -q -p no:cacheprovider -s
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import re
import signal
import time
import uuid
from collections import Counter, defaultdict
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.workflowservice.v1 import ResetStickyTaskQueueRequest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError

from activities.contracts import TEMPORAL_CANCEL_OPERATOR, ExportResult, PartnerSweepOutput
from activities.process.scavenger import scavenge
from starter.localstack.ports import free_port
from starter.localstack.seed import seed_destination
from starter.localstack.temporal import LocalTemporal
from store.models import CancellationOutcome, CancellationResult, FailureCode, Status
from store.recovery import LOST_AMID_OTHERS
from tests.helpers.chaos_accounting import NOT_TO_DELIVER, Accounting, Fault, account, evidence_step, worker_pid
from tests.helpers.faults import PgFaultProxy, fault_proxy
from tests.helpers.harness import Harness, WorkerProcess, open_harness, run_recovery
from tests.helpers.support import CHAOS_REPORT
from worker import running_worker
from workflows.identity import export_workflow_id

LEASE = 2.0
WORKERS = 3
SCAVENGE_EVERY = 2.0


@dataclass(frozen=True)
class Profile:
    exports: int
    chaos_seconds: float    # creations and every fault happen in this window
    create_within: float    # all exports are created within the first seconds of the window
    minimum: dict[str, int]  # per fault class: fewer injected, and the run fails
    # Of the exports that were to deliver, the share the system itself must confirm Completed (see
    # tests/helpers/chaos_accounting.py): fewer, and confirmations are not happening. The ci profile confirmed from
    # 20% to 71% of them in runs seen here (most of the rest OutcomeUnknown after a kill or pause mid-delivery);
    # with after_rename answering OutcomeUnknown every time it confirmed none.
    confirmed_floor: float = 0.05
    # Transient faults only (`transient_window`): each export sees at most one fault, none at its point of no
    # return, and every export not canceled or stopped must end Completed.
    transient: bool = False


PROFILES = {
    "ci": Profile(exports=60, chaos_seconds=40.0, create_within=30.0, minimum={
        "worker crash": 8, "worker pause": 8, "database cut": 10, "partner cut": 10, "Temporal restart": 1,
        "cancel": 30, "hostile signal": 5, "operator work": 5}),
    "full": Profile(exports=1000, chaos_seconds=900.0, create_within=700.0, minimum={
        "worker crash": 100, "worker pause": 100, "database cut": 100, "partner cut": 100, "Temporal restart": 3,
        "cancel": 300, "hostile signal": 50, "operator work": 50}),
    "transient": Profile(exports=50, chaos_seconds=75.0, create_within=65.0, minimum={
        "worker crash": 3, "worker pause": 3, "database cut": 4, "partner cut": 4, "Temporal restart": 1,
        "cancel": 5, "hostile signal": 3}, confirmed_floor=1.0, transient=True),
}
PROFILE = PROFILES[os.environ.get("EXPORTS_CHAOS_PROFILE") or "ci"]
EXPORTS = PROFILE.exports
CHAOS_SECONDS = PROFILE.chaos_seconds
CREATE_WITHIN = PROFILE.create_within
SETTLE_SECONDS = 100.0      # afterwards: one healthy worker and recovery until every row is settled
RESULT_SECONDS = 40.0       # then every workflow must have returned
RECOVERY_EVERY = 1.0

STOP_OUTCOMES = {CancellationOutcome.STOP_REQUESTED, CancellationOutcome.STOP_ALREADY_REQUESTED}


@dataclass
class CancelCall:
    job_id: uuid.UUID
    request_id: uuid.UUID
    twice: bool
    concurrent: bool
    answers: list[CancellationResult] = field(default_factory=list)
    error: str | None = None


@dataclass
class Chaos:
    rng: random.Random
    h: Harness
    work_root: Path
    jobs: list[uuid.UUID] = field(default_factory=list)
    workers: list[WorkerProcess] = field(default_factory=list)  # every process started, dead or alive
    cancels: list[CancelCall] = field(default_factory=list)
    temporal_cancels: list[tuple[uuid.UUID, Status | None]] = field(default_factory=list)  # (job, row status before)
    proxy: PgFaultProxy | None = None
    temporal: LocalTemporal | None = None
    kills: int = 0
    final_kills: int = 0
    injected: Counter = field(default_factory=Counter)  # fault class -> times it really happened
    paused: set[int] = field(default_factory=set)  # pids stopped right now
    hostile_ids: list[uuid.UUID] = field(default_factory=list)
    other_destination: uuid.UUID | None = None  # at the same partner folders: the target of terms edits
    operated: set[uuid.UUID] = field(default_factory=set)  # exports an operator replaced, reconciled or corrected
    operations: Counter = field(default_factory=Counter)  # operator action -> times it took effect
    recoveries: int = 0
    recovery_errors: list[str] = field(default_factory=list)
    recorded: Counter = field(default_factory=Counter)
    tasks: list[asyncio.Task] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)
    wall0: float = field(default_factory=time.time)  # the same moment as t0, on the clock the database's events use
    faults: list[Fault] = field(default_factory=list)  # every fault injected, with its window and scope
    exposed: dict[uuid.UUID, Fault] = field(default_factory=dict)  # transient profile: the one fault each export saw
    partner_armed: bool = False  # transient profile: a partner cut waits for a safe write
    renamed_at: float = 0.0  # transient profile: when the partner last carried out a rename (monotonic)
    admin_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # `in_flight`'s: h.db.admin is one connection
    watchers: list[asyncio.Task] = field(default_factory=list)  # wait for armed faults to fire; never awaited

    def note(self, text: str) -> None:
        line = f"[{time.monotonic() - self.t0:6.1f}s] {text}"
        self.log.append(line)

    def fault(self, kind: str, *, pid: int | None = None, detail: str = "", lasting: bool = False) -> Fault:
        """Records a fault injected now: an instant, or one `lasting` until its `end` is set."""
        now = time.time()
        found = Fault(kind, start=now, end=None if lasting else now, pid=pid, detail=detail)
        self.faults.append(found)
        return found

    def alive(self) -> list[WorkerProcess]:
        return [w for w in self.workers if w.process is not None and w.process.returncode is None]

    def running(self) -> list[WorkerProcess]:
        return [w for w in self.alive() if w.process.pid not in self.paused]

    async def start_worker(self) -> WorkerProcess:
        n = len(self.workers)
        overrides: dict[str, object] = {"work_dir": self.work_root / f"w{n}"}
        if self.proxy is not None:  # the workers' PostgreSQL connections run through the fault proxy
            overrides["database_url"] = self.proxy.url("exports_app", self.h.db.name)
        process = WorkerProcess(self.h.settings, **overrides)
        self.workers.append(process)  # before start: a half-started process is still killed in finally
        await process.start()
        self.note(f"worker w{n} started (pid {process.process.pid})")
        return process


# --- actions ---------------------------------------------------------------------------------------------------------


async def cancel_once(c: Chaos, call: CancelCall) -> CancellationResult:
    """One submission; a Busy answer (nothing recorded) is retried with the same request ID, as the client says."""
    for _ in range(50):
        result = await c.h.exports.cancel(tenant_id=c.h.tenant_id, job_id=call.job_id, requested_by="chaos@example.com",
                                          reason="chaos", request_id=call.request_id)
        if result.outcome is not CancellationOutcome.BUSY:
            return result
        await asyncio.sleep(0.05)
    return result


async def do_cancel(c: Chaos, call: CancelCall) -> None:
    try:
        if call.twice and call.concurrent:
            call.answers += await asyncio.gather(cancel_once(c, call), cancel_once(c, call))
        else:
            call.answers.append(await cancel_once(c, call))
            if call.twice:
                await asyncio.sleep(c.rng.uniform(0.0, 0.5))
                call.answers.append(await cancel_once(c, call))
    except Exception as exc:  # noqa: BLE001 - recorded and reported: the check below counts rows, whatever the client saw
        call.error = f"{type(exc).__name__}: {exc}"


async def do_temporal_cancel(c: Chaos, job_id: uuid.UUID) -> None:
    try:
        before = await c.h.store.read_job(job_id)
        await c.h.client.get_workflow_handle(export_workflow_id(job_id)).cancel()
        c.temporal_cancels.append((job_id, before.status if before else None))
        c.note(f"temporal cancel export-{job_id} (row was {before.status if before else None})")
    except RPCError as exc:  # not started yet, or already closed
        c.note(f"temporal cancel export-{job_id} refused: {exc.status.name}")


async def forget_sticky(c: Chaos) -> None:
    """After a SIGKILL Temporal keeps workflow tasks on the dead worker's sticky queue for a few seconds; ask it to
    drop them now, as a graceful shutdown would. Only saves time; the row decides everything."""
    for job_id in c.jobs:
        try:
            await c.h.client.workflow_service.reset_sticky_task_queue(ResetStickyTaskQueueRequest(
                namespace=c.h.client.namespace, execution=WorkflowExecution(workflow_id=export_workflow_id(job_id))))
        except RPCError:
            pass


async def kill_one(c: Chaos, *, replace: bool = True, victim: WorkerProcess | None = None) -> Fault | None:
    alive = c.alive()
    if not alive:
        return None
    victim = victim or c.rng.choice(alive)
    crash = c.fault("worker crash", pid=victim.process.pid)
    victim.kill()
    await victim.process.wait()
    c.paused.discard(victim.process.pid)
    c.kills += 1
    c.injected["worker crash"] += 1
    c.note(f"SIGKILL worker pid {victim.process.pid}")
    if replace:
        await asyncio.sleep(c.rng.uniform(0.0, 1.5))
        await c.start_worker()
    await forget_sticky(c)
    return crash


async def pause_one(c: Chaos, victim: WorkerProcess | None = None) -> Fault | None:
    """SIGSTOP a worker for longer than the lease, then SIGCONT: the design's paused worker. Never the last one
    running."""
    running = c.running()
    if len(running) < 2:
        return None
    victim = victim or c.rng.choice(running)
    pid = victim.process.pid
    seconds = c.rng.uniform(1.5, 2.5) * LEASE
    pause = c.fault("worker pause", pid=pid, lasting=True)
    victim.process.send_signal(signal.SIGSTOP)
    c.paused.add(pid)
    c.injected["worker pause"] += 1
    c.note(f"SIGSTOP worker pid {pid} for {seconds:.1f} s")

    async def wake() -> None:
        try:
            await asyncio.sleep(seconds)
            if victim.process.returncode is None:
                victim.process.send_signal(signal.SIGCONT)
                c.note(f"SIGCONT worker pid {pid}")
            c.paused.discard(pid)
        finally:
            pause.end = time.time()

    c.tasks.append(asyncio.create_task(wake()))
    return pause


def cut_database(c: Chaos) -> bool:
    """The workers' PostgreSQL connections cut: all at once, or the next statement on the jobs table dropped before
    the server sees it, or let through with its COMMIT and the reply dropped."""
    assert c.proxy is not None
    kind = c.rng.choice(["all", "before", "after commit"])
    if kind == "all":
        if not c.proxy.open_connections:
            return False
        c.proxy.cut_all()
        c.fault("database cut", detail="all")
        c.injected["database cut"] += 1
        c.note("database: every worker connection cut")
        return True
    fired = c.proxy.cut_before("export_jobs") if kind == "before" else c.proxy.cut_after_commit("export_jobs")

    async def count() -> None:
        # Armed until the next statement on the jobs table, or until the next rule of its kind replaces it: counted
        # and recorded whenever it fires, during the chaos or while settling.
        await fired.wait()
        c.fault("database cut", detail=kind)
        c.injected["database cut"] += 1
        c.note(f"database: a statement cut {kind}")

    c.watchers.append(asyncio.create_task(count()))
    return True


def cut_partner(c: Chaos) -> bool:
    """The partner's SFTP connections closed at the next write (mid-upload) or around the next rename (before it,
    or after it is done but not answered): armed now, counted when it fires."""
    hooks = c.h.partner.hooks
    if hooks.on_write or hooks.before_rename or hooks.after_rename:
        return False  # one armed at a time

    def disarm() -> None:
        hooks.on_write = hooks.before_rename = hooks.after_rename = None

    async def on_write(path: str, offset: int) -> None:
        fire("mid-upload")  # the temporary file is open and its bytes are on their way

    async def around_rename(old: str, new: str) -> None:
        fire(point)

    def fire(where: str) -> None:
        disarm()
        c.fault("partner cut", detail=where)
        c.h.partner.close_connections()
        c.injected["partner cut"] += 1
        c.note(f"partner: SFTP connections closed {where}")

    point = c.rng.choice(["mid-upload", "mid-upload", "before the rename", "after the rename"])
    if point == "mid-upload":
        hooks.on_write = on_write
    elif point == "before the rename":
        hooks.before_rename = around_rename
    else:
        hooks.after_rename = around_rename
    return True


def hostile_payload(c: Chaos) -> tuple[object, uuid.UUID]:
    request_id = uuid.uuid4()
    tenant = str(c.h.tenant_id)
    payloads: list[object] = [
        {"request_id": "not-a-uuid", "tenant": tenant, "operator": "mallory"},
        {"request_id": str(request_id), "tenant": tenant, "operator": "mal\x00lory"},
        {"request_id": str(request_id), "tenant": tenant, "operator": "mallory", "reason": "x" * 100_000},
        {"request_id": str(request_id), "tenant": str(uuid.uuid4()), "operator": "mallory"},  # another tenant
        {"request_id": str(request_id), "tenant": tenant, "operator": 42},
        ["not", "an", "object"],
    ]
    return c.rng.choice(payloads), request_id


async def send_hostile(c: Chaos, job_id: uuid.UUID) -> bool:
    """Whether the signal reached an open run (only then is it counted)."""
    payload, request_id = hostile_payload(c)
    try:
        await c.h.client.get_workflow_handle(export_workflow_id(job_id)).signal("cancel", payload)
    except RPCError as exc:  # the workflow closed: not delivered, not counted
        c.note(f"hostile signal to export-{job_id} refused: {exc.status.name}")
        return False
    c.hostile_ids.append(request_id)
    c.injected["hostile signal"] += 1
    c.note(f"hostile cancel signal to export-{job_id}: {str(payload)[:80]}")
    return True


HOSTILE_AIM_WITHIN = 20.0  # seconds: with about one export in flight at a time, a few looks may find none open


async def send_hostile_to_an_open_run(c: Chaos) -> None:
    """A hostile signal to an export being built or delivered (its workflow open to take a signal). A look that finds
    none, or one that ends between the look and the signal, is followed by another, for a bounded time."""
    deadline = time.monotonic() + HOSTILE_AIM_WITHIN
    while time.monotonic() < deadline:
        # Queued rows are left out: the dispatcher may not have started their workflow yet.
        open_ = [r["id"] for r in await in_flight(c) if r["status"] != "Queued"]
        if open_ and await send_hostile(c, c.rng.choice(open_)):
            return
        await asyncio.sleep(0.2)
    c.note(f"no open run took a hostile signal within {HOSTILE_AIM_WITHIN:.0f} s")


async def restart_temporal(c: Chaos) -> Fault:
    """The Temporal server stopped (SIGTERM) and started again on its database file a few seconds later."""
    assert c.temporal is not None
    down = c.rng.uniform(1.0, 3.0)
    restart = c.fault("Temporal restart", lasting=True)
    try:
        await c.temporal.stop()
        c.note(f"Temporal server stopped for {down:.1f} s")
        await asyncio.sleep(down)
        await c.temporal.start()
    finally:
        restart.end = time.time()
    c.injected["Temporal restart"] += 1
    c.note("Temporal server started again")
    return restart


OPERATOR = "chaos-operator@example.com"


def holds_expected(c: Chaos, row: dict[str, Any]) -> bool:
    """Whether the partner's final file is exactly the bytes this export built (what an operator would look at)."""
    path = c.h.partner.root / "outbound" / row["final_name"]
    if row["expected_file_sha256"] is None or not path.exists():
        return False
    data = path.read_bytes()
    expected = (row["expected_file_bytes"], bytes(row["expected_file_sha256"]))
    return (len(data), hashlib.sha256(data).digest()) == expected


async def operator_work(c: Chaos) -> None:
    """An operator at work while exports run, through the client as the `exports` command does it: a queued
    export's destination edited; a Failed or OutcomeUnknown original replaced; an OutcomeUnknown export reconciled
    from the partner's file; or reconciled Failed too early and then corrected to Completed. Each outcome it writes
    is true at the partner, so the invariants hold the operator to the files too. Counted when it took effect."""
    rows = [dict(r) for r in await c.h.db.admin.fetch(
        "SELECT id, status, failure_reason, version, attempt_id, destination_id, final_name, expected_file_bytes, "
        "expected_file_sha256, replaces_job_id FROM export_jobs WHERE id = ANY($1::uuid[])", c.jobs)]
    originals = [r for r in rows if r["id"] not in c.operated and r["replaces_job_id"] is None]
    choices: dict[str, list[dict[str, Any]]] = {
        "edit": [r for r in rows if r["status"] == Status.QUEUED],
        "replace": [r for r in originals if r["status"] == Status.OUTCOME_UNKNOWN or (
            r["status"] == Status.FAILED and r["failure_reason"] in (FailureCode.NOT_DELIVERED,
                                                                     FailureCode.ATTEMPTS_EXHAUSTED))],
        "reconcile": [r for r in originals if r["status"] == Status.OUTCOME_UNKNOWN and holds_expected(c, r)],
    }
    choices["reconcile, then correct"] = choices["reconcile"]
    action = c.rng.choice([a for a, candidates in choices.items() if candidates] or [None])
    if action is None:
        return
    row = c.rng.choice(choices[action])
    job_id, tenant = row["id"], c.h.tenant_id
    try:
        if action == "edit":
            target = c.other_destination if row["destination_id"] == c.h.destination_id else c.h.destination_id
            done = await c.h.exports.edit(tenant_id=tenant, job_id=job_id, expected_version=row["version"],
                                          destination_id=target)
        elif action == "replace":
            c.operated.add(job_id)
            replacement = await c.h.exports.replace(tenant_id=tenant, original_job_id=job_id,
                                                    created_by=OPERATOR, reason="chaos: deliver it again")
            c.jobs.append(replacement)
            action, done = f"replace ({row['status']})", True
            c.note(f"operator: replaced {job_id} ({row['status']}) by {replacement}")
        elif action == "reconcile":
            c.operated.add(job_id)
            done = await c.h.exports.reconcile(tenant_id=tenant, job_id=job_id, attempt_id=row["attempt_id"],
                                               outcome=Status.COMPLETED, reconciled_by=OPERATOR,
                                               evidence="chaos: the partner holds the expected bytes")
        else:
            c.operated.add(job_id)
            done = await c.h.exports.reconcile(tenant_id=tenant, job_id=job_id, attempt_id=row["attempt_id"],
                                               outcome=Status.FAILED, reconciled_by=OPERATOR,
                                               evidence="chaos: the partner did not answer; taken as not delivered")
            if done:
                await asyncio.sleep(c.rng.uniform(0.5, 3.0))
                done = await c.h.exports.correct(
                    tenant_id=tenant, job_id=job_id, attempt_id=row["attempt_id"], recorded=Status.FAILED,
                    corrected=Status.COMPLETED, failure_reason=None, corrected_by=OPERATOR,
                    evidence_ref="chaos: partner listing", why="the file was there after all")
    except Exception as exc:  # noqa: BLE001 - an operator's refused command changes nothing; the invariants decide
        c.note(f"operator: {action} of {job_id} refused: {type(exc).__name__}: {exc}")
        return
    c.note(f"operator: {action} of {job_id}: {'done' if done else 'nothing to do (it moved on)'}")
    if done:
        c.injected["operator work"] += 1
        c.operations[action] += 1


async def recovery_loop(c: Chaos, settings, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            report = await asyncio.wait_for(run_recovery(c.h.client, settings), timeout=30)
            c.recoveries += 1
            for t in report.taken_over:
                if t.recorded:
                    c.recorded[t.recorded] += 1
                    c.note(f"recovery: {t.recorded} {t.job_id} {t.detail}")
        except Exception as exc:  # noqa: BLE001 - counted and printed; the invariants decide
            c.recovery_errors.append(f"{type(exc).__name__}: {exc}")
        try:
            await asyncio.wait_for(stop.wait(), timeout=c.rng.uniform(0.7, 1.3) * RECOVERY_EVERY)
        except TimeoutError:
            pass


async def chaos_window(c: Chaos) -> None:
    rng = c.rng
    create_gap = CREATE_WITHIN / EXPORTS
    next_create = 0.0
    start = time.monotonic()
    # Temporal restarts at fixed random moments in the middle of the window (one at a time).
    restarts = sorted(rng.uniform(0.3, 0.7) * CHAOS_SECONDS for _ in range(PROFILE.minimum["Temporal restart"]))
    created = 0

    def short() -> list[str]:
        return [k for k, n in PROFILE.minimum.items() if c.injected[k] < n and k != "Temporal restart"]

    # The window is extended (to twice its length at most) while a class is short of its minimum: on a loaded
    # machine uploads come slower, and a partner cut fires only on one (8 of 10 by half a window more, seen in CI).
    while (now := time.monotonic() - start) < CHAOS_SECONDS or (now < 2 * CHAOS_SECONDS and short()):
        if restarts and now >= restarts[0]:
            restarts.pop(0)
            await restart_temporal(c)
            continue
        # A partner cut fires only on an upload: while the extension waits for cuts, it goes on creating exports
        # for them to land on (an armed cut would otherwise wait for uploads that never come).
        wants_uploads = now >= CHAOS_SECONDS and c.injected["partner cut"] < PROFILE.minimum["partner cut"]
        if (created < EXPORTS or wants_uploads) and now >= next_create:
            job_id = await c.h.create()
            c.jobs.append(job_id)
            created += 1
            c.note(f"created {job_id}")
            next_create = now + rng.uniform(0.3, 1.7) * create_gap
        if c.jobs:
            # Each class is owed its minimum over the window: the further behind its share, the likelier it goes.
            owed = {k: PROFILE.minimum[k] * 1.2 * min(1.0, now / (CHAOS_SECONDS * 0.6)) - c.injected[k]
                    for k in PROFILE.minimum}
            random_kinds = [k for k in PROFILE.minimum if k != "Temporal restart"]
            behind = [k for k, v in owed.items() if v > 0 and k in random_kinds] if now < CHAOS_SECONDS else short()
            kind = rng.choice(behind) if behind and rng.random() < 0.8 else rng.choice(
                random_kinds + ["temporal cancel"])
            if kind == "cancel":
                call = CancelCall(job_id=rng.choice(c.jobs), request_id=uuid.uuid4(), twice=rng.random() < 0.4,
                                  concurrent=rng.random() < 0.5)
                c.cancels.append(call)
                c.injected["cancel"] += 1
                c.note(f"cancel {call.job_id} request {call.request_id} twice={call.twice} "
                       f"concurrent={call.concurrent}")
                c.tasks.append(asyncio.create_task(do_cancel(c, call)))
            elif kind == "temporal cancel":
                c.tasks.append(asyncio.create_task(do_temporal_cancel(c, rng.choice(c.jobs))))
            elif kind == "worker crash":
                c.tasks.append(asyncio.create_task(kill_one(c)))
            elif kind == "worker pause":
                await pause_one(c)
            elif kind == "database cut":
                cut_database(c)
            elif kind == "partner cut":
                cut_partner(c)
            elif kind == "operator work":
                c.tasks.append(asyncio.create_task(operator_work(c)))
            elif kind == "hostile signal":
                # To a recent export, whose workflow is likely still open to take a signal.
                c.tasks.append(asyncio.create_task(send_hostile(c, rng.choice(c.jobs[-8:]))))
        await asyncio.sleep(rng.uniform(0.15, 0.45))


# --- the transient profile -------------------------------------------------------------------------------------------

TRANSIENT_FAULTS = ("worker crash", "worker pause", "database cut", "partner cut", "Temporal restart")
EARLY_BUILD = 0.5  # seconds: a build started this recently is far from cutoff 2 (a build takes about 0.9 s here)
# The transient profile's faults whose aim may miss: a partner cut is armed on a read of the rows, and an export
# read before its rename fence may pass it before the cut comes; more than this, and the profile fails.
MISSED_AIMS = 1


def landed_past_the_fence(fault: Fault, events: list[dict[str, Any]], attempt_id: uuid.UUID | None) -> bool:
    """Whether the attempt passed its rename fence (its "step rename" record) before the fault began."""
    fences = [e["recorded_at"].timestamp() for e in events if e["attempt_id"] == attempt_id
              and e["kind"] == "DeliveryEvidence" and evidence_step(e.get("detail")) == "rename"]
    return bool(fences) and min(fences) <= fault.start


RENAME_QUIET = 0.5  # seconds since the partner's last rename: its attempt has taken its receipt and hung up


IN_FLIGHT = (
    "SELECT j.id, j.status, j.claimed_by, "
    "       EXTRACT(EPOCH FROM clock_timestamp() - (SELECT max(e.recorded_at) FROM export_attempt_events e "
    "           WHERE e.job_id = j.id AND e.attempt_id = j.attempt_id AND e.kind = 'BuildStarted'))::float8 "
    "           AS build_age, "
    "       (SELECT e.detail FROM export_attempt_events e WHERE e.job_id = j.id AND e.attempt_id = j.attempt_id "
    "           AND e.kind = 'DeliveryEvidence' ORDER BY e.id DESC LIMIT 1) AS evidence "
    "FROM export_jobs j WHERE j.id = ANY($1::uuid[]) AND j.status IN ('Queued', 'Running', 'Delivering')")


async def in_flight(c: Chaos) -> list[dict[str, Any]]:
    """The exports not settled: status, the pid of the worker holding the attempt, how long ago its build started,
    and the step of its latest delivery evidence."""
    async with c.admin_lock:  # the scheduler and the partner's hook ask at once, on one connection
        rows = await c.h.db.admin.fetch(IN_FLIGHT, c.jobs)
    return [dict(r, pid=worker_pid(r["claimed_by"]), step=parse(r["evidence"]).get("step")) for r in rows]


def far_from_cutoff_2(row: dict[str, Any]) -> bool:
    """Queued, or Running with its build not started or just started: no authorization can be under way."""
    return row["status"] == "Queued" or (row["status"] == "Running" and (
        row["build_age"] is None or row["build_age"] < EARLY_BUILD))


def expose(c: Chaos, fault: Fault, rows: list[dict[str, Any]]) -> None:
    for row in rows:
        c.exposed[row["id"]] = fault
    fault.detail = (fault.detail + "; " if fault.detail else "") + f"touches {len(rows)} export(s)"


async def place_fault(c: Chaos, kind: str) -> bool:
    """Injects a fault of this class if it can be aimed now: it touches at least one export, none that saw a fault
    already, and none at its point of no return (for a worker: an attempt that may be authorizing or delivering,
    whose lapse recovery can only resolve as unknown; for Temporal: an authorized delivery not started yet, which
    needs Temporal to start; for the partner: a rename, decided in the armed hook). Whether it was."""
    rows = await in_flight(c)
    fresh = [r for r in rows if r["id"] not in c.exposed]
    if kind in ("worker crash", "worker pause"):
        aims = []
        for w in c.running():
            mine = [r for r in rows if r["pid"] == w.process.pid]
            if mine and all(r in fresh and far_from_cutoff_2(r) for r in mine):
                aims.append((w, mine))
        if not aims or (kind == "worker pause" and len(c.running()) < 2):
            return False
        victim, mine = c.rng.choice(aims)
        fault = await (kill_one(c, victim=victim) if kind == "worker crash" else pause_one(c, victim=victim))
        if fault is not None:
            expose(c, fault, mine)
        return fault is not None
    if kind == "database cut":  # every worker connection: the exports being built or delivered
        active = [r for r in rows if r["status"] != "Queued"]
        if not active or not all(r in fresh for r in active) or c.proxy is None or not c.proxy.open_connections:
            return False
        c.proxy.cut_all()
        fault = c.fault("database cut", detail="all")
        c.injected["database cut"] += 1
        c.note("database: every worker connection cut")
        expose(c, fault, active)
        return True
    if kind == "Temporal restart":
        if not rows or len(fresh) < len(rows) or not all(
                far_from_cutoff_2(r) or (r["status"] == "Delivering" and r["step"] is not None) for r in rows):
            return False
        expose(c, await restart_temporal(c), rows)
        return True
    arm_partner_cut(c)
    return True


def arm_partner_cut(c: Chaos) -> None:
    """The partner's SFTP connections closed at a write (mid-upload), at the first one where no delivery that saw a
    fault is connected and none is renaming (its latest evidence is the rename it is sending, or the partner has
    just carried one out): every connected delivery is touched, before its rename, which it tries again."""
    hooks = c.h.partner.hooks

    async def on_write(path: str, offset: int) -> None:
        if hooks.on_write is not on_write:
            return
        try:
            delivering = [r for r in await in_flight(c) if r["status"] == "Delivering"]
        except Exception as exc:  # noqa: BLE001 - the partner's write must not fail for the test's own reading
            c.note(f"partner cut: could not read the exports in flight ({type(exc).__name__}: {exc}); not now")
            return
        if (hooks.on_write is not on_write or any(r["id"] in c.exposed or r["step"] == "rename" for r in delivering)
                or time.monotonic() - c.renamed_at < RENAME_QUIET):
            return
        hooks.on_write = None
        c.partner_armed = False
        fault = c.fault("partner cut", detail="mid-upload")
        c.h.partner.close_connections()
        c.injected["partner cut"] += 1
        c.note(f"partner: SFTP connections closed mid-upload ({len(delivering)} delivering)")
        expose(c, fault, delivering)

    hooks.on_write = on_write
    c.partner_armed = True


async def transient_window(c: Chaos) -> None:
    """The transient profile's window: exports created at a steady pace; the profile's faults one at a time, in a
    seeded order, each placed (`place_fault`) where it touches only exports that saw no fault, none at its point of
    no return; a few cancels and hostile signals (no faults: an operator's wishes and noise)."""
    rng = c.rng
    hooks = c.h.partner.hooks

    async def renamed(old: str, new: str) -> None:
        c.renamed_at = time.monotonic()

    hooks.after_rename = renamed
    plan = [k for k in TRANSIENT_FAULTS for _ in range(PROFILE.minimum.get(k, 0))]
    rng.shuffle(plan)
    plan.sort(key=lambda k: k != "Temporal restart")  # first: with few exports in flight it finds its moment
    fault_gap = 0.4 * CREATE_WITHIN / max(1, len(plan))
    others = [k for k in ("cancel", "hostile signal") for _ in range(PROFILE.minimum.get(k, 0))]
    rng.shuffle(others)
    other_gap = CREATE_WITHIN / (len(others) + 1)
    next_create, next_other, next_fault, created = 0.0, other_gap, 2.0, 0
    waiting_since: float | None = None
    start = time.monotonic()
    try:
        # Extended (by half at most) while a fault is still to be placed and some export is there to aim it at.
        while (now := time.monotonic() - start) < CHAOS_SECONDS or (
                (plan or c.partner_armed) and now < 1.5 * CHAOS_SECONDS and await in_flight(c)):
            if created < EXPORTS and now >= next_create:
                job_id = await c.h.create()
                c.jobs.append(job_id)
                created += 1
                c.note(f"created {job_id}")
                next_create = now + rng.uniform(0.5, 1.5) * CREATE_WITHIN / EXPORTS
            if others and c.jobs and now >= next_other:
                next_other = now + other_gap
                if others.pop() == "cancel":
                    call = CancelCall(job_id=rng.choice(c.jobs), request_id=uuid.uuid4(), twice=rng.random() < 0.4,
                                      concurrent=rng.random() < 0.5)
                    c.cancels.append(call)
                    c.injected["cancel"] += 1
                    c.note(f"cancel {call.job_id} request {call.request_id}")
                    c.tasks.append(asyncio.create_task(do_cancel(c, call)))
                else:
                    c.tasks.append(asyncio.create_task(send_hostile_to_an_open_run(c)))
            if plan and not c.partner_armed and now >= next_fault:
                waiting_since = now if waiting_since is None else waiting_since
                if await place_fault(c, plan[0]):
                    plan.pop(0)
                    waiting_since = None
                    next_fault = time.monotonic() - start + rng.uniform(0.7, 1.3) * fault_gap
                elif now - waiting_since > 3.0:  # no place for it lately: the next class first
                    rows = await in_flight(c)
                    c.note(f"no place for a {plan[0]} for 3 s: in flight {Counter(r['status'] for r in rows)}, "
                           f"{sum(r['id'] in c.exposed for r in rows)} of them after a fault; "
                           f"{len(c.running())} workers running")
                    plan.append(plan.pop(0))
                    waiting_since = None
            await asyncio.sleep(0.1)
    finally:
        hooks.on_write = hooks.after_rename = None
        c.partner_armed = False


# --- reading the outcome ---------------------------------------------------------------------------------------------


async def unsettled(c: Chaos) -> list[uuid.UUID]:
    rows = await c.h.db.admin.fetch("SELECT id, status FROM export_jobs WHERE id = ANY($1::uuid[])", c.jobs)
    return [r["id"] for r in rows if not Status(r["status"]).is_settled]


async def settle(c: Chaos) -> tuple[float, list[str]]:
    """Stop the chaos: keep one healthy worker (start one if none is alive), recovery keeps running. How long it
    took, and what did not settle (with the workflow's last events: enough to say where it waits)."""
    began = time.monotonic()
    while PROFILE.transient and time.monotonic() - began < SETTLE_SECONDS and await unsettled(c):
        await asyncio.sleep(0.5)  # no fault after the window: the workers that run finish what they hold
    alive = c.alive()
    keep = alive[-1] if alive else await c.start_worker()
    for w in c.alive():
        if w is not keep:
            c.fault("worker crash", pid=w.process.pid, detail="to leave one worker")
            w.kill()
            await w.process.wait()
            c.final_kills += 1
    await forget_sticky(c)
    started = time.monotonic()
    while time.monotonic() - started < SETTLE_SECONDS:
        if keep.process.returncode is not None:  # the healthy worker must not die on its own
            raise AssertionError(f"the healthy worker exited with {keep.process.returncode}; see {keep.log_path}")
        if not await unsettled(c):
            return time.monotonic() - began, []
        await asyncio.sleep(0.5)
    rest = await unsettled(c)
    rows = await c.h.db.admin.fetch("SELECT id, status, attempt_count, lease_expires_at FROM export_jobs "
                                    "WHERE id = ANY($1::uuid[])", rest)
    problems = []
    for row in rows:
        try:
            tail = await asyncio.wait_for(history_tail(c, row["id"]), timeout=10)
        except Exception as exc:  # noqa: BLE001 - no history is an answer too
            tail = [f"{type(exc).__name__}: {exc}"]
        outbox = [dict(r) for r in await c.h.db.admin.fetch(
            "SELECT kind, created_at, published_at FROM outbox WHERE job_id = $1", row["id"])]
        problems.append(f"export {row['id']} not settled within {SETTLE_SECONDS:.0f} s: {dict(row)} | outbox "
                        f"{outbox} | history tail {tail}")
    return time.monotonic() - began, problems


# Each invariant the run checks, by the name its violations carry; the report says pass or its first violations.
INVARIANTS = {
    "fault minimums": "each fault class reached its profile's minimum",
    "settled": "every export has its row, settled (OutcomeUnknown included)",
    "partner files": "Completed files are the expected bytes; no file for an export that ended without one; at "
                     "most one Completed and one rename per final name; no file of no export",
    "attempts": "each attempt's events a sequence the statements write, within the cap; one terminal event per "
                "attempt; every authorization but the last taken back before its rename fence; one renamer",
    "cancellations": "one record and one agreeing answer per request ID; each recorded outcome holds; the "
                     "attempt a stop found never authorized",
    "hostile signals": "no hostile signal recorded",
    "workflows": "every workflow returned its row's status",
    "search attributes": "the latest run's ExportStatus equals the row's status",
    "outbox": "every outbox row published",
    "leftovers": "partner temporary files and built files gone within their bounds",
    "attribution": "every outcome that needs a person (OutcomeUnknown, Failed but OriginalDelivered) caused by an "
                   "injected fault that touched its last attempt",
    "confirmations": "of the exports that were to deliver, the profile's share confirmed Completed by the system",
}
if PROFILE.transient:
    INVARIANTS["transient"] = ("every export not canceled or stopped ended Completed, confirmed by the system (each "
                               "saw at most one fault, none at its point of no return)")
Violation = tuple[str, str]  # (invariant, what was found)


# An attempt's events, one letter each (evidence aside), and the sequences the statements can write: claimed;
# builds started; then requeued, stopped or failed, or authorized once and finished once (by the worker or by
# recovery), then perhaps reconciled; a Completed or Failed perhaps corrected once; or authorized and taken back by
# recovery (requeued, or exhausted at the cap) before it passed its rename fence (migration 0010).
LETTER = {"Claimed": "C", "BuildStarted": "B", "RequeuedByRecovery": "Q", "Stopped": "S", "StoppedByRecovery": "S",
          "Failed": "F", "AttemptsExhausted": "F", "DeliveryAuthorized": "A", "Finished": "E",
          "ResolvedByRecovery": "E", "Reconciled": "R", "Corrected": "X"}
ATTEMPT = re.compile(r"CB*(?:Q|S|FX?)|CB+AER?X?|CB+A(?:Q|F)")
TAKEN_BACK = re.compile(r"CB+A(?:Q|F)")
ENDS = {"Q": {Status.QUEUED}, "S": {Status.STOPPED}, "F": {Status.FAILED}, "E": {Status.COMPLETED, Status.FAILED,
        Status.OUTCOME_UNKNOWN}, "R": {Status.COMPLETED, Status.FAILED}, "X": {Status.COMPLETED, Status.FAILED}}


def sequence_problems(events: list[dict[str, Any]], row: dict[str, Any], max_attempts: int,
                      max_hand_backs: int = 10, max_shared_losses: int = 10,
                      max_losses_amid_others: int = 30) -> list[str]:
    """What is wrong with an export's events as a history of its attempts: each attempt's sequence is one the
    statements can write, every attempt but the row's current one was requeued, the last one ends in the row's
    status, and no more attempts than the cap."""
    attempts: dict[uuid.UUID, str] = {}
    for e in events:
        if e["kind"] != "DeliveryEvidence":
            attempts[e["attempt_id"]] = attempts.get(e["attempt_id"], "") + LETTER[e["kind"]]
    problems = [f"attempt {str(a)[:8]}: events {seq} are not a sequence the statements write"
                for a, seq in attempts.items() if not ATTEMPT.fullmatch(seq)]
    renamed = {e["attempt_id"] for e in events if e["kind"] == "DeliveryEvidence"
               and parse(e["detail"]).get("step") == "rename"}
    problems += [f"attempt {str(a)[:8]} ({seq}) was taken back after it passed its rename fence"
                 for a, seq in attempts.items() if TAKEN_BACK.fullmatch(seq) and a in renamed]
    kept = [a for a, seq in attempts.items() if "A" in seq and not TAKEN_BACK.fullmatch(seq)]
    if len(kept) > 1:
        problems.append(f"{len(kept)} authorized attempts not taken back: {[str(a)[:8] for a in kept]}")
    status, current = Status(row["status"]), row["attempt_id"]
    for attempt, seq in attempts.items():
        if attempt != current and not seq.endswith("Q"):
            problems.append(f"attempt {str(attempt)[:8]} ({seq}) is not the row's attempt but was not requeued")
    if current is not None and status not in ENDS.get(attempts.get(current, "?")[-1:], set()):
        problems.append(f"the row is {status} but its attempt's events are {attempts.get(current)}")
    if current is None and status not in (Status.CANCELED, Status.REJECTED, Status.QUEUED):
        problems.append(f"the row is {status} without an attempt")
    # The cap counts the attempts lost alone; those lost with their worker or amid other workers' losses
    # (recovery's event says so) and those their worker handed back before the rename have caps of their own.
    handed_back = row.get("handed_back_count", 0)
    taken_back = [e.get("detail") for e in events if e["kind"] == "RequeuedByRecovery"]
    with_worker, amid = taken_back.count("lost with its worker"), taken_back.count(LOST_AMID_OTHERS)
    if len(attempts) > max_attempts + handed_back + with_worker + amid or len(attempts) != row["attempt_count"]:
        problems.append(f"{len(attempts)} attempts with events, the row counts {row['attempt_count']} "
                        f"(cap {max_attempts}, and {handed_back} handed back, {with_worker} lost with their worker, "
                        f"{amid} amid other workers' losses)")
    if handed_back > max_hand_backs:
        problems.append(f"{handed_back} attempts handed back, over the cap of {max_hand_backs}")
    if with_worker >= max_shared_losses:
        problems.append(f"{with_worker} attempts lost with their worker and requeued, at or over the cap of "
                        f"{max_shared_losses}")
    if amid >= max_losses_amid_others:
        problems.append(f"{amid} attempts lost amid other workers' losses and requeued, at or over the cap of "
                        f"{max_losses_amid_others}")
    return problems


def is_temporal_cancel(record: dict[str, Any]) -> bool:
    return record["requested_by"].startswith(TEMPORAL_CANCEL_OPERATOR)


def parse(detail: str | None) -> dict[str, Any]:
    try:
        value = json.loads(detail or "")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


async def check_invariants(c: Chaos) -> tuple[list[Violation], list[str], dict[str, Any]]:
    """Violations, observations worth reporting, and the rows by ID."""
    admin = c.h.db.admin
    violations: list[Violation] = []
    notes: list[str] = []

    def fail(invariant: str, text: str) -> None:
        violations.append((invariant, text))

    rows = {r["id"]: dict(r) for r in await admin.fetch(
        "SELECT * FROM export_jobs WHERE tenant_id = $1", c.h.tenant_id)}
    if set(rows) != set(c.jobs):
        fail("settled", f"rows {len(rows)} do not match the {len(c.jobs)} exports created")
    events: dict[uuid.UUID, list[dict[str, Any]]] = defaultdict(list)
    for e in await admin.fetch("SELECT job_id, attempt_id, kind, worker_id, observed_by, detail "
                               "FROM export_attempt_events ORDER BY id"):
        events[e["job_id"]].append(dict(e))
    requests = [dict(r) for r in await admin.fetch("SELECT * FROM cancellation_requests")]
    requests_by_job: dict[uuid.UUID, list[dict[str, Any]]] = defaultdict(list)
    for r in requests:
        requests_by_job[r["job_id"]].append(r)

    outbound = c.h.partner.root / "outbound"
    temp = c.h.partner.root / "incoming-tmp"
    out_files = {p.name for p in outbound.iterdir()}
    temp_files = sorted(p.name for p in temp.iterdir())

    def ev(job_id: uuid.UUID, invariant: str, msg: str) -> None:
        """A violation about one export, with its events and cancellation records."""
        kinds = [f"{e['kind']}@{str(e['attempt_id'])[:8]}" for e in events[job_id]
                 if e["kind"] != "DeliveryEvidence"]
        fail(invariant, f"export {job_id}: {msg} | events {kinds} | requests "
                        f"{[(r['outcome'], r['found_status'], r['requested_by']) for r in requests_by_job[job_id]]}")

    for job_id, row in rows.items():
        status = Status(row["status"])
        failure = FailureCode(row["failure_reason"]) if row["failure_reason"] else None
        final = row["final_name"]
        evts = events[job_id]
        by_kind = Counter(e["kind"] for e in evts)

        # Files at the partner.
        if status is Status.COMPLETED:
            if final not in out_files:
                ev(job_id, "partner files", f"Completed but {final} is not at the partner")
            elif not holds_expected(c, row):
                ev(job_id, "partner files", f"Completed but {final} differs from the expected file")
        elif status is Status.OUTCOME_UNKNOWN:
            notes.append(f"OutcomeUnknown {job_id}: final file {'present' if final in out_files else 'absent'}")
        if not status.is_settled:
            ev(job_id, "settled", f"still {status}")

        for problem in sequence_problems(evts, row, c.h.settings.max_attempts, c.h.settings.max_hand_backs,
                                         c.h.settings.max_shared_losses, c.h.settings.max_losses_amid_others):
            ev(job_id, "attempts", problem)

        # Never a second rename (an attempt taken back may have uploaded to its temporary name); one terminal per
        # attempt.
        renamers = {e["observed_by"] for e in evts if e["kind"] == "DeliveryEvidence"
                    and parse(e["detail"]).get("step") == "rename"}
        if len(renamers) > 1:
            ev(job_id, "attempts", f"renames by more than one attempt/worker: {sorted(renamers)}")
        per_attempt = Counter(e["attempt_id"] for e in evts if e["kind"] in ("Finished", "ResolvedByRecovery"))
        for attempt, n in per_attempt.items():
            if n > 1:
                ev(job_id, "attempts", f"attempt {attempt} has {n} Finished/ResolvedByRecovery events")
        authorized = by_kind["DeliveryAuthorized"] > 0
        authorized_attempts = {e["attempt_id"] for e in evts if e["kind"] == "DeliveryAuthorized"}
        if status in (Status.COMPLETED, Status.OUTCOME_UNKNOWN) and not authorized:
            ev(job_id, "attempts", f"{status} without DeliveryAuthorized")
        if status is Status.OUTCOME_UNKNOWN:
            explained = [e for e in evts if e["attempt_id"] == row["attempt_id"]
                         and e["kind"] in ("Finished", "ResolvedByRecovery")]
            if not explained:
                ev(job_id, "attempts", "OutcomeUnknown without Finished or ResolvedByRecovery for its attempt")

        # Cancellation requests against this job, as recorded under the row lock.
        for r in requests_by_job[job_id]:
            outcome = CancellationOutcome(r["outcome"])
            if outcome is CancellationOutcome.CANCELED_WHILE_QUEUED and status is not Status.CANCELED:
                ev(job_id, "cancellations", f"CanceledWhileQueued recorded, but the export ended {status}")
            if outcome in STOP_OUTCOMES:
                if r["found_attempt_id"] in authorized_attempts:
                    ev(job_id, "cancellations", f"{outcome} recorded, yet the attempt it found was authorized")
                elif status is not Status.STOPPED:
                    ev(job_id, "cancellations",
                       f"{outcome} recorded, never authorized, but the export ended {status}/{failure}")
            if outcome is CancellationOutcome.TOO_LATE and not authorized:
                ev(job_id, "cancellations", "TooLate recorded, but no DeliveryAuthorized event")
        if status is Status.CANCELED and not any(
                r["outcome"] == CancellationOutcome.CANCELED_WHILE_QUEUED for r in requests_by_job[job_id]):
            ev(job_id, "cancellations", "Canceled without a CanceledWhileQueued request")
        if status is Status.STOPPED and not row["stop_request_id"]:
            ev(job_id, "cancellations", "Stopped without a stop request")

    # A final name is shared only by an original and its replacements. Its file may be at the partner only if one
    # of them is Completed or OutcomeUnknown (a replacement that found its original's file ended OriginalDelivered),
    # at most one is Completed, and at most one attempt renamed onto it (no overwrite agreements here).
    sharing: dict[str, list[uuid.UUID]] = defaultdict(list)
    for job_id, row in rows.items():
        sharing[row["final_name"]].append(job_id)
    for final, members in sharing.items():
        statuses = {Status(rows[j]["status"]) for j in members}
        if final in out_files and not statuses & {Status.COMPLETED, Status.OUTCOME_UNKNOWN}:
            for j in members:
                ev(j, "partner files", f"{rows[j]['status']}/{rows[j]['failure_reason']} but {final} is at the partner")
        completed = [j for j in members if rows[j]["status"] == Status.COMPLETED]
        if len(completed) > 1:
            ev(completed[0], "partner files", f"{final} is Completed by {len(completed)} exports: {completed}")
        renamed = {(e["job_id"], e["attempt_id"]) for j in members for e in events[j]
                   if e["kind"] == "DeliveryEvidence" and parse(e["detail"]).get("step") == "receipt"
                   and (parse(e["detail"]).get("final") or {}).get("exists")}
        if len(renamed) > 1:
            ev(members[0], "partner files",
               f"{final} was written by {len(renamed)} attempts: {sorted(map(str, renamed))}")

    # Each request ID this test submitted has exactly one record, and both submissions of one click agree.
    counts = Counter(r["id"] for r in requests)
    for call in c.cancels:
        if call.error:
            notes.append(f"cancel {call.request_id} on {call.job_id}: client error {call.error}")
        if counts[call.request_id] != 1:
            fail("cancellations", f"cancel request {call.request_id} on {call.job_id}: {counts[call.request_id]} "
                              f"records (answers {[a.outcome for a in call.answers]}, error {call.error})")
        outcomes = {a.outcome for a in call.answers}
        if len(outcomes) > 1:
            fail("cancellations", f"cancel request {call.request_id}: submissions answered differently: {outcomes}")
        recorded = [r for r in requests if r["id"] == call.request_id]
        if recorded and outcomes and outcomes != {CancellationOutcome(recorded[0]["outcome"])}:
            fail("cancellations", f"cancel request {call.request_id}: answered {outcomes}, recorded "
                              f"{recorded[0]['outcome']}")
    # A Temporal cancel becomes one stop request per run (its ID derived from the run), however often it is sent;
    # one sent while the row still needed an attempt is recorded.
    for job_id in dict.fromkeys(j for j, _ in c.temporal_cancels):
        before = [b for j, b in c.temporal_cancels if j == job_id]
        mine = [r for r in requests_by_job[job_id] if is_temporal_cancel(r)]
        notes.append(f"Temporal cancel x{len(before)} of {job_id} (row before: {[str(b) for b in before]}): "
                     f"export {rows[job_id]['status']}, records {[(r['outcome'], r['found_status']) for r in mine]}")
        if len(mine) > 1:
            ev(job_id, "cancellations", f"Temporal cancel: {len(mine)} records for one run")
        if len(mine) != 1 and any(b is not None and not b.is_settled for b in before):
            ev(job_id, "cancellations", f"Temporal cancel accepted while the row was {before}, but {len(mine)} records")
    for rid, n in counts.items():
        if n != 1:
            fail("cancellations", f"request {rid} has {n} records")

    # Files at the partner that belong to no export, and leftovers in the temporary folder.
    known = {row["final_name"] for row in rows.values()}
    for name in sorted(out_files - known):
        fail("partner files", f"unexpected file at the partner: {name}")
    # A temporary file is left only by an upload that was interrupted (its worker died or was taken over) or
    # whose rename went unanswered (touching anything after it could take the delivered file back).
    job_of = {(rows[j]["final_name"], str(e["attempt_id"])): j for j in rows for e in events[j]}
    for name in temp_files:
        # .<final name>.<attempt>.part
        final, _, attempt = name.removeprefix(".").removesuffix(".part").rpartition(".")
        job_id = job_of.get((final, attempt))
        if job_id is None:
            fail("leftovers", f"temporary file of no known attempt: {name}")
            continue
        mine = [e for e in events[job_id] if str(e["attempt_id"]) == attempt]
        kinds = [e["kind"] for e in mine if e["kind"] != "DeliveryEvidence"]
        interrupted = "DeliveryAuthorized" in kinds and "Finished" not in kinds
        left_on_purpose = any(parse(e["detail"]).get("temp_left") for e in mine if e["kind"] == "DeliveryEvidence")
        notes.append(f"temporary file {name}: export {job_id} {rows[job_id]['status']}, attempt events {kinds}"
                     + (", left after an unanswered rename" if left_on_purpose else ""))
        if not interrupted and not left_on_purpose:
            ev(job_id, "leftovers", f"temporary file {name} left by an attempt whose delivery was not interrupted")

    # Hostile signals changed nothing: none of their request IDs was recorded.
    recorded_ids = {r["id"] for r in requests}
    for request_id in c.hostile_ids:
        if request_id in recorded_ids:
            fail("hostile signals", f"hostile cancel signal {request_id} was recorded")
    # Each fault class reached its minimum: a quiet run proves nothing.
    for kind, minimum in PROFILE.minimum.items():
        if c.injected[kind] < minimum:
            fail("fault minimums", f"fault class {kind!r}: {c.injected[kind]} injected, the profile needs {minimum}")

    # Every workflow closed, with the row's status as its result.
    async def result_of(job_id):
        handle = c.h.client.get_workflow_handle(export_workflow_id(job_id), result_type=ExportResult)
        return await asyncio.wait_for(handle.result(), timeout=RESULT_SECONDS)

    results = await asyncio.gather(*(result_of(j) for j in rows), return_exceptions=True)
    for job_id, result in zip(rows, results, strict=True):
        row = rows[job_id]
        if isinstance(result, BaseException):
            causes, cause = [], result
            while cause is not None:
                causes.append(f"{type(cause).__name__}: {cause}")
                cause = cause.__cause__ or getattr(cause, "cause", None)
            ev(job_id, "workflows", f"workflow did not return: {' <- '.join(causes)} | history tail: "
                       f"{await history_tail(c, job_id)}")
        elif (result.status.value, result.failure_reason) != (
                row["status"], FailureCode(row["failure_reason"]) if row["failure_reason"] else None):
            ev(job_id, "workflows", f"workflow returned {result.status}/{result.failure_reason}, row {row['status']}/"
                       f"{row['failure_reason']}")
    # What the Temporal UI filters on says what the row says (visibility lags a moment: asked again briefly).
    for _ in range(20):
        found = await export_statuses(c)
        mismatched = {j: s for j, s in found.items() if j in rows and s != rows[j]["status"]}
        missing = [j for j in rows if j not in found]
        if not mismatched and not missing:
            break
        await asyncio.sleep(0.5)
    for job_id, status in mismatched.items():
        ev(job_id, "search attributes", f"ExportStatus = {status!r}, the row says {rows[job_id]['status']!r}")
    for job_id in missing:
        ev(job_id, "search attributes", "no workflow with ExportStatus found for it")
    return violations, notes, rows


async def account_outcomes(c: Chaos, rows: dict[uuid.UUID, dict[str, Any]]) -> tuple[Accounting, list[Violation]]:
    """The outcomes that need a person, each attributed to the injected faults that caused it, and how many
    deliveries the system confirmed (tests/helpers/chaos_accounting.py); a violation for each unattributed one, and
    one when too few were confirmed."""
    events: dict[uuid.UUID, list[dict[str, Any]]] = defaultdict(list)
    for e in await c.h.db.admin.fetch("SELECT job_id, attempt_id, kind, worker_id, detail, recorded_at "
                                      "FROM export_attempt_events WHERE job_id = ANY($1::uuid[]) ORDER BY id",
                                      list(rows)):
        events[e["job_id"]].append(dict(e))
    acc = account(rows, events, c.faults, now=time.time())
    violations: list[Violation] = []
    for n in acc.unattributed:
        r = n.recorded
        window = (f"{r.claimed - c.wall0:.1f}s to {r.ended - c.wall0:.1f}s" if r.claimed and r.ended else "unknown")
        kinds = [f"{e['kind']}@{str(e['attempt_id'])[:8]}" for e in events[n.job_id] if e["kind"] != "DeliveryEvidence"]
        violations.append(("attribution", f"export {n.job_id}: {r.outcome} recorded by {r.terminal} on worker pid "
                                          f"{r.pid} (attempt {window}), and no injected fault explains it | events "
                                          f"{kinds}"))
    missed: list[uuid.UUID] = []
    if PROFILE.transient:
        causes_of = {n.job_id: n.causes for n in acc.needed}
        for job_id, r in acc.recorded.items():
            if r.outcome in NOT_TO_DELIVER or r.outcome == "Completed":
                continue
            aimed = c.exposed.get(job_id)
            if aimed is not None and landed_past_the_fence(aimed, events[job_id], r.attempt_id):
                # The aim read the export before its rename fence, and it passed the fence before the fault came
                # (the partner cut is armed on a read of the rows): a fault in its rename window after all.
                missed.append(job_id)
                c.note(f"aim missed: {aimed.describe(c.wall0)} landed past the rename fence of {job_id}, "
                       f"which ended {r.outcome}")
                continue
            near = "; ".join(f.describe(c.wall0) for f in causes_of.get(job_id, [])[:3]) or "none"
            kinds = [f"{e['kind']}@{str(e['attempt_id'])[:8]}" for e in events[job_id]
                     if e["kind"] != "DeliveryEvidence"]
            violations.append(("transient", f"export {job_id}: {r.outcome} recorded by {r.terminal} on worker pid "
                                            f"{r.pid}; the fault aimed at it: "
                                            f"{aimed.describe(c.wall0) if aimed else 'none'}; faults in its last "
                                            f"attempt's window: {near} | events {kinds}"))
    if len(missed) > MISSED_AIMS:
        violations.append(("transient", f"{len(missed)} faults landed past the rename fence they were aimed before "
                                        f"(at most {MISSED_AIMS}): the profile no longer tests what it says"))
    to_deliver = acc.to_deliver - len(missed)
    share = acc.confirmed / to_deliver if to_deliver else 1.0
    if share < PROFILE.confirmed_floor:
        violations.append(("confirmations", f"{acc.confirmed} of {to_deliver} exports to deliver confirmed "
                                            f"Completed by the system ({100 * share:.0f}%), under the "
                                            f"profile's floor of {100 * PROFILE.confirmed_floor:.0f}%; recorded: "
                                            f"{dict(acc.outcomes)}"
                                            + (f"; {len(missed)} whose fault missed its aim left out" if missed
                                               else "")))
    return acc, violations


async def leftover_problems(c: Chaos, sweep_queue: str) -> list[str]:
    """No file of a dead attempt outlives its documented bound. Built files: two scavenging intervals after every
    export settled, the running worker holds none, and a scavenger over each dead worker's folder (what a worker
    started on it again runs first) removes all the rest. Temporary files at the partner: once older than the
    destination's temp_file_max_age_seconds (their mtime set back, as days passing would), one partner sweep as its
    schedule runs it removes every one, and touches no final file."""
    problems = []
    await asyncio.sleep(2 * SCAVENGE_EVERY + 1)
    for w in c.workers:
        folder = Path(w.settings.work_dir)
        built = sorted(p.name for p in folder.glob("*.csv*")) if folder.is_dir() else []
        if w in c.alive() and built:
            problems.append(f"built files the running worker did not scavenge within {2 * SCAVENGE_EVERY} s: {built}")
        await scavenge(c.h.store, folder)
        if folder.is_dir() and (kept := sorted(p.name for p in folder.glob("*.csv*"))):
            problems.append(f"built files the scavenger keeps although every export settled: {kept}")
    outbound, temp = c.h.partner.root / "outbound", c.h.partner.root / "incoming-tmp"
    finals = {p.name: p.read_bytes() for p in outbound.iterdir()}
    max_age = await c.h.db.admin.fetchval("SELECT max(temp_file_max_age_seconds) FROM destinations")
    aged = time.time() - max_age - 3600
    for p in temp.iterdir():
        os.utime(p, (aged, aged))
    swept = await c.h.client.execute_workflow("PartnerSweepWorkflow", id=f"partner-sweep-{uuid.uuid4().hex[:8]}",
                                              task_queue=sweep_queue, result_type=list[PartnerSweepOutput],
                                              execution_timeout=timedelta(seconds=60))
    c.note("partner sweep after ageing the temporary files: "
           + "; ".join(f"{len(s.removed)} removed, {len(s.kept)} kept, {len(s.failed)} failed, error {s.error}"
                       for s in swept))
    if left := sorted(p.name for p in temp.iterdir()):
        problems.append(f"temporary files the partner sweep kept past their bound: {left}")
    if {p.name: p.read_bytes() for p in outbound.iterdir()} != finals:
        problems.append("the partner sweep changed the final folder")
    return problems


async def export_statuses(c: Chaos) -> dict[uuid.UUID, str]:
    from workflows.identity import EXPORT_STATUS

    # A reconciliation or correction after a run closed starts a new run of the workflow ID; earlier runs keep what
    # was true when they closed, and the latest run is the one that tells (as the README says).
    latest: dict[uuid.UUID, tuple[Any, str]] = {}
    async for wf in c.h.client.list_workflows(f"ExportTenant = '{c.h.tenant_id}'"):
        status = wf.typed_search_attributes.get(EXPORT_STATUS)
        job_id = uuid.UUID(wf.id.removeprefix("export-"))
        if status is not None and (job_id not in latest or wf.start_time > latest[job_id][0]):
            latest[job_id] = (wf.start_time, status)
    return {job_id: status for job_id, (_, status) in latest.items()}


async def history_tail(c: Chaos, job_id: uuid.UUID, n: int = 14) -> list[str]:
    """The last events of the export's workflow history, in brief: enough to say how a run ended."""
    from google.protobuf.json_format import MessageToDict
    from temporalio.api.enums.v1 import EventType

    history = await c.h.client.get_workflow_handle(export_workflow_id(job_id)).fetch_history()
    out = []
    for e in history.events[-n:]:
        name = EventType.Name(e.event_type).removeprefix("EVENT_TYPE_")
        attrs = MessageToDict(e)
        attrs = {k: v for k, v in attrs.items() if k.endswith("Attributes")}
        brief = json.dumps(attrs)[:400]
        out.append(f"{e.event_id} {name} {brief}")
    return out


def summary(c: Chaos, rows: dict[uuid.UUID, dict[str, Any]], requests: list[dict[str, Any]],
            durations: dict[str, float], violations: list[Violation], acc: Accounting) -> str:
    statuses = Counter(f"{r['status']}" + (f"/{r['failure_reason']}" if r["failure_reason"] else "")
                       for r in rows.values())
    outcomes = Counter(r["outcome"] for r in requests)
    lines = ["", "=" * 60, f"chaos summary (seed {durations['seed']:.0f}, profile "
                           f"{os.environ.get('EXPORTS_CHAOS_PROFILE') or 'ci'})", "-" * 60]
    lines += [f"  {status:<32} {n:>4}" for status, n in sorted(statuses.items())]
    lines += ["-" * 60,
              f"  exports created                  {len(c.jobs):>4}",
              f"    of which replacements          {sum(r['replaces_job_id'] is not None for r in rows.values()):>4}",
              f"  worker processes started         {len(c.workers):>4}",
              f"  SIGKILLs during chaos            {c.kills:>4}",
              f"  SIGKILLs to leave one worker     {c.final_kills:>4}",
              f"  client cancels (clicks)          {len(c.cancels):>4}",
              f"    of which submitted twice       {sum(x.twice for x in c.cancels):>4}",
              f"  Temporal cancels sent            {len(c.temporal_cancels):>4}",
              f"  recovery runs                    {c.recoveries:>4}",
              f"  recovery run errors              {len(c.recovery_errors):>4}"]
    lines += [f"  recovery recorded {kind:<15}{n:>4}" for kind, n in sorted(c.recorded.items())]
    lines += [f"  cancel records {o:<18}{n:>4}" for o, n in sorted(outcomes.items())]
    lines += ["-" * 60, "  fault class (profile minimum)    injected"]
    lines += [f"  {kind + f' ({minimum})':<32} {c.injected[kind]:>4}" + ("" if c.injected[kind] >= minimum
                                                                        else "  BELOW MINIMUM")
              for kind, minimum in PROFILE.minimum.items()]
    lines += [f"    operator {action:<27}{n:>4}" for action, n in sorted(c.operations.items())]
    lines += ["-" * 60] + acc.lines(PROFILE.confirmed_floor)
    lines += ["-" * 60, "  invariant                        result"]
    for invariant in INVARIANTS:
        found = [text for name, text in violations if name == invariant]
        lines.append(f"  {invariant:<32} " + (f"FAILED {len(found)}x, first: {found[0][:200]}" if found else "pass"))
    lines += ["-" * 60,
              (f"  chaos window {durations['chaos']:.1f} s, settling {durations['settle']:.1f} s, "
               f"checks {durations['check']:.1f} s, total {durations['total']:.1f} s"),
              "=" * 60]
    return "\n".join(lines)


@pytest.mark.chaos
@pytest.mark.spec("CH1", "LV8")
@pytest.mark.timeout(300 if PROFILE is PROFILES["ci"] else 3600)
async def test_chaos__kills_cancels_and_recovery_keep_every_invariant(db, store, tmp_path, request):
    seed = int(os.environ.get("EXPORTS_CHAOS_SEED") or random.SystemRandom().randrange(1, 10**6))
    print(f"\nchaos seed {seed} (replay with EXPORTS_CHAOS_SEED={seed})")
    t0 = time.monotonic()
    async with AsyncExitStack() as stack:
        # A Temporal dev server of this run's own, on a database file, so that it can be restarted mid-run.
        temporal = LocalTemporal(tmp_path / "temporal", ui_port=free_port())
        await temporal.start()
        stack.push_async_callback(temporal.stop)
        client = await Client.connect(temporal.address, data_converter=pydantic_data_converter)
        # About 36 kB per export, built and uploaded at 40 kB/s each: about 1 s of building and 1 s of uploading,
        # so builds, deliveries, kills and cancels overlap. Lease 2 s, renewed every 0.5 s.
        h = await open_harness(stack, db, store, client, tmp_path, in_process_worker=False, contacts=400,
                               lease_seconds=LEASE, renew_every_seconds=0.5, scavenge_interval_seconds=SCAVENGE_EVERY,
                               build_throttle_bytes_per_second=40_000, upload_throttle_bytes_per_second=40_000)
        c = Chaos(rng=random.Random(seed), h=h, work_root=tmp_path / "work",
                  proxy=await stack.enter_async_context(fault_proxy(db.server)), temporal=temporal)
        h.exports.reconciliation_url = db.server.urls(db.name)["reconciliation_database_url"]
        d = h.partner.destination()
        c.other_destination = await seed_destination(  # the same partner folders, under another destination
            db.admin, h.tenant_id, name="the same partner again", host=d.host, port=d.port, username=d.username,
            final_dir=d.final_dir, temp_dir=d.temp_dir, host_key=d.host_key, credential_ref=d.credential_ref)
        # Recovery runs on a worker of its own, in this process (no dispatcher, never killed), so that a killed
        # export worker cannot hold a recovery run's activity until its timeout.
        recovery_settings = h.settings.model_copy(update={"task_queue": f"{h.settings.task_queue}-recovery",
                                                          "work_dir": tmp_path / "work" / "recovery"})
        await stack.enter_async_context(running_worker(recovery_settings, client, with_dispatcher=False))
        stop_recovery = asyncio.Event()
        recovery_task = None
        try:
            for _ in range(WORKERS):
                await c.start_worker()
            recovery_task = asyncio.create_task(recovery_loop(c, recovery_settings, stop_recovery))
            chaos_started = time.monotonic()
            await (transient_window(c) if PROFILE.transient else chaos_window(c))
            await asyncio.gather(*c.tasks)
            chaos_took = time.monotonic() - chaos_started
            settle_took, not_settled = await settle(c)
            stop_recovery.set()
            await recovery_task
            check_started = time.monotonic()
            violations, notes, rows = await check_invariants(c)
            acc, accounting_violations = await account_outcomes(c, rows)
            violations += accounting_violations
            notes = acc.notes(c.wall0) + notes
            violations = [("settled", text) for text in not_settled] + violations
            violations += [("leftovers", text) for text in await leftover_problems(c, recovery_settings.task_queue)]
            # Every outbox row is published (the dispatcher may still be on its last poll).
            backlog = await db.admin.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL")
            for _ in range(40):
                if not backlog:
                    break
                await asyncio.sleep(0.25)
                backlog = await db.admin.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL")
            if backlog:
                violations.append(("outbox", f"{backlog} outbox rows never published"))
            requests = [dict(r) for r in await db.admin.fetch("SELECT * FROM cancellation_requests")]
            durations = {"seed": seed, "chaos": chaos_took, "settle": settle_took,
                         "check": time.monotonic() - check_started, "total": time.monotonic() - t0}
            report = summary(c, rows, requests, durations, violations, acc)
            request.node.user_properties.append((CHAOS_REPORT, report.strip("\n")))
            print(report)
            temporal_records = [r for r in requests if is_temporal_cancel(r)]
            print(f"  Temporal-cancel records: {Counter(r['outcome'] for r in temporal_records)}")
            for line in notes:
                print(f"  note: {line}")
            for line in c.recovery_errors[:5]:
                print(f"  recovery error: {line}")
            print("\n".join(c.log))
            if violations:
                for w in c.workers:
                    print(f"  worker log: {w.log_path}")
            for invariant, text in violations:
                print(f"VIOLATION [{invariant}] {text}")
            assert not violations, f"seed {seed}: {len(violations)} invariant violations:\n" + "\n".join(
                f"[{invariant}] {text}" for invariant, text in violations)
        finally:
            stop_recovery.set()
            if recovery_task is not None and not recovery_task.done():
                recovery_task.cancel()
            for t in c.tasks + c.watchers:
                if not t.done():
                    t.cancel()
            for w in c.workers:
                w.kill()  # SIGKILL ends a stopped process too
            for w in c.workers:
                if w.process is not None:
                    await asyncio.wait_for(w.process.wait(), timeout=15)


def test_the_event_sequence_check_refuses_what_no_statement_writes():
    """The chaos run's own checker, on histories written by hand (runs in the default suite: no chaos needed)."""
    first, second = uuid.uuid4(), uuid.uuid4()

    def history(*attempts: tuple[uuid.UUID, str]) -> list[dict[str, Any]]:
        kind_of = {"C": "Claimed", "B": "BuildStarted", "Q": "RequeuedByRecovery", "S": "Stopped", "F": "Failed",
                   "A": "DeliveryAuthorized", "E": "Finished", "R": "Reconciled", "X": "Corrected"}
        return [{"attempt_id": a, "kind": kind_of[k]} for a, letters in attempts for k in letters]

    def row(status: Status, attempt: uuid.UUID | None, count: int) -> dict[str, Any]:
        return {"status": status.value, "attempt_id": attempt, "attempt_count": count}

    assert sequence_problems(history((first, "CBQ"), (second, "CBBAER")), row(Status.COMPLETED, second, 2), 3) == []
    assert sequence_problems(history((first, "CBS")), row(Status.STOPPED, first, 1), 3) == []
    assert sequence_problems(history((first, "CQ")), row(Status.CANCELED, None, 1), 3) == []
    # Over the cap of lost attempts only by attempts their worker handed back: within it; hand-backs have their own.
    four = history(*((uuid.uuid4(), "CBAQ") for _ in range(4)))
    assert sequence_problems(four, {**row(Status.QUEUED, None, 4), "handed_back_count": 1}, 3) == []
    assert sequence_problems(four, {**row(Status.QUEUED, None, 4), "handed_back_count": 4}, 3, 3)
    # Likewise by attempts lost with their worker, which are capped apart (at 4 here: three requeued at most).
    shared = [{**e, "detail": "lost with its worker"} if e["kind"] == "RequeuedByRecovery" else e for e in four]
    assert sequence_problems(shared[:12], row(Status.QUEUED, None, 3), 1, 10, 4) == []
    assert sequence_problems(shared, row(Status.QUEUED, None, 4), 1, 10, 4)
    assert sequence_problems(four, row(Status.QUEUED, None, 4), 1, 10, 4)  # lost alone: over the cap of 1
    amid = [{**e, "detail": LOST_AMID_OTHERS} if e["kind"] == "RequeuedByRecovery" else e for e in four]
    assert sequence_problems(amid, row(Status.QUEUED, None, 4), 1, 10, 4, 5) == []
    assert sequence_problems(amid, row(Status.QUEUED, None, 4), 1, 10, 4, 4)
    for events, final, why in (
        (history((first, "CBAEA")), row(Status.COMPLETED, first, 1), "authorized twice"),
        (history((first, "CAE")), row(Status.COMPLETED, first, 1), "authorized without a build"),
        (history((first, "CBS"), (second, "CBAE")), row(Status.COMPLETED, second, 2),
         "an earlier attempt not requeued"),
        (history((first, "CBAE")), row(Status.STOPPED, first, 1), "the row disagrees with its attempt"),
        (history((first, "CQ"), (second, "CQ")), row(Status.CANCELED, None, 3), "counts disagree"),
        (history(*((uuid.uuid4(), "CQ") for _ in range(4))), row(Status.CANCELED, None, 4), "over the cap"),
    ):
        assert sequence_problems(events, final, 3), why


def test_the_outcome_accounting_attributes_only_what_a_fault_explains():
    """The chaos run's accounting (tests/helpers/chaos_accounting.py), on histories written by hand (runs in the
    default suite: no chaos needed)."""
    from datetime import UTC, datetime

    def at(seconds: float) -> datetime:
        return datetime.fromtimestamp(1_000_000 + seconds, UTC)

    def export(outcome: str, *, pid: int = 101, by: str = "Finished", failure: str | None = None,
               replaces: uuid.UUID | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        attempt = uuid.uuid4()
        events = [{"attempt_id": attempt, "kind": "Claimed", "worker_id": f"vm-7-{pid}-0ceba4", "detail": None,
                   "recorded_at": at(10)},
                  {"attempt_id": attempt, "kind": "DeliveryAuthorized", "worker_id": None, "detail": None,
                   "recorded_at": at(12)},
                  {"attempt_id": attempt, "kind": by, "worker_id": None, "detail": f"{outcome}: what happened",
                   "recorded_at": at(14)}]
        row = {"status": outcome, "failure_reason": failure, "attempt_id": attempt, "replaces_job_id": replaces}
        return row, events

    def accounted(exports: dict[uuid.UUID, tuple[dict[str, Any], list[dict[str, Any]]]], *faults: Fault):
        return account({j: row for j, (row, _) in exports.items()}, {j: ev for j, (_, ev) in exports.items()},
                       list(faults), now=1_000_100)

    assert worker_pid("vm-7-4242-0ceba4") == 4242 == worker_pid("vm-7-4242-0ceba4/9d7471fe205d")
    assert worker_pid(None) is None
    unknown, done, lapsed = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    exports = {unknown: export("OutcomeUnknown"), done: export("Completed"),
               lapsed: export("OutcomeUnknown", by="ResolvedByRecovery")}
    cut = Fault("partner cut", start=1_000_013.0, end=1_000_013.0)
    acc = accounted(exports, cut)
    assert [n.cause for n in acc.needed] == ["partner cut", "partner cut"]
    assert (acc.confirmed, acc.to_deliver) == (1, 3)
    # What the worker wrote after its delivery is explained by a partner cut, not by a database cut.
    acc = accounted(exports, Fault("database cut", start=1_000_013.0, end=1_000_013.0))
    assert [(n.job_id, n.cause) for n in acc.needed] == [(unknown, "unattributed"), (lapsed, "database cut")]
    # A worker fault explains only what ran on that worker; a partner cut only after delivery was authorized.
    acc = accounted(exports, Fault("worker pause", start=1_000_011.0, end=1_000_016.0, pid=202),
                    Fault("partner cut", start=1_000_009.0, end=1_000_009.0))
    assert [n.cause for n in acc.needed] == ["unattributed", "unattributed"]
    acc = accounted(exports, Fault("worker pause", start=1_000_011.0, end=1_000_016.0, pid=101))
    assert [n.cause for n in acc.needed] == ["unattributed", "worker pause"]
    # A replacement that found its final name occupied is explained by what made its original unknown.
    replacement = uuid.uuid4()
    exports[replacement] = export("Failed", failure="FinalNameOccupied", replaces=lapsed)
    acc = accounted(exports, Fault("worker crash", start=1_000_013.0, end=1_000_013.0, pid=101))
    assert {n.job_id: (n.recorded.outcome, n.cause, n.through) for n in acc.needed}[replacement] == (
        "Failed/FinalNameOccupied", "worker crash", lapsed)
    # Every delivery unknown: nothing confirmed, whatever explains each one.
    acc = accounted({j: export("OutcomeUnknown") for j in (uuid.uuid4(), uuid.uuid4())}, cut)
    assert acc.confirmed_share == 0.0 and not acc.unattributed
    # A note says the last error the attempt's evidence recorded, where the delivery met it.
    row, events = export("Failed", failure="NotDelivered")
    events.insert(2, {**events[1], "kind": "DeliveryEvidence", "detail": json.dumps(
        {"step": "fresh_listing", "failed_step": "upload", "error": "SFTPFailure: write failed"})})
    [note] = accounted({uuid.uuid4(): (row, events)}, cut).notes(1_000_000)
    assert note.endswith("; its evidence: upload: SFTPFailure: write failed"), note


def test_a_fault_that_came_after_the_rename_fence_passed_missed_its_aim():
    """The transient profile's check for a partner cut armed before an export's fence that came after it."""
    from datetime import UTC, datetime

    attempt = uuid.uuid4()
    passed = datetime(2026, 12, 4, 3, 0, 0, tzinfo=UTC)
    fence = {"attempt_id": attempt, "kind": "DeliveryEvidence", "detail": json.dumps({"step": "rename"}),
             "recorded_at": passed}
    upload = {"attempt_id": attempt, "kind": "DeliveryEvidence", "detail": json.dumps({"step": "baseline"}),
              "recorded_at": passed - timedelta(seconds=1)}
    after = Fault("partner cut", start=passed.timestamp() + 0.01, end=passed.timestamp() + 0.01)
    before = Fault("partner cut", start=passed.timestamp() - 0.5, end=passed.timestamp() - 0.5)
    assert landed_past_the_fence(after, [upload, fence], attempt)
    assert not landed_past_the_fence(before, [upload, fence], attempt)
    assert not landed_past_the_fence(after, [upload], attempt)  # never passed its fence
    assert not landed_past_the_fence(after, [upload, fence], uuid.uuid4())  # another attempt's fence
