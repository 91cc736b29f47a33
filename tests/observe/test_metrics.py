"""The worker's HTTP port: Prometheus metrics (its own and the SDK's), /livez and /readyz, on real worker
processes against the real PostgreSQL, Temporal dev server and SFTP partner."""

from __future__ import annotations

import asyncio
import signal
import socket
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from activities.process import endpoint, metrics
from store.db import asyncpg_dsn
from store.models import CancellationOutcome, Status
from tests.helpers.harness import Harness, WorkerProcess, held_at, open_harness, release_held
from tests.helpers.support import eventually
from worker import running_worker

HTTP_TIMEOUT = 5.0


async def get(port: int, path: str) -> tuple[int, str]:
    """One GET on the loopback; (0, why) when nothing answers, so that a probe can poll through a start."""
    try:
        async with asyncio.timeout(HTTP_TIMEOUT):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
            await writer.drain()
            raw = await reader.read()
            writer.close()
    except (OSError, TimeoutError) as exc:
        return 0, f"{type(exc).__name__}: {exc}"
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of a scrape; parsing it all also proves the joined text is one valid exposition."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(found: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float:
    return found.get((name, frozenset(labels.items())), 0.0)


async def scrape(port: int) -> tuple[dict[tuple[str, frozenset], float], str]:
    status, text = await get(port, "/metrics")
    assert status == 200, text
    return samples(text), text


@asynccontextmanager
async def world(db, store, client, tmp_path: Path, **overrides: object) -> AsyncIterator[Harness]:
    """A tenant and a partner; the test starts the worker processes."""
    async with AsyncExitStack() as stack:
        yield await open_harness(stack, db, store, client, tmp_path, in_process_worker=False, **overrides)


@asynccontextmanager
async def worker_process(h: Harness, **overrides: object) -> AsyncIterator[WorkerProcess]:
    """A worker process with its HTTP port on the loopback, always ended by its PID on the way out."""
    port = endpoint.free_loopback_port()
    process = await WorkerProcess(h.settings, http_port=port, http_bind_address="127.0.0.1",
                                  metrics_refresh_seconds=0.5, **overrides).start()
    process.port = port
    try:
        yield process
    except BaseException:
        if process.log_path.exists():
            print("\n".join(process.log_path.read_text(errors="replace").splitlines()[-60:]))
        raise
    finally:
        process.kill()
        if process.process is not None:
            await asyncio.wait_for(process.process.wait(), timeout=15)


async def polling(port: int) -> None:
    await eventually(lambda: get(port, "/readyz"), lambda r: r[0] == 200, timeout=60, interval=0.2,
                     what="/readyz answers 200")


async def test_one_export_moves_the_domain_counters_and_the_sdk_metrics_are_served(db, store, client, tmp_path):
    async with world(db, store, client, tmp_path) as h, worker_process(h) as worker:
        await polling(worker.port)
        before, _ = await scrape(worker.port)

        job_id = await h.create()
        assert (await h.settled(job_id)).status is Status.COMPLETED

        # The gauges are read in the background: wait for a read after the export ended.
        after, text = await eventually(lambda: scrape(worker.port),
                                       lambda r: value(r[0], "exports_outbox_backlog") == 0
                                       and value(r[0], "exports_metrics_store_read_timestamp_seconds") > 0,
                                       timeout=20, interval=0.5, what="the store gauges read")
    assert value(after, "exports_ended_total", status="Completed") == \
        value(before, "exports_ended_total", status="Completed") + 1
    assert value(after, "exports_upload_bytes_count") == value(before, "exports_upload_bytes_count") + 1
    assert value(after, "exports_upload_bytes_sum") > value(before, "exports_upload_bytes_sum")
    assert value(after, "exports_build_bytes_count") == value(before, "exports_build_bytes_count") + 1
    assert value(after, "exports_build_seconds_count") == value(before, "exports_build_seconds_count") + 1
    assert value(after, "exports_delivery_seconds_count", outcome="Completed") == \
        value(before, "exports_delivery_seconds_count", outcome="Completed") + 1
    assert value(after, "exports_jobs", status="OutcomeUnknown") == 0
    # No duplicate of exports_jobs{status="OutcomeUnknown"}, no `_created` series.
    assert not any(name == "exports_outcome_unknown" or name.endswith("_created") for name, _ in after)
    assert value(after, "exports_metrics_store_read_failures_total") == 0
    # The SDK's own, appended from its endpoint: the worker's polls and the workflow's completion.
    sdk = {name for name, _ in after if name.startswith("temporal_")}
    assert sdk, text[-2000:]
    assert any(name.startswith("temporal_workflow_completed") for name in sdk), sorted(sdk)
    # The SDK's names as configured: counters end in `_total`, durations are in seconds.
    assert "temporal_workflow_completed_total" in sdk and "temporal_request_total" in sdk, sorted(sdk)
    assert "temporal_workflow_completed" not in sdk, sorted(sdk)
    latency = [v for (n, labels), v in after.items() if n == "temporal_workflow_endtoend_latency_sum"]
    count = [v for (n, labels), v in after.items() if n == "temporal_workflow_endtoend_latency_count"]
    assert latency and count and sum(latency) / sum(count) < 60, (latency, count)  # seconds, not milliseconds


