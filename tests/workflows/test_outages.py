"""Outages that lose nothing (matrix OU2), with a real worker process, the Temporal dev server and PostgreSQL:
both are unreachable when the worker starts, and come back later."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from activities import checkpoints
from activities.checkpoints import Checkpoints
from activities.process.dispatcher import OutboxDispatcher
from starter.localstack.ports import free_port
from starter.localstack.temporal import LocalTemporal
from store.db import asyncpg_dsn, make_engine
from store.models import Status
from store.outbox import Outbox
from tests.helpers.crash import crash_world, processes, recorded_for, recover_on, recovery_only_worker, start_worker
from tests.helpers.events import events
from tests.helpers.faults import fault_proxy
from tests.helpers.harness import WorkerProcess, held_at, open_harness, release_held, run_recovery
from tests.helpers.lease import LEASE
from tests.helpers.partner import assert_partner_holds, outbound_names
from tests.helpers.support import create_job, eventually, seed_tenant

BOUND = 60.0
# What sdk-core logs when it stops retrying an activity's completion because the server cannot be reached.
COMPLETION_DROPPED = "Network error while completing activity"


@contextlib.asynccontextmanager
async def forwarder(port: int, target: str) -> AsyncIterator[None]:
    """A plain TCP forwarder on 127.0.0.1:port to `target` (host:port): Temporal is reachable while it runs."""
    host, target_port = target.rsplit(":", 1)

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def accept(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection(host, int(target_port))
        await asyncio.gather(pipe(client_r, server_w), pipe(server_r, client_w))

    server = await asyncio.start_server(accept, "127.0.0.1", port)
    try:
        yield
    finally:
        server.close()


@pytest.mark.spec("OU2")
async def test_a_worker_started_while_postgresql_and_temporal_are_away_waits_and_then_works(
        db, store, client, tmp_path):
    temporal_port = free_port()
    async with crash_world(db, store, client, tmp_path) as h, processes(h) as started, \
            fault_proxy(db.server) as pg:
        pg.refuse_new_connections()
        # A file left in the work directory: the scavenger asks PostgreSQL about it as the worker starts.
        work = Path(h.settings.work_dir)
        work.mkdir(parents=True, exist_ok=True)
        (work / f"{uuid.uuid4()}-{uuid.uuid4()}-ab12.csv").write_text("email\n")
        worker = await WorkerProcess(h.settings, temporal_address=f"127.0.0.1:{temporal_port}",
                                     database_url=pg.url("exports_app", db.name)).start()
        started.append(worker)
        # Nothing answers on Temporal's port: the worker says so, once a try, and waits.
        log = await eventually(lambda: asyncio.sleep(0, worker.log_path.read_text()),
                               lambda text: text.count("trying again in") >= 2, timeout=BOUND, interval=0.2,
                               what="the worker retrying Temporal")
        assert worker.process.returncode is None and "Traceback" not in log
        target = client.service_client.config.target_host
        async with forwarder(temporal_port, target):
            await eventually(lambda: asyncio.sleep(0, worker.log_path.read_text()),
                             lambda text: "polling" in text, timeout=BOUND, interval=0.2,
                             what="the worker polling once Temporal answered")
            assert pg.refused >= 1  # the worker did ask PostgreSQL (its scavenger) while it was away
            job_id = await h.create()  # written directly; the worker's dispatcher cannot reach the outbox yet
            await asyncio.sleep(1.0)
            assert (await h.store.read_job(job_id)).status is Status.QUEUED
            pg.accept_new_connections()
            row = await eventually(lambda: h.store.read_job(job_id), lambda r: r.status.is_settled,
                                   timeout=BOUND, interval=0.2, what="the export settled")
            assert row.status is Status.COMPLETED
            assert worker.process.returncode is None
        # Its start said one line per try and nothing else (the steps that failed while PostgreSQL was away are
        # logged by the SDK, with their tracebacks: that is issue OU6's, not this one's).
        start = worker.log_path.read_text().split("polling", 1)[0]
        assert "Traceback" not in start and start.count("trying again in") >= 2


async def postgres_away_from_the_first_write(h, pg) -> tuple[asyncio.Event, asyncio.Event]:
    """A read-back contract, and the worker's PostgreSQL (through `pg`) gone from the upload's first write on: the
    outage's start, and the rename's (which waits for the database: its fence is a write on the row)."""
    await h.db.admin.execute("UPDATE destinations SET hash_evidence = 'read_back' WHERE id = $1", h.destination_id)
    outage, renamed = asyncio.Event(), asyncio.Event()

    async def cut_on_first_write(path: str, offset: int) -> None:
        if not outage.is_set():
            outage.set()
            pg.refuse_new_connections()
            pg.cut_all()

    async def note_rename(old: str, new: str) -> None:
        renamed.set()

    h.partner.hooks.on_write, h.partner.hooks.after_rename = cut_on_first_write, note_rename
    return outage, renamed


@pytest.mark.spec("OU3")
async def test_an_upload_that_finishes_during_a_postgresql_outage_is_recorded_with_its_evidence_afterwards(
        db, store, client, tmp_path):
    """PostgreSQL goes away as the upload begins and stays away for three leases: the rename waits for it (its
    fence is a write on the row), then the receipt and the terminal write, in order, and the delivered file ends
    Completed by sha256, recorded by the attempt itself (no recovery runs here)."""
    async with crash_world(db, store, client, tmp_path, upload_throttle_bytes_per_second=8000) as h, \
            processes(h) as started, fault_proxy(db.server) as pg:
        outage, renamed = await postgres_away_from_the_first_write(h, pg)
        worker = await WorkerProcess(h.settings, database_url=pg.url("exports_app", db.name)).start()
        started.append(worker)
        job_id = await h.create()
        await asyncio.wait_for(outage.wait(), timeout=BOUND)
        await asyncio.sleep(3 * LEASE)  # the upload is done; the lease lapses meanwhile
        assert pg.refused >= 1  # the worker did try: renewals, evidence, the rename fence
        assert not renamed.is_set()  # no rename without its fence
        assert (await h.store.read_job(job_id)).status is Status.DELIVERING
        pg.accept_new_connections()
        row = await eventually(lambda: h.store.read_job(job_id), lambda r: r.status.is_settled,
                               timeout=BOUND, interval=0.2, what="the export settled")

    assert (row.status, row.confirmed_by) == (Status.COMPLETED, "sha256")
    evts = await db.admin.fetch("SELECT kind, detail FROM export_attempt_events WHERE job_id = $1 AND "
                                "attempt_id = $2 ORDER BY id", job_id, row.attempt_id)
    steps = [json.loads(e["detail"])["step"] if e["kind"] == "DeliveryEvidence" else e["kind"] for e in evts]
    # Every record the outage held back, in the order observed, and all of them before the terminal write.
    assert steps == ["Claimed", "BuildStarted", "DeliveryAuthorized", "baseline", "rename", "receipt",
                     "Finished"], steps
    log = worker.log_path.read_text()
    # The rename waited at its fence for the database, one line a try, and nothing failed.
    assert "the rename fence of" in log and log.count("Traceback") == 0, log[-3000:]


@pytest.mark.spec("OU3")
async def test_an_outage_past_the_lease_with_recovery_running_ends_a_delivered_file_completed(
        db, store, client, tmp_path):
    """The worker alone is cut off from PostgreSQL as its upload begins, for well past its lease, while recovery,
    which still reaches the database, runs again and again: it takes the attempt back once the lease lapses (its
    upload waits at its rename fence), once, never OutcomeUnknown for want of a renewal. Back, the worker is refused
    at its fence, never renames, writes its evidence, and its terminal write matches nothing; a new attempt
    delivers the file."""
    async with crash_world(db, store, client, tmp_path, upload_throttle_bytes_per_second=8000) as h, \
            processes(h) as started, fault_proxy(db.server) as pg, recovery_only_worker(h) as recovery_queue:
        outage, renamed = await postgres_away_from_the_first_write(h, pg)
        worker = await WorkerProcess(h.settings, database_url=pg.url("exports_app", db.name)).start()
        started.append(worker)
        job_id = await h.create()
        await asyncio.wait_for(outage.wait(), timeout=BOUND)
        recorded: list[str | None] = []
        outage_ends = time.monotonic() + 5 * LEASE
        while time.monotonic() < outage_ends:  # recovery every half lease, all through the outage
            recorded += recorded_for(await recover_on(h, recovery_queue), job_id)
            await asyncio.sleep(LEASE / 2)
        assert recorded == ["RequeuedByRecovery"], recorded  # taken back once the lease lapsed, once
        assert pg.refused >= 1 and not renamed.is_set()
        first = await db.admin.fetchval("SELECT attempt_id FROM export_attempt_events WHERE job_id = $1 "
                                        "AND kind = 'RequeuedByRecovery'", job_id)
        pg.accept_new_connections()
        await eventually(lambda: asyncio.sleep(0, worker.log_path.read_text()),
                         lambda text: "matched nothing" in text, timeout=BOUND, interval=0.2,
                         what="the worker's terminal write, back from the outage")
        row = await eventually(lambda: h.store.read_job(job_id), lambda r: r.status.is_settled,
                               timeout=BOUND, interval=0.2, what="the export settled by a new attempt")

    assert (row.status, row.confirmed_by) == (Status.COMPLETED, "sha256") and row.attempt_id != first, row
    assert_partner_holds(h.partner, row, only=True)
    # The first attempt's baseline came before the outage; the rest of its evidence, written after the database
    # came back, is kept without a holder (the attempt no longer held the row), and it never renamed.
    evidence = await db.admin.fetch("SELECT detail, worker_id FROM export_attempt_events WHERE job_id = $1 AND "
                                    "attempt_id = $2 AND kind = 'DeliveryEvidence' ORDER BY id", job_id, first)
    steps = [(json.loads(e["detail"])["step"], e["worker_id"] is not None) for e in evidence]
    assert steps[0] == ("baseline", True) and ("fresh_listing", False) in steps, steps
    assert "rename" not in [step for step, _ in steps] and "receipt" not in [step for step, _ in steps], steps
    assert "Finished" not in [e["kind"] for e in await events(db, job_id) if e["attempt_id"] == first]


@contextlib.asynccontextmanager
async def silent_temporal() -> AsyncIterator[tuple[str, list[int]]]:
    """An address that accepts connections and never answers: Temporal hung, as the dispatcher sees it."""
    accepted: list[int] = []
    held: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        held.append(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}", accepted
    finally:
        for writer in held:
            writer.close()
        server.close()


@pytest.mark.spec("OU4")
async def test_the_dispatcher_holds_no_row_lock_while_temporal_does_not_answer(db, store):
    tenant_id, destination_id = await seed_tenant(db.admin)
    for _ in range(5):
        await create_job(store, tenant_id, destination_id)
    engine = make_engine(db.url("dispatcher"))
    async with silent_temporal() as (address, accepted):
        temporal = await Client.connect(address, lazy=True, data_converter=pydantic_data_converter)
        dispatcher = OutboxDispatcher(temporal, Outbox(engine), asyncpg_dsn(db.url("dispatcher")),
                                      task_queue="exports-ou4", poll_seconds=0.2)
        try:
            dispatching = asyncio.create_task(dispatcher.dispatch_once())
            await eventually(lambda: asyncio.sleep(0, len(accepted)), bool, timeout=BOUND, interval=0.05,
                             what="the dispatcher waiting on Temporal")
            # Meanwhile every unpublished row can be locked at once: no dispatcher holds one while it waits.
            async with db.admin.transaction():
                locked = await db.admin.fetch("SELECT message_id FROM outbox WHERE published_at IS NULL "
                                              "FOR UPDATE NOWAIT")
            assert len(locked) == 5
            # And a Temporal that does not answer ends the pass after one publication, not one per row.
            published = await asyncio.wait_for(dispatching, timeout=BOUND)
        finally:
            await engine.dispose()
    assert published == 0
    assert await db.admin.fetchval("SELECT count(*) FROM outbox WHERE published_at IS NULL") == 5


@pytest.mark.spec("OU4")
async def test_a_build_that_finished_while_temporal_was_down_is_not_built_again(db, store, tmp_path):
    """The Temporal server stops as a build runs and starts again (on its database file) more than a lease after the
    build finished: the completion was never reported, the build's heartbeat times out, and the resumption on the
    same worker delivers the file that build finished rather than reading the contacts again.

    The lease is longer than the suite's: the steps after the build wait one lease for the worker's own queue, and
    after an outage the worker's pollers come back only as their backoff allows (sdk-core doubles a failed poll's
    wait from 0.2 s up to 10 s): with a 2 s lease, cutoff 2 could time out before the live worker polled again."""
    lease = 6.0
    temporal = LocalTemporal(tmp_path / "temporal", ui_port=free_port())
    await temporal.start()
    try:
        own = await Client.connect(temporal.address, data_converter=pydantic_data_converter)
        async with crash_world(db, store, own, tmp_path, lease_seconds=lease) as h, processes(h) as started:
            worker = await start_worker(started, h, hold_at="build_started", temporal_address=temporal.address)
            job_id = await h.create()
            await held_at(h.settings, "build_started", job_id, timeout=BOUND)
            await temporal.stop()
            stopped_at = time.monotonic()
            release_held(h.settings, "build_started", job_id)
            # The build (200 contacts) finishes, and the SDK tries to report it for about 10 s more (after its last
            # heartbeat's own retries). A server back before it gives up takes the completion, and this case never
            # happens: so the server stays away until the worker's log says the completion was dropped.
            await eventually(lambda: asyncio.sleep(0, worker.log_path.read_text(errors="replace")),
                             lambda text: COMPLETION_DROPPED in text, timeout=BOUND, interval=0.2,
                             what="the SDK giving up on reporting the build's completion")
            # What a second build would read, and the first did not.
            await h.db.admin.execute("UPDATE contacts SET first_name = 'Rebuilt' WHERE tenant_id = $1", h.tenant_id)
            await asyncio.sleep(max(0.0, stopped_at + lease + 2.0 - time.monotonic()))  # past the heartbeat timeout
            await temporal.start()
            row = await h.settled(job_id)
            assert worker.process.returncode is None
        assert row.status is Status.COMPLETED, row
        delivered = (h.partner.root / "outbound" / row.final_name).read_bytes()
        assert b"Rebuilt" not in delivered and delivered.count(b"\n") == 201
        builds = [e for e in await events(h.db, job_id) if e["kind"] == "BuildStarted"]
        assert len(builds) == 2 and "finished" in builds[1]["detail"], builds
    finally:
        await temporal.stop()


@pytest.fixture
def tiny_work_dir(tmp_path: Path):
    """The worker's work directory on a real 64 KiB file system (tmpfs), so that a build meets a full disk."""
    work = tmp_path / "work"
    work.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(work)], capture_output=True)
    if mounted.returncode != 0:
        why = f"cannot mount a small file system here: {mounted.stderr.decode().strip()}"
        if os.geteuid() == 0:
            pytest.fail(why)  # root that cannot mount is a machine that hides this case: say so, loudly
        pytest.skip(why)  # listed in the summary (-rs) with its reason
    try:
        yield work
    finally:
        subprocess.run(["umount", "-l", str(work)], check=False)


