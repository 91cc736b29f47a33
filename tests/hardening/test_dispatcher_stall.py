"""Hardening of the outbox dispatcher (matrix FG4): a dispatcher that stops answering while it holds the outbox lock
stops no other dispatcher for more than a bounded time, and a pass that cannot run says why in the log.

Real components: PostgreSQL, the Temporal dev server, and a dispatcher caught in the middle of its pass, holding the
lock while it publishes: a worker process (`python -m worker`) paused there with SIGSTOP, or a dispatcher whose
network to PostgreSQL goes silent (a forwarder that stops forwarding, as a partition that drops packets looks).
Another dispatcher (under the dispatcher role) must publish a new outbox row within seconds, at Temporal and in the
database, and say in its log why its passes were skipped meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
import uuid
from collections.abc import AsyncIterator

import pytest
from sqlalchemy.engine import make_url
from temporalio.api.enums.v1 import EventType

from activities.process.dispatcher import OutboxDispatcher
from store.db import asyncpg_dsn, make_engine
from store.outbox import LOCK_KEY, LockLost, Outbox
from tests.helpers.crash import crash_world, processes, start_worker
from tests.helpers.faults import upstream_of
from tests.helpers.support import create_job, eventually, seed_tenant
from workflows.identity import export_workflow_id

BOUND = 30.0  # every wait of this test, in seconds
# How long after its holder was paused another dispatcher may still find the outbox lock taken: the server's bound on
# a silent session holding it, with room for a poll and a slow machine. Today: forever.
TAKEOVER_BOUND = 12.0
DISPATCHER_LOG = "activities.dispatcher"

# The lock as pg_locks shows it: a bigint key is split into classid (high half) and objid (low half), objsubid 1.
_HOLDER = """
    SELECT l.pid, a.usename, a.state, extract(epoch FROM clock_timestamp() - a.state_change)::float AS idle_for
      FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
     WHERE l.locktype = 'advisory' AND l.granted AND l.classid = $1 AND l.objid = $2 AND l.objsubid = 1
       AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"""


async def lock_holder(db) -> dict | None:
    row = await db.admin.fetchrow(_HOLDER, LOCK_KEY >> 32, LOCK_KEY & 0xFFFFFFFF)
    return dict(row) if row is not None else None


def publishing(holder: dict | None) -> bool:
    """The holder is a dispatcher that has been silent for a while, its pass under way: with Temporal silent, it is
    waiting on a publication (an empty pass holds the lock for milliseconds)."""
    return (holder is not None and holder["usename"] == "exports_dispatcher" and holder["state"] == "idle"
            and holder["idle_for"] > 0.3)


@contextlib.asynccontextmanager
async def freezable_forwarder(target: str) -> AsyncIterator[tuple[str, asyncio.Event]]:
    """A TCP forwarder to `target` (host:port, or a Unix socket's path) on a free loopback port; clearing the event
    freezes it: connections stay open and nothing more is forwarded either way, as a silent partition looks."""
    flowing = asyncio.Event()
    flowing.set()
    writers: list[asyncio.StreamWriter] = []

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                await flowing.wait()
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def accept(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if target.startswith("/"):
            server_r, server_w = await asyncio.open_unix_connection(target)
        else:
            host, port = target.rsplit(":", 1)
            server_r, server_w = await asyncio.open_connection(host, int(port))
        writers.extend((client_w, server_w))
        await asyncio.gather(pipe(client_r, server_w), pipe(server_r, client_w))

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}", flowing
    finally:
        for writer in writers:
            writer.transport.abort()
        server.close()


async def signalled_with(client, job_id: uuid.UUID, message_id: uuid.UUID) -> bool:
    """The export's workflow exists at Temporal and got the wake-up carrying this message ID."""
    try:
        history = await client.get_workflow_handle(export_workflow_id(job_id)).fetch_history()
    except Exception:
        return False
    return any(e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
               and str(message_id).encode() in e.workflow_execution_signaled_event_attributes.input.payloads[0].data
               for e in history.events)


async def outbox_row(db, job_id: uuid.UUID) -> dict:
    return dict(await db.admin.fetchrow("SELECT message_id, published_at FROM outbox WHERE job_id = $1", job_id))


@pytest.mark.spec("FG4")
async def test_a_dispatcher_paused_while_holding_the_outbox_lock_stops_no_other_dispatcher_for_long(
        db, store, client, tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger=DISPATCHER_LOG)
    job_ids: list[uuid.UUID] = []
    engine = make_engine(db.url("dispatcher"))
    async with crash_world(db, store, client, tmp_path) as h, processes(h) as started, \
            freezable_forwarder(client.service_client.config.target_host) as (temporal, flowing):
        try:
            # A worker process whose Temporal the test can silence: its dispatcher then waits in the middle of a pass.
            worker = await start_worker(started, h, temporal_address=temporal)
            await eventually(lambda: asyncio.sleep(0, worker.log_path.read_text()), lambda text: "polling" in text,
                             timeout=BOUND, interval=0.1, what="the worker polling")
            flowing.clear()
            job_ids.append(await h.create())
            holder = await eventually(lambda: lock_holder(db), publishing, timeout=BOUND, interval=0.01,
                                      what="the worker's dispatcher publishing, the outbox lock held")
            worker.process.send_signal(signal.SIGSTOP)
            paused_at = time.monotonic()
            # Paused mid-pass: it holds the lock, and the row it was publishing is not marked.
            assert (await lock_holder(db))["pid"] == holder["pid"]
            assert (await outbox_row(db, job_ids[0]))["published_at"] is None
            flowing.set()  # Temporal answers everyone else; the worker is paused anyway

            # Another dispatcher, with a new outbox row to publish.
            dispatcher = OutboxDispatcher(client, Outbox(engine), asyncpg_dsn(db.url("dispatcher")),
                                          task_queue=h.settings.task_queue, poll_seconds=0.2)
            job_ids.append(await h.create())
            new_row = await outbox_row(db, job_ids[1])

            async def pass_then_row() -> dict:
                await asyncio.wait_for(dispatcher.dispatch_once(), BOUND)
                return await outbox_row(db, job_ids[1])

            published = await eventually(pass_then_row, lambda row: row["published_at"] is not None,
                                         timeout=TAKEOVER_BOUND, interval=0.2,
                                         what="the new outbox row published by another dispatcher")
            took = time.monotonic() - paused_at
            assert published["message_id"] == new_row["message_id"]
            # At Temporal: the export's workflow was started with the wake-up that carries the row's message ID.
            assert await signalled_with(client, job_ids[1], new_row["message_id"])
            # The paused worker's row too: publishing it again after it wakes would be harmless (one message ID).
            assert (await outbox_row(db, job_ids[0]))["published_at"] is not None
            # The server ended the paused holder's session, and its lock with it.
            assert await db.admin.fetchval("SELECT count(*) FROM pg_stat_activity WHERE pid = $1",
                                           holder["pid"]) == 0
            assert took <= TAKEOVER_BOUND, took

            # The skipped passes said why, once, naming the holder's backend; and then that dispatch works again.
            said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == DISPATCHER_LOG]
            warnings = [m for level, m in said if level >= logging.WARNING]
            assert len(warnings) == 1, said
            assert "outbox lock" in warnings[0] and str(holder["pid"]) in warnings[0], warnings
            assert any(level == logging.INFO and "works again" in m for level, m in said), said
            assert [level for level, m in said if "works again" in m or m in warnings] == \
                [logging.WARNING, logging.INFO], said

            # The paused worker, let go, finds its session gone, ends its pass, and goes on dispatching.
            worker.process.send_signal(signal.SIGCONT)
            job_ids.append(await h.create())
            await eventually(lambda: outbox_row(db, job_ids[2]), lambda row: row["published_at"] is not None,
                             timeout=BOUND, interval=0.2, what="the resumed worker dispatching again")
            assert worker.process.returncode is None
            # It said why its pass ended (it had been silent past the bound), and that it works again: the row above
            # may have been published by the other dispatcher, a retry (0.5 s) before the resumed one says so.
            said_by_worker = await eventually(lambda: asyncio.sleep(0, worker.log_path.read_text()),
                                              lambda text: "outbox dispatch works again" in text, timeout=BOUND,
                                              interval=0.2, what="the resumed worker saying it dispatches again")
            assert "LockLost: this dispatcher was silent for" in said_by_worker, said_by_worker[-3000:]
            assert "outbox dispatch works again" in said_by_worker, said_by_worker[-3000:]
        finally:
            flowing.set()
            for process in started:
                if process.process is not None and process.process.returncode is None:
                    process.process.send_signal(signal.SIGCONT)
            await engine.dispose()
            for job_id in job_ids:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(client.get_workflow_handle(export_workflow_id(job_id)).terminate(
                        "test over"), 10)


