"""One export end to end through a real worker, the Temporal dev server, PostgreSQL and an SFTP partner."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import uuid
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
from sqlalchemy.exc import DBAPIError
from temporalio.api.enums.v1 import EventType

from activities.process.dispatcher import OutboxDispatcher
from starter.client import ExportsClient
from starter.localstack.postgres import ROLES
from store.db import asyncpg_dsn, make_engine
from store.jobs import JobStore
from store.models import CancellationOutcome, ClaimResult, Status
from store.outbox import Outbox
from store.statements import SQL_DIR, statement
from tests.helpers.events import events, kinds
from tests.helpers.faults import fault_proxy
from tests.helpers.harness import Harness, open_harness
from tests.helpers.partner import assert_partner_holds
from tests.helpers.support import eventually
from workflows.identity import export_workflow_id

# --- the documented statements, as the wire carries them ---------------------------------------------------------

# How SQLAlchemy's asyncpg dialect sends a text() statement: each `:name` becomes `$n`, numbered by first appearance
# (the same pattern SQLAlchemy uses to find a text()'s parameters: not `::` casts, not a `:` inside a word).
_BIND = re.compile(r"(?<![:\w\\]):(\w+)(?!:)")
# A statement that writes the export row or its events, wherever it stands in the statement (e.g. inside WITH).
_WRITES_EXPORT_TABLES = re.compile(
    r"\b(?:INSERT\s+INTO|UPDATE|DELETE\s+FROM|MERGE\s+INTO|TRUNCATE(?:\s+TABLE)?|COPY)\s+(?:ONLY\s+)?"
    r"(?:\w+\.)?\"?(?:export_jobs|export_attempt_events)\b", re.IGNORECASE)


def as_sent(sql: str) -> str:
    numbers: dict[str, int] = {}
    return _BIND.sub(lambda m: f"${numbers.setdefault(m.group(1), len(numbers) + 1)}", sql)


def documented_statements() -> dict[str, str]:
    """Every store/sql file, by name, as the application sends it; read from the files at run time."""
    return {path.stem: as_sent(statement(path.stem).text) for path in sorted(SQL_DIR.glob("*.sql"))}


def _without_comments(sql: str) -> str:
    return re.sub(r"--[^\n]*", "", sql)


def writes_export_tables(sql: str) -> bool:
    return bool(_WRITES_EXPORT_TABLES.search(_without_comments(sql)))


def _short(sql: str) -> str:
    return " ".join(_without_comments(sql).split())[:160]


def check_documented_writes(sent: list[tuple[str, str]], required: list[str]) -> dict[str, int]:
    """`sent` is the proxy's log of what the application's connections sent. Each required statement was
    executed exactly as its file says, in the order given; and every statement that writes export_jobs or
    export_attempt_events, executed or only prepared, is one of the files. The executions per statement."""
    documented = documented_statements()
    # Executed: a simple query, or a Bind of a prepared statement (the proxy resolves its name to its text).
    executed = [sql for kind, sql in sent if kind in ("Q", "B")]
    runs = {name: sum(sql == text for sql in executed) for name, text in documented.items()}
    missing = [name for name in required if runs[name] == 0]
    assert not missing, f"never executed as documented: {missing}; the writes executed: " + repr(
        sorted({_short(sql) for sql in executed if writes_export_tables(sql)}))
    firsts = [executed.index(documented[name]) for name in required]
    assert firsts == sorted(firsts), f"documented statements out of order: {dict(zip(required, firsts, strict=True))}"
    known = set(documented.values())
    undocumented = sorted({_short(sql) for kind, sql in sent if kind in ("Q", "P", "B")
                           and writes_export_tables(sql) and sql not in known})
    assert not undocumented, f"writes to the export tables that are not a store/sql statement: {undocumented}"
    return {name: n for name, n in runs.items() if n}


@pytest.mark.spec("TW1")
async def test_workflow__one_export_runs_every_step_as_an_activity(db, client, tmp_path):
    async with AsyncExitStack() as stack:
        # Every application-role connection (the starter's, the worker's activities, the build's COPY) goes
        # through a proxy that logs the SQL each one sends.
        proxy = await stack.enter_async_context(fault_proxy(db.server, log_messages=True))
        app_url = proxy.url(ROLES["app"], db.name)
        engine = make_engine(app_url)
        stack.push_async_callback(engine.dispose)
        settings = db.settings()
        store = JobStore(engine, lease_seconds=settings.lease_seconds, lock_timeout_ms=settings.lock_timeout_ms,
                         reread_timeout_seconds=settings.reread_timeout_seconds)
        # A build of about a second, renewing every quarter second: the lease keeper's renewal runs too.
        harness = await open_harness(stack, db, store, client, tmp_path, database_url=app_url,
                                     renew_every_seconds=0.25, build_throttle_bytes_per_second=20_000)
        job_id = await harness.create()
        row = await harness.settled(job_id)
        assert row.status is Status.COMPLETED and row.attempt_count == 1
        assert_partner_holds(harness.partner, row)
        found = kinds(await events(harness.db, job_id))
        # The attempt's milestones in order (a build's own BuildStarted event, where recorded, comes between).
        milestones = [kind for kind in found if kind != "BuildStarted"]
        assert milestones[:2] == ["Claimed", "DeliveryAuthorized"] and milestones[-1] == "Finished"
        assert "DeliveryEvidence" in found
        # One workflow, and each step an activity of it.
        history = await harness.client.get_workflow_handle(export_workflow_id(job_id)).fetch_history()
        activities = [e.activity_task_scheduled_event_attributes.activity_type.name for e in history.events
                      if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED]
        # Policy and the claim are one step, and the delivery returns the row its terminal write left, so no step
        # re-reads it afterwards: four activities.
        assert activities == ["claim_if_allowed", "build", "authorize_delivery", "deliver"]
        assert not list(Path(harness.settings.work_dir).glob("*.csv*")), "the local file was not removed"
    # Each step's row write is its documented statement, exactly as its file says: creation (the starter), the
    # claim, the renewal (build), cutoff 2, the delivery's evidence and its terminal write; and nothing else
    # wrote the row or its events. (The expected form of each file is SQLAlchemy's own rendering of it.)
    for name, expected in documented_statements().items():
        assert expected == str(statement(name).compile(dialect=engine.dialect)), name
    runs = check_documented_writes(proxy.sent, ["create_job", "claim", "renew_lease", "authorize_delivery",
                                                "append_evidence", "finish_delivery"])
    assert (runs["create_job"], runs["claim"], runs["authorize_delivery"], runs["finish_delivery"]) == (1, 1, 1, 1)


@pytest.mark.spec("TW4")
async def test_workflow__platform_team_starts_with_plain_client_call(harness: Harness):
    exports = ExportsClient(harness.store, harness.client, task_queue=harness.settings.task_queue)
    handle = await exports.start(tenant_id=harness.tenant_id, destination_id=harness.destination_id,
                                 created_by="platform-team")
    result = await handle.result(rpc_timeout=None)
    assert result.status is Status.COMPLETED
    row = await harness.store.read_job(result.job_id)
    assert row.status is Status.COMPLETED and row.created_by == "platform-team"
    assert_partner_holds(harness.partner, row)


# --- the outbox dispatcher ------------------------------------------------------------------------------------------

PUBLISH_BOUND = 20.0  # seconds; a dispatch (a database transaction and Temporal calls) ends far sooner or fails
# The start of the dispatcher's statement that marks a row published.
MARK_PUBLISHED = "UPDATE outbox SET published_at"


async def dispatch(dispatcher: OutboxDispatcher) -> int:
    return await asyncio.wait_for(dispatcher.dispatch_once(), PUBLISH_BOUND)


async def backends_marking_published(db) -> list[tuple[int, str]]:
    """(pid, role) of each backend whose transaction is open and whose last statement marked an outbox row
    published: the dispatcher's own connection, as PostgreSQL sees it."""
    rows = await db.admin.fetch(
        "SELECT pid, usename FROM pg_stat_activity WHERE datname = current_database() "
        "AND state = 'idle in transaction' AND starts_with(query, $1)", MARK_PUBLISHED)
    return [(r["pid"], r["usename"]) for r in rows]