@pytest.mark.spec("OU5")
async def test_a_build_that_finds_the_disk_full_is_retried_and_says_why(db, store, client, tmp_path, tiny_work_dir,
                                                                       caplog):
    filler = tiny_work_dir / "another-build-holds-this-space"
    filler.write_bytes(b"x" * 56 * 1024)  # what is left cannot hold 200 contacts (about 18 KB)
    async with AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path, contacts=200)
        with caplog.at_level(logging.WARNING):
            job_id = await h.create()
            await eventually(lambda: asyncio.sleep(0, caplog.text), lambda text: "No space left" in text,
                             timeout=BOUND, interval=0.1, what="the worker saying the disk is full")
            assert (await h.store.read_job(job_id)).status is Status.RUNNING  # not BuildFailed: waiting
            filler.unlink()  # the other build's file is gone
            row = await h.settled(job_id)
    assert row.status is Status.COMPLETED, row
    assert (h.partner.root / "outbound" / row.final_name).read_bytes().count(b"\n") == 201


@pytest.mark.spec("OU6")
async def test_sigterm_hands_back_a_build_which_resumes_elsewhere_without_waiting_out_the_lease(
        db, store, client, tmp_path):
    lease = 30.0  # long, so that waiting it out would show
    async with crash_world(db, store, client, tmp_path, lease_seconds=lease, renew_every_seconds=1.0) as h, \
            processes(h) as started:
        leaving = await start_worker(started, h, hold_at="build_started")
        job_id = await h.create()
        await held_at(h.settings, "build_started", job_id, timeout=BOUND)
        staying = await start_worker(started, h)
        began = time.monotonic()
        leaving.process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(leaving.process.wait(), timeout=lease / 2)
        row = await eventually(lambda: h.store.read_job(job_id), lambda r: r.status.is_settled,
                               timeout=lease / 2, interval=0.2, what="the export settled")
        took = time.monotonic() - began
        assert staying.process.returncode is None
    assert row.status is Status.COMPLETED and row.attempt_count == 1, row
    assert took < lease / 2
    builds = [e for e in await events(h.db, job_id) if e["kind"] == "BuildStarted"]
    # Resumed by the worker that stayed (worker IDs name the process: host-pid-suffix).
    assert len(builds) == 2 and f"-{staying.process.pid}-" in builds[1]["worker_id"], builds
    assert leaving.process.returncode == 0
    log = leaving.log_path.read_text()
    assert "handed back" in log and "Traceback" not in log, log[-3000:]