@pytest.mark.spec("FG4")
async def test_a_dispatcher_cut_off_from_postgresql_mid_pass_ends_its_pass_and_another_takes_over(
        db, store, client, caplog):
    """The holder's network to PostgreSQL goes silent after its batch was read, while it publishes: its next
    statement is never answered. It ends its pass within the bound instead of waiting on TCP for many minutes, and
    the server ends its session, so that another dispatcher publishes the new row and the holder's own row too."""
    caplog.set_level(logging.DEBUG, logger=DISPATCHER_LOG)
    tenant_id, destination_id = await seed_tenant(db.admin)
    queue = f"exports-fg4-{uuid.uuid4().hex[:8]}"  # no worker polls it: the workflows are only started
    job_ids = [await create_job(store, tenant_id, destination_id)]
    publishing, go_on = asyncio.Event(), asyncio.Event()

    class HeldDispatcher(OutboxDispatcher):
        async def publish(self, message_id, job_id, tenant_id=None):
            publishing.set()
            await go_on.wait()
            await super().publish(message_id, job_id, tenant_id)

    direct = make_engine(db.url("dispatcher"))
    async with freezable_forwarder(upstream_of(db.server)) as (address, flowing):
        cut_off = make_engine(f"postgresql+asyncpg://exports_dispatcher@{address}/{db.name}")
        try:
            holder = HeldDispatcher(client, Outbox(cut_off), asyncpg_dsn(db.url("dispatcher")), task_queue=queue,
                                    poll_seconds=0.2)
            holding = asyncio.create_task(holder.dispatch_once())
            await asyncio.wait_for(publishing.wait(), BOUND)
            pid = (await lock_holder(db))["pid"]
            flowing.clear()  # the partition: from now on nothing the holder sends reaches PostgreSQL, nor back
            cut_at = time.monotonic()
            go_on.set()  # its publication reaches Temporal; its mark of the row does not reach PostgreSQL

            other = OutboxDispatcher(client, Outbox(direct), asyncpg_dsn(db.url("dispatcher")), task_queue=queue,
                                     poll_seconds=0.2)
            job_ids.append(await create_job(store, tenant_id, destination_id))

            async def pass_then_rows() -> list[dict]:
                await asyncio.wait_for(other.dispatch_once(), BOUND)
                return [await outbox_row(db, job_id) for job_id in job_ids]

            rows = await eventually(pass_then_rows, lambda rows: all(r["published_at"] for r in rows),
                                    timeout=TAKEOVER_BOUND, interval=0.2,
                                    what="both outbox rows published by another dispatcher")
            assert time.monotonic() - cut_at <= TAKEOVER_BOUND
            for job_id, row in zip(job_ids, rows, strict=True):
                assert await signalled_with(client, job_id, row["message_id"])
            assert await db.admin.fetchval("SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid) == 0

            # The cut-off holder ends its pass within the bound (its statement unanswered), having marked nothing.
            with pytest.raises(LockLost):
                await asyncio.wait_for(holding, TAKEOVER_BOUND)
            assert time.monotonic() - cut_at <= TAKEOVER_BOUND

            said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == DISPATCHER_LOG]
            warnings = [m for level, m in said if level >= logging.WARNING]
            assert len(warnings) == 1 and str(pid) in warnings[0], said
            # The sessions that held the lock went back to the pool with no bound on their silence left on them.
            async with contextlib.AsyncExitStack() as pooled:
                conns = [await pooled.enter_async_context(direct.connect())
                         for _ in range(direct.pool.checkedin())]
                assert conns
                for c in conns:
                    assert (await c.exec_driver_sql("SELECT current_setting('idle_session_timeout'), "
                                                    "current_setting('idle_in_transaction_session_timeout')")
                            ).one() == ("0", "0")
            assert any("works again" in m for level, m in said if level == logging.INFO), said
        finally:
            go_on.set()
            flowing.set()
            await cut_off.dispose()
            await direct.dispose()
            for job_id in job_ids:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(client.get_workflow_handle(export_workflow_id(job_id)).terminate(
                        "test over"), 10)