@pytest.mark.spec("TW8")
async def test_dispatcher__publishes_every_row_and_retries_with_its_message_id(quiet_harness: Harness, db):
    harness = quiet_harness  # its worker runs no dispatcher; this one runs under the dispatcher role
    engine = make_engine(db.url("dispatcher"))
    failures = {"left": 1}
    published: list[uuid.UUID] = []
    marking: list[list[tuple[int, str]]] = []

    class FlakyDispatcher(OutboxDispatcher):
        async def publish(self, message_id, job_id, tenant_id=None):
            if failures["left"]:
                failures["left"] -= 1
                raise ConnectionError("Temporal unreachable")
            if published:
                # Mid-batch: the previous wave's row is marked, and its mark committed before this publication began.
                marking.append(await backends_marking_published(db))
            await super().publish(message_id, job_id, tenant_id)
            published.append(message_id)

    # One row a wave: the mark of a wave commits before the next wave's publications begin.
    dispatcher = FlakyDispatcher(harness.client, Outbox(engine), asyncpg_dsn(db.url("dispatcher")),
                                 task_queue=harness.settings.task_queue, poll_seconds=0.2, concurrency=1)
    try:
        job_id = await harness.store_create()
        message_id = await db.admin.fetchval("SELECT message_id FROM outbox WHERE job_id = $1", job_id)
        assert await dispatch(dispatcher) == 0  # the publication failed: the row stays unpublished
        assert await db.admin.fetchval("SELECT published_at FROM outbox WHERE job_id = $1", job_id) is None
        second_job_id = await harness.store_create()
        second_message_id = await db.admin.fetchval("SELECT message_id FROM outbox WHERE job_id = $1",
                                                    second_job_id)
        # The retry publishes the first row with its own message ID, then the second.
        assert await dispatch(dispatcher) == 2
        assert published == [message_id, second_message_id]
        assert await db.admin.fetchval(
            "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL AND job_id = ANY($1::uuid[])",
            [job_id, second_job_id]) == 2
        # No transaction of the dispatcher stayed open while it asked Temporal (OU4); which role may mark a row
        # published is the permission tests' (PE2).
        assert marking == [[]], marking
        for each in (job_id, second_job_id):
            assert (await harness.settled(each)).status is Status.COMPLETED
        history = await harness.client.get_workflow_handle(export_workflow_id(job_id)).fetch_history()
        signals = [e for e in history.events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED]
        payload = signals[0].workflow_execution_signaled_event_attributes.input.payloads[0].data
        assert str(message_id).encode() in payload
    finally:
        await engine.dispose()