@pytest.mark.spec("LV6", "OU6")
async def test_sigterm_hands_back_a_built_attempt_whose_next_step_has_not_started(db, store, client, tmp_path):
    """Built, its lease handed over to cutoff 2, which has not begun on this worker (held at its start) when the
    worker gets SIGTERM: the attempt is handed back (its lease ends at once), so recovery requeues it at its next
    run and another worker delivers it, rather than a lease later."""
    lease = 30.0  # long, so that waiting it out would show
    hold = "before:authorize_delivery"
    async with crash_world(db, store, client, tmp_path, lease_seconds=lease, renew_every_seconds=1.0) as h, \
            processes(h) as started:
        leaving = await start_worker(started, h, hold_at=hold, shutdown_grace_seconds=1.0)
        job_id = await h.create()
        await held_at(h.settings, hold, job_id, timeout=BOUND)
        first = (await h.store.read_job(job_id)).attempt_id
        began = time.monotonic()
        leaving.process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(leaving.process.wait(), timeout=lease / 2)
        await eventually(lambda: h.db.admin.fetchval(
            "SELECT lease_expires_at <= clock_timestamp() FROM export_jobs WHERE id = $1", job_id), bool,
            timeout=2.0, interval=0.1, what="the lease ended by the worker that left")
        assert time.monotonic() - began < lease / 2
        await start_worker(started, h)
        report = await asyncio.wait_for(run_recovery(h.client, h.settings), timeout=BOUND)
        assert [t.recorded for t in report.taken_over if t.job_id == job_id] == ["RequeuedByRecovery"]
        row = await h.settled(job_id)
    assert row.status is Status.COMPLETED and row.attempt_count == 2, row
    assert [e["kind"] for e in await events(h.db, job_id) if e["attempt_id"] == first] == [
        "Claimed", "BuildStarted", "RequeuedByRecovery"]
    log = leaving.log_path.read_text()
    assert "handed back" in log and "Traceback" not in log, log[-3000:]