@pytest.mark.spec("FG4")
@pytest.mark.parametrize("role", ["app", "reconciler"])
async def test_a_session_of_another_role_holding_the_outbox_lock_stops_dispatch_for_a_bounded_time(
        db, store, client, caplog, role):
    """Any role that may connect can take the outbox lock (its key is a constant), and only a dispatcher's own session
    bounds its silence: an idle session of the application's or the reconciler's role that took it stopped every
    dispatcher for as long as it lived, and with them every export started through the outbox. A dispatcher now
    publishes without the lock once a session of another role has held it past the bound (two dispatchers may then
    publish a row twice, which is harmless), and says so."""
    caplog.set_level(logging.WARNING, logger=DISPATCHER_LOG)
    tenant_id, destination_id = await seed_tenant(db.admin)
    squatter = await db.connect(role)
    engine = make_engine(db.url("dispatcher"))
    try:
        assert await squatter.fetchval("SELECT pg_try_advisory_lock($1)", LOCK_KEY)
        job_id = await create_job(store, tenant_id, destination_id)
        outbox = Outbox(engine, lock_idle_seconds=1)
        dispatcher = OutboxDispatcher(client, outbox, asyncpg_dsn(db.url("dispatcher")),
                                      task_queue=f"squatted-{uuid.uuid4().hex[:8]}", poll_seconds=0.2)
        started = time.monotonic()

        async def pass_then_row() -> dict:
            await asyncio.wait_for(dispatcher.dispatch_once(), BOUND)
            return await outbox_row(db, job_id)

        await eventually(pass_then_row, lambda row: row["published_at"] is not None, timeout=BOUND, interval=0.2,
                         what=f"the wake-up published with the lock held by an idle {role} session")
        waited = time.monotonic() - started
        assert waited < 10 * outbox.lock_idle_seconds, waited
        assert (await lock_holder(db))["pid"] == await squatter.fetchval("SELECT pg_backend_pid()")  # still held
        await client.get_workflow_handle(export_workflow_id(job_id)).describe()  # the run was started
        said = [r.getMessage() for r in caplog.records if r.name == DISPATCHER_LOG]
        assert any("not a dispatcher" in line for line in said), said
        # Let go: the next pass takes the lock again, as dispatchers do.
        await squatter.execute("SELECT pg_advisory_unlock($1)", LOCK_KEY)
        await create_job(store, tenant_id, destination_id)
        assert await asyncio.wait_for(dispatcher.dispatch_once(), BOUND) == 1
        said = [r.getMessage() for r in caplog.records if r.name == DISPATCHER_LOG]
        assert any(line.startswith("outbox lock taken again") for line in said), said
    finally:
        await squatter.close()
        await engine.dispose()