# What the workflow's history says about its wake-ups.

_SIGNALED = EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
_TASK_COMPLETED = EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED
_ACTIVITY_ENDED = (EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED, EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED,
                   EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT, EventType.EVENT_TYPE_ACTIVITY_TASK_CANCELED)


def scheduled(events, activity_type: str) -> int:
    return sum(1 for e in events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
               and e.activity_task_scheduled_event_attributes.activity_type.name == activity_type)


def signals_processed(events) -> int:
    """How many wake signals the workflow has received and run a workflow task on since: a signal that arrives
    during a workflow task is recorded after it, so a task completed after the signal is one that saw it, and the
    activities that task scheduled are in the history with it."""
    signal_at = [i for i, e in enumerate(events) if e.event_type == _SIGNALED]
    last_task = max((i for i, e in enumerate(events) if e.event_type == _TASK_COMPLETED), default=-1)
    return sum(1 for i in signal_at if i < last_task)


def idle(events) -> bool:
    """No activity in flight, and a workflow task completed since the last one ended: the workflow waits."""
    activities = sum(1 for e in events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED)
    ended = [i for i, e in enumerate(events) if e.event_type in _ACTIVITY_ENDED]
    return (activities > 0 and len(ended) == activities
            and any(e.event_type == _TASK_COMPLETED for e in events[ended[-1]:]))