@pytest.mark.spec("LV6", "LD2")
async def test_sigterm_hands_back_an_attempt_waiting_for_an_upload_slot(db, store, client, tmp_path):
    """One upload slot, held by a slow upload; a second export built and waiting at cutoff 2 for the slot when the
    worker gets SIGTERM. The waiting attempt authorizes nothing and is handed back at once (its lease ends), while
    the upload in flight ends within the grace; another worker then delivers the second export."""
    lease = 30.0  # long, so that waiting it out would show
    async with crash_world(db, store, client, tmp_path, lease_seconds=lease, renew_every_seconds=1.0,
                           upload_throttle_bytes_per_second=6000) as h, processes(h) as started:
        # Both exports on this worker at once (its share for the one destination), one upload at a time.
        leaving = await start_worker(started, h, max_uploads=1, max_per_destination=2, shutdown_grace_seconds=20.0)
        uploading = await h.create()
        await eventually(lambda: h.store.read_job(uploading), lambda r: r.status is Status.DELIVERING,
                         timeout=BOUND, interval=0.1, what="the first export uploading")
        waiting = await h.create()
        await eventually(lambda: asyncio.sleep(0, leaving.log_path.read_text()),
                         lambda text: f"export {waiting}" in text and "waits for a free upload slot" in text,
                         timeout=BOUND, interval=0.1, what="the second export waiting for the upload slot")
        first = (await h.store.read_job(waiting)).attempt_id
        leaving.process.send_signal(signal.SIGTERM)
        await eventually(lambda: h.db.admin.fetchval(
            "SELECT lease_expires_at <= clock_timestamp() FROM export_jobs WHERE id = $1", waiting), bool,
            timeout=5.0, interval=0.1, what="the waiting attempt's lease ended by the worker that leaves")
        await asyncio.wait_for(leaving.process.wait(), timeout=lease)
        assert (await h.store.read_job(uploading)).status is Status.COMPLETED  # the upload in flight ended
        await start_worker(started, h)
        report = await asyncio.wait_for(run_recovery(h.client, h.settings), timeout=BOUND)
        assert [t.recorded for t in report.taken_over if t.job_id == waiting] == ["RequeuedByRecovery"]
        row = await h.settled(waiting)
    assert row.status is Status.COMPLETED and row.attempt_count == 2, row
    assert [e["kind"] for e in await events(h.db, waiting) if e["attempt_id"] == first] == [
        "Claimed", "BuildStarted", "RequeuedByRecovery"]
    log = leaving.log_path.read_text()
    assert "handed back while it waited" in log and "Traceback" not in log, log[-3000:]