async def test_readyz_is_503_until_temporal_answers_and_after_sigterm_while_the_worker_drains(
        db, store, client, tmp_path):
    async with world(db, store, client, tmp_path, shutdown_grace_seconds=30.0) as h:
        # Temporal not reachable: nothing listens on this port. The process lives, but does not poll.
        nowhere = f"127.0.0.1:{endpoint.free_loopback_port()}"
        async with worker_process(h, temporal_address=nowhere) as unreachable:
            await eventually(lambda: get(unreachable.port, "/livez"), lambda r: r[0] == 200, timeout=30,
                             interval=0.1, what="/livez answers")
            assert (await get(unreachable.port, "/readyz"))[0] == 503
            await asyncio.sleep(2.0)  # a few connection tries later: still not ready, still alive
            assert (await get(unreachable.port, "/readyz")) == (503, "not polling yet\n")
            assert (await get(unreachable.port, "/livez"))[0] == 200

        # Reachable: ready once polling. An upload held in flight keeps the drain going after SIGTERM.
        async with worker_process(h, hold_at="before_upload") as worker:
            await polling(worker.port)
            job_id = await h.create()
            await held_at(worker.settings, "before_upload", job_id)
            worker.process.send_signal(signal.SIGTERM)
            assert await eventually(lambda: get(worker.port, "/readyz"), lambda r: r[0] == 503, timeout=10,
                                    interval=0.1, what="/readyz 503 after SIGTERM") == (503, "stopping\n")
            assert (await get(worker.port, "/livez"))[0] == 200
            assert worker.process.returncode is None  # still draining: the upload has not ended
            release_held(worker.settings, "before_upload", job_id)
            assert await asyncio.wait_for(worker.process.wait(), timeout=40) == 0


async def test_the_application_role_reads_the_store_gauges(quiet_harness):
    h = quiet_harness
    # No dispatcher: the creations' outbox rows stay unpublished.
    await h.store_create()
    canceled = await h.store_create()
    # As `exports cancel` writes it, with no worker to count it: only the gauge by state can show it.
    result = await h.store.request_cancellation(tenant_id=h.tenant_id, job_id=canceled, request_id=uuid.uuid4(),
                                                requested_by="ops@example.com", reason=None)
    assert result.outcome is CancellationOutcome.CANCELED_WHILE_QUEUED
    await metrics.read_store_gauges(asyncpg_dsn(h.settings.database_url))
    assert metrics.OUTBOX_BACKLOG._value.get() == 2
    assert metrics.OUTBOX_OLDEST._value.get() >= 0
    by_state = {status.value: metrics.JOBS.labels(status=status.value)._value.get() for status in Status}
    assert by_state == {**dict.fromkeys(by_state, 0), "Queued": 1, "Canceled": 1}


