"""Heartbeats mirror the lease (LD6): a running step heartbeats to Temporal at the lease's renewal cadence, since
Temporal Cloud bills each one that reaches the server, and a stop reaches a build through the database, not in a
heartbeat's reply. Counted from the SDK's own request metrics on a real worker process, against the real
PostgreSQL, Temporal dev server and SFTP partner."""

from __future__ import annotations

import time

import pytest

from store.models import CancellationOutcome, Status
from store.settings import Settings
from tests.helpers.support import eventually
from tests.observe.test_metrics import polling, scrape, value, worker_process, world

HEARTBEAT = "RecordActivityTaskHeartbeat"
LEASE = 9.0
RENEW = 3.0  # the cadence heartbeats must keep: at most one a renewal interval per running step
BYTES_PER_SECOND = 4_000


def heartbeats_sent(found: dict) -> float:
    """Heartbeat requests the worker made to the server (the SDK counts each request by its operation)."""
    return sum(v for (name, labels), v in found.items()
               if name in ("temporal_request", "temporal_request_total") and ("operation", HEARTBEAT) in labels)


@pytest.mark.spec("LD6")
async def test_a_running_step_heartbeats_once_a_renewal_interval_and_a_stop_still_reaches_its_build_at_once(
        db, store, client, tmp_path):
    # No heartbeat setting: the worker's default is what is measured.
    async with world(db, store, client, tmp_path, contacts=600, lease_seconds=LEASE, renew_every_seconds=RENEW,
                     build_throttle_bytes_per_second=BYTES_PER_SECOND,
                     upload_throttle_bytes_per_second=BYTES_PER_SECOND) as h, worker_process(h) as worker:
        await polling(worker.port)
        before, _ = await scrape(worker.port)

        began = time.monotonic()
        job_id = await h.create()
        row = await h.settled(job_id)
        took = time.monotonic() - began
        assert row.status is Status.COMPLETED, row
        after, _ = await scrape(worker.port)
        sent = heartbeats_sent(after) - heartbeats_sent(before)
        # The build and the upload each run several renewal intervals; cutoff 2 a moment. One heartbeat at each
        # step's start, then one per interval (and perhaps one flushed at its end): far from the two a second
        # the worker used to send.
        steps = 3
        bound = 2 * steps + took / RENEW
        print(f"\nLD6: export took {took:.1f} s, {sent:.0f} heartbeats reached the server (bound {bound:.1f}; "
              f"at 2 a second it would be {2 * took:.0f})")
        assert took > 3 * RENEW, f"the export was too quick ({took:.1f} s) to show the cadence"
        assert 0 < sent <= bound, sent

        # A stop reaches a build within a second although its heartbeats are RENEW seconds apart.
        job_id = await h.create()
        await eventually(lambda: store.read_job(job_id), lambda r: r is not None and r.status is Status.RUNNING,
                         timeout=30, interval=0.05, what="the second export building")
        result = await h.exports.cancel(tenant_id=h.tenant_id, job_id=job_id, requested_by="ann@example.com",
                                        reason="wrong list")
        assert result.outcome is CancellationOutcome.STOP_REQUESTED
        asked = time.monotonic()
        await eventually(lambda: store.read_job(job_id), lambda r: r is not None and r.status is Status.STOPPED,
                         timeout=30, interval=0.02, what="the build stopped")
        stopped_after = time.monotonic() - asked
        print(f"LD6: stop reached the build in {stopped_after * 1000:.0f} ms, heartbeats {RENEW:.0f} s apart")
        assert stopped_after < 1.0, stopped_after
    assert value(after, "exports_ended_total", status="Completed") >= 1


@pytest.mark.spec("LD6")
@pytest.mark.parametrize("throttle", [20.0 + 1e-6, 30.0, 60.0])
def test_a_heartbeat_cadence_past_a_third_of_the_lease_is_refused(throttle: float) -> None:
    """A step's heartbeat timeout is one lease, and a step whose heartbeats come more than half a lease apart is
    late at each: seen failing, a cadence of a whole lease (or more) was accepted, and Temporal gave up every step
    longer than the lease though its lease was kept (a build resumed three times, never settled)."""
    with pytest.raises(ValueError, match="heartbeat_throttle_seconds"):
        Settings(_env_file=None, lease_seconds=60.0, renew_every_seconds=20.0, heartbeat_throttle_seconds=throttle)
    assert Settings(_env_file=None, lease_seconds=60.0, renew_every_seconds=20.0,
                    heartbeat_throttle_seconds=20.0).heartbeat_seconds == 20.0