@pytest.mark.spec("OU6")
async def test_a_step_retried_through_a_postgresql_outage_logs_one_line_a_try_not_a_traceback(
        db, store, client, tmp_path):
    async with crash_world(db, store, client, tmp_path) as h, processes(h) as started, \
            fault_proxy(db.server) as pg:
        # The activities reach PostgreSQL through the proxy; the dispatcher directly, so the wake-up goes out.
        worker = await WorkerProcess(h.settings, database_url=pg.url("exports_app", db.name)).start()
        started.append(worker)
        await eventually(lambda: asyncio.sleep(0, worker.log_path.read_text()), lambda text: "polling" in text,
                         timeout=BOUND, interval=0.2, what="the worker polling")
        pg.refuse_new_connections()
        pg.cut_all()
        job_id = await h.create()
        await eventually(lambda: asyncio.sleep(0, worker.log_path.read_text()),
                         lambda text: text.count("Completing activity as failed") >= 2, timeout=BOUND,
                         interval=0.2, what="a step failing and retried")
        pg.accept_new_connections()
        row = await eventually(lambda: h.store.read_job(job_id), lambda r: r.status.is_settled,
                               timeout=BOUND, interval=0.2, what="the export settled")
    assert row.status is Status.COMPLETED
    log = worker.log_path.read_text()
    failures = [line for line in log.splitlines() if "Completing activity as failed" in line]
    assert failures and all("Connect" in line or "refused" in line or "Error" in line for line in failures)
    assert "Traceback" not in log, log[-3000:]