async def test_a_failing_store_read_is_counted_and_never_raised():
    failures = metrics.STORE_READ_FAILURES._value.get()
    nowhere = f"postgresql://nobody@127.0.0.1:{endpoint.free_loopback_port()}/nothing"
    reader = asyncio.create_task(metrics.keep_reading_store_gauges(nowhere, every=0.1))
    try:
        await eventually(lambda: asyncio.sleep(0, metrics.STORE_READ_FAILURES._value.get()),
                         lambda n: n >= failures + 2, timeout=20, what="failed reads counted")
        assert not reader.done()
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)


async def test_a_taken_port_costs_the_probes_never_the_worker(db):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        settings = db.settings(http_port=taken.getsockname()[1], http_bind_address="127.0.0.1")
        observing = endpoint.Observing(settings, asyncio.Event())
        await observing.serve()  # logs the refusal, raises nothing
        try:
            assert observing.server is None and observing.tasks == []
        finally:
            await observing.close()


@asynccontextmanager
async def probes(db, stopping: asyncio.Event) -> AsyncIterator[endpoint.Observing]:
    """The worker's HTTP server, in-process, on a free port."""
    settings = db.settings(http_port=endpoint.free_loopback_port(), http_bind_address="127.0.0.1",
                           metrics_refresh_seconds=60)
    observing = endpoint.Observing(settings, stopping)
    await observing.serve()
    try:
        yield observing
    finally:
        await observing.close()


async def test_the_probes_follow_a_real_worker_that_stops_polling_or_loses_its_dispatcher(db, client, tmp_path):
    """A worker that stops polling after its start is no longer ready; a dispatcher that ended unasked makes the
    process not alive, so that Kubernetes restarts it."""
    settings = db.settings(task_queue=f"probes-{tmp_path.name}", work_dir=str(tmp_path / "work"))
    async with probes(db, asyncio.Event()) as observing, \
            running_worker(settings, client, health=observing.health):
        port = observing.settings.http_port
        await polling(port)
        assert await get(port, "/livez") == (200, "ok\n")
        shared, own, admission = observing.health.workers
        await asyncio.wait_for(own.shutdown(), 30)  # its own queue only: the shared one still polls
        assert await get(port, "/readyz") == (503, "not polling\n")
        assert await get(port, "/livez") == (200, "ok\n")

        dispatcher = observing.health.dispatcher
        assert dispatcher is not None and not dispatcher.done()
        dispatcher.cancel()
        await asyncio.gather(dispatcher, return_exceptions=True)
        assert await get(port, "/livez") == (503, "the outbox dispatcher stopped\n")
        assert await get(port, "/readyz") == (503, "the outbox dispatcher stopped\n")


async def test_the_probes_follow_the_worker_state(db):
    """In-process, the same server the worker runs: 503 until polling, 200 while polling, 503 once stopping;
    /livez throughout, an unknown path 404, a malformed request answered and the server still serving."""
    stopping = asyncio.Event()

    class Polling:
        is_running = True

    async with probes(db, stopping) as observing:
        port = observing.settings.http_port
        assert await get(port, "/readyz") == (503, "not polling yet\n")
        observing.health.workers = (Polling(),)
        assert await get(port, "/readyz") == (200, "polling\n")
        observing.health.fatal = "PollError: namespace gone"
        assert await get(port, "/readyz") == (503, "a Temporal worker failed: PollError: namespace gone\n")
        assert await get(port, "/livez") == (503, "a Temporal worker failed: PollError: namespace gone\n")
        observing.health.fatal = None
        stopping.set()
        assert await get(port, "/readyz") == (503, "stopping\n")
        assert (await get(port, "/livez"))[0] == 200
        assert (await get(port, "/nothing"))[0] == 404
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), HTTP_TIMEOUT)
        writer.write(b"\x00garbage\r\n\r\n")
        await asyncio.wait_for(reader.read(), HTTP_TIMEOUT)
        writer.close()
        status, text = await get(port, "/metrics")
        assert status == 200 and "exports_ended_total" in text