def wake_ids(events) -> list[str]:
    return [json.loads(e.workflow_execution_signaled_event_attributes.input.payloads[0].data)["message_id"]
            for e in events if e.event_type == _SIGNALED]


@pytest.mark.spec("TW8")
async def test_dispatcher__a_pass_publishes_its_rows_side_by_side_and_one_exports_rows_in_their_order(
        quiet_harness: Harness, db):
    """A burst of exports is started side by side, not one Temporal round trip after another (P1 measured the
    dispatcher at about 10 starts a second); an export's second row still goes out after its first."""
    harness = quiet_harness  # its worker runs no dispatcher; this one runs under the dispatcher role
    engine = make_engine(db.url("dispatcher"))
    in_flight: list[uuid.UUID] = []  # the jobs whose publication has begun and not ended
    overlapped = asyncio.Event()
    began: list[uuid.UUID] = []  # message IDs, in the order their publications began
    same_job_together: list[uuid.UUID] = []

    class WatchedDispatcher(OutboxDispatcher):
        async def publish(self, message_id, job_id, tenant_id=None):
            if job_id in in_flight:
                same_job_together.append(job_id)
            in_flight.append(job_id)
            began.append(message_id)
            if len(in_flight) > 1:
                overlapped.set()
            try:
                # Each publication waits a moment for another to begin: one at a time, none ever does.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(overlapped.wait(), 1.0)
                await super().publish(message_id, job_id, tenant_id)
            finally:
                in_flight.remove(job_id)

    dispatcher = WatchedDispatcher(harness.client, Outbox(engine), asyncpg_dsn(db.url("dispatcher")),
                                   task_queue=harness.settings.task_queue, poll_seconds=0.2)
    try:
        job_ids = [await harness.store_create() for _ in range(5)]
        first = await db.admin.fetchval("SELECT message_id FROM outbox WHERE job_id = $1", job_ids[0])
        second = await db.admin.fetchval(
            "INSERT INTO outbox (message_id, kind, job_id, created_at) "
            "VALUES (gen_random_uuid(), 'ExportReady', $1, clock_timestamp()) RETURNING message_id", job_ids[0])
        published = await dispatch(dispatcher)
        assert overlapped.is_set(), "the pass published its rows one at a time"
        assert published == 6
        assert same_job_together == [], "an export's two rows were published at once"
        assert began.index(first) < began.index(second)
        assert await db.admin.fetchval(
            "SELECT count(*) FROM outbox WHERE published_at IS NULL AND job_id = ANY($1::uuid[])", job_ids) == 0
        for job_id in job_ids:
            assert (await harness.settled(job_id)).status is Status.COMPLETED
    finally:
        await engine.dispose()


@pytest.mark.spec("TW8")
async def test_dispatcher__a_wave_with_a_failed_publication_marks_the_rest_and_ends_the_pass(
        quiet_harness: Harness, db):
    harness = quiet_harness  # its worker runs no dispatcher; this one runs under the dispatcher role
    engine = make_engine(db.url("dispatcher"))
    job_ids = [await harness.store_create() for _ in range(3)]
    failing = {job_ids[1]}

    class OneFails(OutboxDispatcher):
        async def publish(self, message_id, job_id, tenant_id=None):
            if job_id in failing:
                raise ConnectionError("Temporal unreachable")
            await super().publish(message_id, job_id, tenant_id)

    # Two rows a wave: the first wave holds the failure, so the third row waits for the next pass.
    dispatcher = OneFails(harness.client, Outbox(engine), asyncpg_dsn(db.url("dispatcher")),
                          task_queue=harness.settings.task_queue, poll_seconds=0.2, concurrency=2)

    async def unpublished() -> list[uuid.UUID]:
        rows = await db.admin.fetch("SELECT job_id FROM outbox WHERE published_at IS NULL AND job_id = ANY($1::uuid[])",
                                    job_ids)
        return sorted(r["job_id"] for r in rows)

    try:
        assert await dispatch(dispatcher) == 1
        assert await unpublished() == sorted(job_ids[1:])
        failing.clear()
        assert await dispatch(dispatcher) == 2
        assert await unpublished() == []
        for job_id in job_ids:
            assert (await harness.settled(job_id)).status is Status.COMPLETED
    finally:
        await engine.dispose()