@pytest.mark.spec("OU6")
async def test_sigterm_during_an_upload_lets_it_end_and_then_exits(db, store, client, tmp_path):
    async with crash_world(db, store, client, tmp_path, upload_throttle_bytes_per_second=8000,
                           shutdown_grace_seconds=10.0) as h, processes(h) as started:
        worker = await WorkerProcess(h.settings).start()
        started.append(worker)
        uploading = asyncio.Event()

        async def first_write(path: str, offset: int) -> None:
            uploading.set()

        h.partner.hooks.on_write = first_write
        job_id = await h.create()
        await asyncio.wait_for(uploading.wait(), timeout=BOUND)
        began = time.monotonic()
        worker.process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(worker.process.wait(), timeout=10.0 + 5 + 5)
        took = time.monotonic() - began
        row = await h.store.read_job(job_id)
    assert row.status is Status.COMPLETED, row  # the upload (about 2 s) ended before the worker left
    assert took < 10.0 + 5
    assert worker.process.returncode == 0
    log = worker.log_path.read_text()
    assert "stops taking tasks" in log and "Traceback" not in log, log[-3000:]


@pytest.mark.spec("LV8")
async def test_a_build_whose_database_connection_is_cut_is_built_again_and_completes(db, store, client, tmp_path):
    """The connection of the build's COPY is cut as the COPY is sent (a network blip, a server restart): a
    transient fault, so the build tries again within its attempt and the export ends Completed, not BuildFailed."""
    async with fault_proxy(db.server) as proxy, AsyncExitStack() as stack:
        cut = proxy.cut_before("COPY (SELECT id, email")
        h = await open_harness(stack, db, store, client, tmp_path,
                               database_url=proxy.url("exports_app", db.name))
        job_id = await h.create()
        row = await h.settled(job_id)
    assert cut.is_set()
    assert (row.status, row.failure_reason, row.attempt_count) == (Status.COMPLETED, None, 1)
    builds = [e for e in await events(db, job_id) if e["kind"] == "BuildStarted"]
    assert len(builds) == 1  # tried again inside the build, not by a resumption