@pytest.mark.spec("FG4")
async def test_a_dispatcher_that_logs_in_as_a_member_of_the_dispatcher_role_is_taken_for_a_squatter(
        db, store, client, caplog):
    """docs/database.md and starter/preflight.py let a worker connect with a login role that is a member of
    exports_dispatcher (`GRANT exports_dispatcher TO <user>`; per-worker or rotated credentials, as Vault issues).
    Such a dispatcher, mid-pass (a backlog's waves while Temporal is slow), is a dispatcher whose session bounds its
    own silence, yet `ours` compares pg_stat_activity.usename with current_user: the other dispatcher calls it
    "not a dispatcher" and publishes the same backlog without the lock, side by side with it."""
    caplog.set_level(logging.WARNING, logger=DISPATCHER_LOG)
    tenant_id, destination_id = await seed_tenant(db.admin)
    login = f"exports_dispatcher_w{uuid.uuid4().hex[:8]}"
    url = make_url(db.url("dispatcher"))
    password = "" if url.password is None else " PASSWORD " + await db.admin.fetchval(
        "SELECT quote_literal($1)", url.password)
    await db.admin.execute(f'CREATE ROLE "{login}" LOGIN IN ROLE exports_dispatcher{password}')
    other_engine = make_engine(url.set(username=login).render_as_string(hide_password=False))
    engine = make_engine(db.url("dispatcher"))
    try:
        other = Outbox(other_engine, lock_idle_seconds=1)
        outbox = Outbox(engine, lock_idle_seconds=1)
        dispatcher = OutboxDispatcher(client, outbox, asyncpg_dsn(db.url("dispatcher")),
                                      task_queue=f"member-{uuid.uuid4().hex[:8]}", poll_seconds=0.2)
        job_id = await create_job(store, tenant_id, destination_id)
        # The other worker's dispatcher holds the lock through a pass of several waves, speaking to its session
        # as a healthy holder does (never silent for a quarter of the bound).
        async with other.dispatch_pass() as held:
            assert held is not None and held.locked
            assert await db.admin.fetchval("SELECT pg_has_role($1, 'exports_dispatcher', 'MEMBER')", login)
            deadline = time.monotonic() + 4 * other.lock_idle_seconds
            while time.monotonic() < deadline:
                await held.still_held()
                await asyncio.wait_for(dispatcher.dispatch_once(), BOUND)
                await asyncio.sleep(0.2)
            published = (await outbox_row(db, job_id))["published_at"]
        said = [r.getMessage() for r in caplog.records if r.name == DISPATCHER_LOG and "not a dispatcher" in
                r.getMessage()]
        assert (published, said) == (None, []), (
            "a dispatcher of the dispatcher role (by membership) held the outbox lock mid-pass, and the other "
            f"dispatcher published beside it without the lock: published_at={published}, logged {said}")
    finally:
        await other_engine.dispose()
        await engine.dispose()
        await db.admin.execute(f'DROP ROLE IF EXISTS "{login}"')