@pytest.mark.spec("TW8")
async def test_dispatcher__the_workers_own_dispatcher_runs_under_the_dispatcher_role(db, store, client, tmp_path):
    """The production wiring, not a dispatcher built by the test: the worker's dispatcher marks the rows it
    publishes as the dispatcher role (a trigger of the test's records who marked), and listens as that role."""
    await db.admin.execute("""
        CREATE TABLE test_outbox_markers (marked_by text, job_id uuid);
        CREATE FUNCTION test_record_marker() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER AS $$
        BEGIN INSERT INTO test_outbox_markers VALUES (session_user, NEW.job_id); RETURN NEW; END $$;
        CREATE TRIGGER test_outbox_marker AFTER UPDATE OF published_at ON outbox
            FOR EACH ROW EXECUTE FUNCTION test_record_marker();
    """)
    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path)
        job_id = await h.store_create()
        row = await h.settled(job_id)
        assert row.status is Status.COMPLETED
        # The outbox's channel; the worker's stop listener (exports_stop) is the application role's.
        listeners = await db.admin.fetch(
            "SELECT usename FROM pg_stat_activity WHERE datname = $1 AND query ILIKE 'LISTEN%exports_outbox%'",
            db.name)
        assert {r["usename"] for r in listeners} == {ROLES["dispatcher"]}, listeners
    markers = await db.admin.fetch("SELECT marked_by FROM test_outbox_markers WHERE job_id = $1", job_id)
    assert [m["marked_by"] for m in markers] == [ROLES["dispatcher"]]


@pytest.mark.spec("TW8")
async def test_dispatcher__one_row_published_twice_wakes_the_workflow_once(quiet_harness: Harness, db):
    harness = quiet_harness  # its worker runs no dispatcher; the test's own dispatcher publishes
    job_id = await harness.store_create()
    # The row is Running under an attempt the test claimed: the workflow cannot claim, so it evaluates, then
    # waits for a wake-up. Each wake-up it takes is one more claim_if_allowed.
    assert await harness.store.claim(job_id, 1, uuid.uuid4(), "test-holder") is ClaimResult.CLAIMED
    handle = harness.client.get_workflow_handle(export_workflow_id(job_id))

    async def history():
        return (await handle.fetch_history()).events

    async with AsyncExitStack() as stack:
        proxy = await stack.enter_async_context(fault_proxy(db.server))
        dispatcher_url = proxy.url(ROLES["dispatcher"], db.name)
        engine = make_engine(dispatcher_url)
        stack.push_async_callback(engine.dispose)
        dispatcher = OutboxDispatcher(harness.client, Outbox(engine), asyncpg_dsn(dispatcher_url),
                                      task_queue=harness.settings.task_queue, poll_seconds=0.2)
        try:
            # A real duplicate: Temporal takes the signal-with-start, then the dispatcher's connection is lost
            # before it marks the row published, so the row stays unpublished and is published again.
            cut = proxy.cut_before(MARK_PUBLISHED)
            with pytest.raises(DBAPIError):  # the connection, lost: the transaction never commits
                await dispatch(dispatcher)
            assert cut.is_set()
            message_id = await db.admin.fetchval(
                "SELECT message_id FROM outbox WHERE job_id = $1 AND published_at IS NULL", job_id)
            assert message_id is not None
            seen = await eventually(history, idle, timeout=PUBLISH_BOUND, what="the workflow waiting")
            assert (scheduled(seen, "claim_if_allowed"), wake_ids(seen)) == (1, [str(message_id)])

            assert await dispatch(dispatcher) == 1  # the same row, the same message ID, again
            seen = await eventually(history, lambda es: signals_processed(es) == 2, timeout=PUBLISH_BOUND,
                                      what="the duplicate wake-up processed")
            assert wake_ids(seen) == [str(message_id)] * 2
            evaluations = scheduled(seen, "claim_if_allowed")
            assert evaluations == 1, "the duplicate publication woke the workflow"

            # The control: a different outbox row for the same export wakes it once more.
            await db.admin.execute("INSERT INTO outbox (message_id, kind, job_id, created_at) "
                                   "VALUES (gen_random_uuid(), 'ExportReady', $1, clock_timestamp())", job_id)
            assert await dispatch(dispatcher) == 1
            seen = await eventually(history, lambda es: signals_processed(es) == 3, timeout=PUBLISH_BOUND,
                                      what="the second row's wake-up processed")
            assert len(set(wake_ids(seen))) == 2
            evaluations = scheduled(seen, "claim_if_allowed")
            assert evaluations == 2, "a new row did not wake the workflow"
            assert await db.admin.fetchval(
                "SELECT count(*) FROM outbox WHERE job_id = $1 AND published_at IS NULL", job_id) == 0
        finally:
            await asyncio.wait_for(handle.terminate("test over: the row is held by the test"), PUBLISH_BOUND)