class _CutAtUpload(Checkpoints):
    """Arms a cut of the next read of the destination once cutoff 2 has committed: the delivery's first reads."""

    def __init__(self, proxy) -> None:  # type: ignore[no-untyped-def]
        self.proxy = proxy
        self.cut: asyncio.Event | None = None

    async def reached(self, name: str, job_id: uuid.UUID) -> None:
        if name == checkpoints.BEFORE_UPLOAD and self.cut is None:
            self.cut = self.proxy.cut_before("FROM destinations")


@pytest.mark.spec("LV8")
async def test_a_delivery_whose_first_read_is_cut_reads_again_and_completes(db, store, client, tmp_path):
    """Cutoff 2 has committed and the delivery's read of its destination loses its connection (nothing has been
    sent): a transient fault, so the read is tried again and the export ends Completed, not OutcomeUnknown."""
    async with fault_proxy(db.server) as proxy, AsyncExitStack() as stack:
        h = await open_harness(stack, db, store, client, tmp_path,
                               database_url=proxy.url("exports_app", db.name))
        assert h.activities is not None
        h.activities.checkpoints = cutting = _CutAtUpload(proxy)
        job_id = await h.create()
        row = await h.settled(job_id)
    assert cutting.cut is not None and cutting.cut.is_set()
    assert (row.status, row.attempt_count) == (Status.COMPLETED, 1)
    assert outbound_names(h.partner) == [row.final_name]
