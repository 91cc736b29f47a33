"""S2 and S3: what one partner's or one tenant's load does to everyone else's exports, each against the same
exports alone, measured in the same run on one worker process with default settings.

- S2: small exports to a healthy partner while a backlog of large exports to a slow partner (a link of about
  50 KB/s, the partner's writes paced by its hook) is queued ahead of them: their p95, from creation to
  Completed, against their p95 with no backlog. None may end OutcomeUnknown.
  Twenty more once the backlog's uploads are under way say what the slow partner alone costs the others.
- S3: one tenant's single export while another tenant's burst is queued: its time to Completed against the same
  export alone, the median of three each way, one at a time.

"Alone" is measured on a worker that has run an export already: the first export after a worker starts also
waits for it to start. Beside each, no-op workflows of the export's shape on a worker and queues of their own
(bench/noop_worker.py) say what the server gave any workflow meanwhile.

The backlog is never waited out: once the measured exports are Completed, the stack is stopped.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from statistics import median

import asyncpg
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from activities.partner_delivery import MAX_WRITE_BYTES
from bench.noop_shape import Shape
from bench.stack import Stack, full_stack
from bench.table import Row
from bench.throughput import shape_of
from starter.client import ExportsClient
from starter.localstack.partner import LocalPartner
from starter.localstack.seed import seed_contacts, seed_destination
from store.db import make_engine
from store.jobs import JobStore
from store.settings import Settings
from workflows.identity import export_workflow_id

# The upload's SFTP write size at this partner: asyncssh's server announces more than the client takes.
_CHUNK = MAX_WRITE_BYTES
_LINK_BYTES_PER_SECOND = 50_000
_CONTACT_BYTES = 90  # about, per contact in the built CSV
_NOOP_QUEUE = "bench-noop"
_DEFAULT = Settings.model_construct()  # the worker runs with default settings
# Between one workflow measured alone and the next: on the dev server, workflows run back to back each wait about
# 40 ms more for each task from the third on (plain no-op workflows too), which is not what one export alone costs.
_PAUSE = 1.5


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


async def _completed_within(admin: asyncpg.Connection, jobs: list[uuid.UUID], created: dict[uuid.UUID, float],
                            timeout: float) -> dict[uuid.UUID, float]:
    """Seconds from each export's creation to its Completed, seen by polling its row; an error if one settles
    otherwise (OutcomeUnknown above all) or the bound passes."""
    done: dict[uuid.UUID, float] = {}
    deadline = time.monotonic() + timeout
    while len(done) < len(jobs):
        rows = await admin.fetch("SELECT id, status FROM export_jobs WHERE id = ANY($1::uuid[])", jobs)
        for row in rows:
            if row["id"] in done:
                continue
            if row["status"] == "Completed":
                done[row["id"]] = time.monotonic() - created[row["id"]]
            elif row["status"] not in ("Queued", "Running", "Delivering"):
                raise RuntimeError(f"export {row['id']} ended {row['status']}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(done)} of {len(jobs)} exports Completed within {timeout:.0f} s")
        await asyncio.sleep(0.05)
    return done


async def _create(exports: ExportsClient, tenant: uuid.UUID, destination: uuid.UUID, count: int,
                  created: dict[uuid.UUID, float]) -> list[uuid.UUID]:
    jobs = []
    for _ in range(count):
        job = await exports.create(tenant_id=tenant, destination_id=destination, created_by="bench")
        created[job] = time.monotonic()
        jobs.append(job)
    return jobs


async def _tenant(stack: Stack, contacts: int, partner: LocalPartner, name: str) -> tuple[uuid.UUID, uuid.UUID]:
    tenant = uuid.uuid4()
    await seed_contacts(stack.admin, tenant, contacts)
    d = partner.destination()
    destination = await seed_destination(stack.admin, tenant, name=name, host=d.host, port=d.port,
                                         username=d.username, final_dir=d.final_dir, temp_dir=d.temp_dir,
                                         host_key=d.host_key, credential_ref=d.credential_ref)
    return tenant, destination


def _slow_link(partner: LocalPartner) -> None:
    """The partner's writes paced at about 50 KB/s a file, one write at a time, as a slow link would."""
    links: dict[str, asyncio.Lock] = {}

    async def paced(path: str, offset: int) -> None:
        async with links.setdefault(path, asyncio.Lock()):
            await asyncio.sleep(_CHUNK / _LINK_BYTES_PER_SECOND)

    partner.hooks.on_write = paced