@pytest.mark.spec("TW8")
async def test_dispatcher__created_job_reaches_a_worker_without_a_sweep(harness: Harness):
    dispatching_harness = harness
    job_ids = [await dispatching_harness.store_create() for _ in range(3)]
    for job_id in job_ids:
        assert (await dispatching_harness.settled(job_id)).status is Status.COMPLETED
    assert await dispatching_harness.db.admin.fetchval(
        "SELECT count(*) FROM outbox WHERE published_at IS NULL") == 0
    assert await dispatching_harness.db.admin.fetchval("SELECT max(sweep_count) FROM export_jobs") == 0


@pytest.mark.spec("AR3")
async def test_cancel__stop_before_cutoff_2_ends_stopped_with_nothing_delivered(slow_build_harness: Harness):
    h = slow_build_harness
    job_id = await h.create()
    await eventually(lambda: h.store.read_job(job_id), lambda r: r.status is Status.RUNNING, what="Running")
    result = await h.exports.cancel(tenant_id=h.tenant_id, job_id=job_id, requested_by="op", reason="stop")
    assert result.outcome is CancellationOutcome.STOP_REQUESTED
    row = await h.settled(job_id)
    assert row.status is Status.STOPPED and row.stop_request_id == result.request_id
    assert row.delivery_authorized_at is None
    found = kinds(await events(h.db, job_id))
    assert "DeliveryAuthorized" not in found and "Stopped" in found
    assert list((h.partner.root / "outbound").iterdir()) == []
    assert list((h.partner.root / "incoming-tmp").iterdir()) == []
    assert not list(Path(h.settings.work_dir).glob("*.csv*")), "the partial file was not removed"


@pytest.mark.spec("AR4")
async def test_cancel__after_cutoff_2_is_too_late_and_delivery_completes(slow_upload_harness: Harness):
    h = slow_upload_harness
    job_id = await h.create()
    await eventually(lambda: h.store.read_job(job_id), lambda r: r.status is Status.DELIVERING, what="Delivering")
    result = await h.exports.cancel(tenant_id=h.tenant_id, job_id=job_id, requested_by="op", reason="late")
    assert result.outcome is CancellationOutcome.TOO_LATE
    row = await h.settled(job_id)
    assert row.status is Status.COMPLETED and row.stop_request_id is None
    assert_partner_holds(h.partner, row)
    recorded = await h.db.admin.fetchrow("SELECT outcome, found_status FROM cancellation_requests")
    assert tuple(recorded) == ("TooLate", "Delivering")
