"""LV6: SIGTERM hands back a built-but-unauthorized attempt at once, also while another export's upload is in
flight on the same worker process (which the shutdown waits for)."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from store.models import Status
from tests.helpers.crash import crash_world, processes, start_worker
from tests.helpers.harness import held_at, release_held
from tests.helpers.support import eventually

BOUND = 60.0
HOLD = "before:authorize_delivery"


async def lease_ended(h, job_id) -> bool:
    return bool(await h.db.admin.fetchval(
        "SELECT lease_expires_at <= clock_timestamp() FROM export_jobs WHERE id = $1", job_id))


@pytest.mark.spec("LV6")
async def test_sigterm_hands_back_a_built_attempt_at_once_even_with_an_upload_in_flight(db, store, client, tmp_path):
    """Export A uploads slowly (about 40 s); export B is built, its keeper handed over to cutoff 2, which has not
    begun (held at its start). SIGTERM: B must be handed back at once (its lease ended), as it is when no upload
    runs (tests/workflows/test_outages.py). The hand-back of handed-over keepers runs only in
    ExportActivitiesBase.close(), after every Temporal worker's shutdown has returned, which waits for the upload
    (it ignores cancellation) until the process exits past its bound: B is never handed back and its lease is kept
    renewing meanwhile, then waited out. Seen failing so; now the hand-back comes as the shutdown begins."""
    lease = 30.0
    async with crash_world(db, store, client, tmp_path, lease_seconds=lease, renew_every_seconds=1.0,
                           upload_throttle_bytes_per_second=400) as h, processes(h) as started:
        leaving = await start_worker(started, h, hold_at=HOLD, shutdown_grace_seconds=1.0)
        uploading = await h.create()
        await held_at(h.settings, HOLD, uploading, timeout=BOUND)
        release_held(h.settings, HOLD, uploading)
        await eventually(lambda: h.store.read_job(uploading), lambda r: r.status is Status.DELIVERING,
                         timeout=BOUND, interval=0.1, what="A uploading")
        built = await h.create()
        await held_at(h.settings, HOLD, built, timeout=BOUND)
        began = time.monotonic()
        leaving.process.send_signal(signal.SIGTERM)
        ended_after = None
        while time.monotonic() - began < 20.0:
            if await lease_ended(h, built):
                ended_after = time.monotonic() - began
                break
            await asyncio.sleep(0.1)
        await asyncio.wait_for(leaving.process.wait(), timeout=BOUND)
        log = leaving.log_path.read_text()
        print(f"\nB's lease ended {ended_after} s after SIGTERM; worker exit code {leaving.process.returncode}; "
              f"'handed back' in log: {'handed back' in log}")
        assert ended_after is not None and ended_after < 5.0, (
            f"B's lease was not ended within 20 s of SIGTERM (the worker exited "
            f"{leaving.process.returncode}); log tail:\n" + "\n".join(log.splitlines()[-15:]))