class ShapedNoops:
    """No-op workflows of the export's shape (bench/noop_worker.py) on a worker and queues of their own: what the
    server gives any workflow of that shape at the moment, beside whatever load the measure makes."""

    def __init__(self, client: Client, shape: Shape) -> None:
        self.client = client
        self.shape = shape

    async def seconds(self, count: int) -> list[float]:
        """Seconds from start to result of each of `count` started at once."""
        async def one() -> float:
            started = time.monotonic()
            await self.client.execute_workflow("ShapedNoopWorkflow", self.shape, id=f"bench-noop-{uuid.uuid4()}",
                                               task_queue=_NOOP_QUEUE, execution_timeout=timedelta(minutes=5))
            return time.monotonic() - started

        return list(await asyncio.gather(*(one() for _ in range(count))))


async def _with_stack(name: str, contacts: int,
                      body: Callable[[Stack, ExportsClient, ShapedNoops], Awaitable[Row]]) -> Row:
    async with full_stack(name, contacts=contacts) as stack:
        settings = stack.settings(task_queue=f"bench-{name}")
        await stack.spawn("worker", settings=settings)
        await stack.spawn("bench.noop_worker", stack.temporal.address, _NOOP_QUEUE)
        client = await Client.connect(stack.temporal.address, data_converter=pydantic_data_converter)
        engine = make_engine(stack.postgres.url("app"))
        exports = ExportsClient(JobStore(engine, lease_seconds=settings.lease_seconds), client,
                                task_queue=settings.task_queue)
        try:
            # One export and one no-op through first: a worker just spawned is still starting its pollers (and the
            # export's its dispatcher), about a second here, which is not what a workflow alone costs.
            warm: dict[uuid.UUID, float] = {}
            await _completed_within(stack.admin, await _create(exports, stack.tenant, stack.destination, 1, warm),
                                    warm, 120)
            noops = ShapedNoops(client, await shape_of(client, export_workflow_id(next(iter(warm)))))
            await noops.seconds(1)
            return await body(stack, exports, noops)
        finally:
            await engine.dispose()


async def measure_partner(*, small: int, slow: int, slow_megabytes: float) -> Row:
    async def body(stack: Stack, exports: ExportsClient, noops: ShapedNoops) -> Row:
        slow_partner = LocalPartner(stack.folder / "slow-partner")
        await slow_partner.start()
        try:
            _slow_link(slow_partner)
            big_tenant, slow_destination = await _tenant(
                stack, int(slow_megabytes * 1_000_000 / _CONTACT_BYTES), slow_partner, "slow")
            created: dict[uuid.UUID, float] = {}
            alone = await _completed_within(stack.admin, await _create(
                exports, stack.tenant, stack.destination, small, created), created, 300)
            await asyncio.sleep(_PAUSE)
            noops_alone = await noops.seconds(small)
            backlog = await _create(exports, big_tenant, slow_destination, slow, created)
            await _started(stack, backlog, timeout=300)
            behind = await _completed_within(stack.admin, await _create(
                exports, stack.tenant, stack.destination, small, created), created, 600)
            noops_behind = await noops.seconds(small)
            # Once the backlog has started (its uploads in flight, the rest of its claims waiting for its
            # partner's share), the same again: what the slow partner alone costs the others.
            await _uploading(stack, backlog, min(slow, _DEFAULT.destination_share))
            await asyncio.sleep(_PAUSE)
            settled = await _completed_within(stack.admin, await _create(
                exports, stack.tenant, stack.destination, small, created), created, 600)
            unknown = await stack.admin.fetchval(
                "SELECT count(*) FROM export_jobs WHERE status = 'OutcomeUnknown'")
        finally:
            await slow_partner.stop()
        row = Row("S2", f"p95 of {small} small exports behind {slow} slow uploads to another partner", "s",
                  p95(list(behind.values())), p95(list(alone.values())), "the same exports alone", ">= 0.67",
                  higher_is_better=False)
        row.notes.append(f"ratio is alone / behind the backlog: the goal is at most 1.5 times their p95 alone; "
                         f"{unknown} OutcomeUnknown (goal: none); backlog of {slow} exports of about "
                         f"{slow_megabytes:g} MB at about {_LINK_BYTES_PER_SECOND // 1000} KB/s")
        row.notes.append(_beside("the backlog", p95(noops_alone), p95(noops_behind), p95(list(behind.values())),
                                 f"{small} at once, p95"))
        row.notes.append(f"the row's exports came as the backlog started (its claims, its first builds); "
                         f"{small} more once its uploads were under way and the rest of it waited: p95 "
                         f"{p95(list(settled.values())):.2f} s")
        return row

    return await _with_stack("partners", 100, body)


