"""Lease tests' machinery: an in-process worker with a short lease, an activity held at a checkpoint, renewals
cut through the fault proxy, and reads of the lease and of the workflow's activities."""

from __future__ import annotations

import asyncio
import json
import uuid
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from temporalio.api.enums.v1 import EventType

from activities.checkpoints import Checkpoints
from store.models import Status
from tests.helpers.events import events, kinds
from tests.helpers.faults import PgFaultProxy, fault_proxy
from tests.helpers.harness import Harness, open_harness
from tests.helpers.support import eventually
from workflows.identity import export_workflow_id

BOUND = 30.0  # seconds: no single wait of a lease test may take longer
LEASE = 2.0
RENEW = 0.5
RENEWAL = "SET lease_expires_at"  # the renewal statement, and only it (store/sql/renew_lease.sql)
DISARMED = "-- lease tests: matches no statement --"



class Hold(Checkpoints):
    """Holds the first activity that reaches `name` until released; every later one passes, as in production."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.held = asyncio.Event()
        self.release = asyncio.Event()
        self._used = False

    async def reached(self, name: str, job_id: uuid.UUID) -> None:
        if name != self.name or self._used:
            return
        self._used = True
        self.held.set()
        await self.release.wait()

    async def wait_held(self) -> None:
        await asyncio.wait_for(self.held.wait(), BOUND)


class RenewalBlocker:
    """Through the fault proxy: every renewal statement is cut before it reaches PostgreSQL, until stopped."""

    def __init__(self, proxy: PgFaultProxy) -> None:
        self.proxy = proxy
        self.cuts = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        async def keep_cutting() -> None:
            while True:
                await self.proxy.cut_before(RENEWAL).wait()
                self.cuts += 1

        self._task = asyncio.create_task(keep_cutting())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self.proxy.cut_before(DISARMED)  # replaces the armed rule with one that matches nothing


async def lease_harness(stack: AsyncExitStack, db, store, client, tmp_path: Path, *, hold: Hold | None = None,
                        proxy: PgFaultProxy | None = None, **overrides: Any) -> Harness:
    settings: dict[str, Any] = {"lease_seconds": LEASE, "renew_every_seconds": RENEW, **overrides}
    if proxy is not None:
        settings["database_url"] = proxy.url("exports_app", db.name)
    h = await open_harness(stack, db, store, client, tmp_path, **settings)
    if hold is not None:
        h.activities.checkpoints = hold
        stack.callback(hold.release.set)  # before the worker shuts down: a held delivery never ends otherwise
    return h


async def open_proxy(stack: AsyncExitStack, db) -> PgFaultProxy:
    return await stack.enter_async_context(fault_proxy(db.server))


async def first_attempt(db, job_id: uuid.UUID) -> uuid.UUID:
    found = await eventually(lambda: events(db, job_id), lambda es: "Claimed" in kinds(es), timeout=BOUND,
                             what="the claim")
    return next(e["attempt_id"] for e in found if e["kind"] == "Claimed")


async def lease_state(db, job_id: uuid.UUID) -> dict[str, Any]:
    return dict(await db.admin.fetchrow(
        "SELECT status, attempt_id, lease_expires_at, lease_expires_at < clock_timestamp() AS expired "
        "FROM export_jobs WHERE id = $1", job_id))


async def wait_status(h: Harness, job_id: uuid.UUID, status: Status) -> None:
    await eventually(lambda: h.store.read_job(job_id), lambda r: r is not None and r.status is status,
                     timeout=BOUND, what=f"export {job_id} {status.value}")


async def wait_expired(db, job_id: uuid.UUID) -> None:
    """Polls the database clock; never sleeps through a lease."""
    await eventually(lambda: lease_state(db, job_id), lambda s: s["expired"] is True, timeout=BOUND,
                     interval=0.05, what=f"the lease of {job_id} expired")


async def history(h: Harness, job_id: uuid.UUID) -> list[tuple[str, Any]]:
    """(activity type, decoded result or None) for each scheduled activity, in order."""
    found = await h.client.get_workflow_handle(export_workflow_id(job_id)).fetch_history()
    scheduled: dict[int, int] = {}
    out: list[list[Any]] = []
    for e in found.events:
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            scheduled[e.event_id] = len(out)
            out.append([e.activity_task_scheduled_event_attributes.activity_type.name, None])
        elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            attrs = e.activity_task_completed_event_attributes
            payloads = attrs.result.payloads
            out[scheduled[attrs.scheduled_event_id]][1] = json.loads(payloads[0].data) if payloads else None
    return [(name, result) for name, result in out]
