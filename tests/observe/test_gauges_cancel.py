"""The gauges' reader ends when cancelled, even as a read ends: on Python 3.11, asyncio.wait_for loses a cancel that
comes as the awaited read completes, and the reader went on to its next sleep (30 s by default, a minute in the
probes' test), holding up the worker's exit (a test's close timed out at 120 s in CI)."""

from __future__ import annotations

import asyncio

from activities.process import metrics


async def test_the_gauges_reader_ends_when_cancelled_as_its_read_ends(monkeypatch):
    started = asyncio.Event()
    release = asyncio.get_running_loop().create_future()

    async def read(dsn: str) -> None:
        started.set()
        await release

    monkeypatch.setattr(metrics, "read_store_gauges", read)
    reader = asyncio.create_task(metrics.keep_reading_store_gauges("postgresql://unused", 60))
    await asyncio.wait_for(started.wait(), 2)
    for _ in range(3):  # let wait_for's inner task start waiting on `release`
        await asyncio.sleep(0)
    release.set_result(None)
    await asyncio.sleep(0)  # the read ends: its task is done, the reader not yet resumed
    reader.cancel()
    done, _ = await asyncio.wait({reader}, timeout=2)
    assert reader in done and reader.cancelled(), "the reader went on after its cancel"