async def measure_tenant(*, burst: int, singles: int = 3) -> Row:
    async def body(stack: Stack, exports: ExportsClient, noops: ShapedNoops) -> Row:
        other_tenant, other_destination = await _tenant(stack, 100, stack.partner, "other")
        created: dict[uuid.UUID, float] = {}

        async def one_by_one() -> tuple[list[tuple[uuid.UUID, float]], list[float]]:
            """`singles` exports of the other tenant, each created once the one before Completed, each followed by
            a no-op workflow of the export's shape."""
            times, noop_times = [], []
            for _ in range(singles):
                await asyncio.sleep(_PAUSE)
                done = await _completed_within(stack.admin, await _create(
                    exports, other_tenant, other_destination, 1, created), created, 600)
                times.extend(done.items())
                await asyncio.sleep(_PAUSE)
                noop_times.extend(await noops.seconds(1))
            return times, noop_times

        alone, noops_alone = await one_by_one()
        queued = await _create(exports, stack.tenant, stack.destination, burst, created)
        await _started(stack, queued[: max(1, burst // 2)], timeout=600)
        behind, noops_behind = await one_by_one()
        still_queued = await stack.admin.fetchval(
            "SELECT count(*) FROM export_jobs WHERE id = ANY($1::uuid[]) AND status = 'Queued'", queued)
        single, _ = sorted(behind, key=lambda done: done[1])[len(behind) // 2]
        steps = await stack.admin.fetch(
            "SELECT e.kind, extract(epoch FROM min(e.recorded_at) - o.created) AS after FROM export_attempt_events e, "
            "(SELECT min(created_at) AS created FROM outbox WHERE job_id = $1) o WHERE e.job_id = $1 "
            "GROUP BY e.kind, o.created ORDER BY 2", single)
        behind_seconds = median(seconds for _, seconds in behind)
        row = Row("S3", f"one tenant's export while another's {burst} are queued (median of {singles})", "s",
                  behind_seconds, median(seconds for _, seconds in alone), "the same export alone", ">= 0.5",
                  higher_is_better=False)
        row.notes.append(f"ratio is alone / behind the burst: the goal is at most 2 times alone; each of {singles} "
                         f"alone: {_seconds(alone)}; behind the burst: {_seconds(behind)}; {still_queued} of the "
                         f"burst still Queued when the last Completed; the median one's steps after its creation: "
                         + ", ".join(f"{step['kind']} {float(step['after']):.2f} s" for step in steps))
        row.notes.append(_beside("the burst", median(noops_alone), median(noops_behind), behind_seconds,
                                 f"one at a time, median of {singles}"))
        return row

    return await _with_stack("tenants", 100, body)


def _beside(load: str, noop_alone: float, noop_beside: float, export_beside: float, how: str) -> str:
    return (f"what the server gave any workflow meanwhile: no-op workflows of the export's shape, on a worker and "
            f"queues of their own ({how}), took {noop_alone:.2f} s alone and {noop_beside:.2f} s beside {load} "
            f"({noop_beside / noop_alone:.1f} times); the exports beside {load} took "
            f"{export_beside / noop_beside:.1f} times the no-ops beside it")


def _seconds(times: list[tuple[uuid.UUID, float]]) -> str:
    return ", ".join(f"{seconds:.2f} s" for _, seconds in times)


async def _uploading(stack: Stack, jobs: list[uuid.UUID], count: int) -> None:
    """At least `count` of the exports are past cutoff 2 (their uploads under way)."""
    deadline = time.monotonic() + 300
    while await stack.admin.fetchval("SELECT count(DISTINCT job_id) FROM export_attempt_events WHERE "
                                     "job_id = ANY($1::uuid[]) AND kind = 'DeliveryAuthorized'", jobs) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {count} of the backlog's uploads under way within 300 s")
        await asyncio.sleep(0.1)


async def _started(stack: Stack, jobs: list[uuid.UUID], *, timeout: float) -> None:
    """The exports' runs have taken their wake-up (the outbox row published): their claims are in Temporal's
    queue, ahead of what comes next."""
    deadline = time.monotonic() + timeout
    while await stack.admin.fetchval("SELECT count(*) FROM outbox WHERE job_id = ANY($1::uuid[]) AND "
                                     "published_at IS NULL", jobs):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the queued exports were not all published within {timeout:.0f} s")
        await asyncio.sleep(0.1)
