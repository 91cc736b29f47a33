"""The sweeper (reference design, Messages, the Outbox, and the Sweeper): a backstop that writes a fresh wake-up
for any job left Queued longer than the threshold since its last one, because outboxes, dispatchers, settlement
and dead-lettering can all strand a queued job. Run by Recovery.sweep and Recovery.sweep_all, as the application
role."""

from __future__ import annotations

import logging

from store.statements import Database

log = logging.getLogger(__name__)


async def sweep_batch(db: Database, *, threshold_seconds: float, batch: int) -> int:
    """One batch in one short transaction; the number of jobs republished (their outbox rows)."""
    return (await _sweep(db, threshold_seconds=threshold_seconds, batch=batch))[1]


async def _sweep(db: Database, *, threshold_seconds: float, batch: int) -> tuple[int, int]:
    """One batch: how many due jobs it looked at, and how many of them it wrote a wake-up for (the others still
    had one waiting unpublished)."""
    if batch < 1:
        raise ValueError("batch must be at least 1")
    found = await db.write_row("sweep", threshold_seconds=float(threshold_seconds), batch=batch)
    assert found is not None  # the statement's final SELECT always answers one row
    looked_at, republished = int(found["looked_at"]), int(found["republished"])
    if republished:
        log.info("sweeper republished %d queued exports", republished)
    if looked_at > republished:
        log.warning("sweeper found %d queued exports whose wake-up still waits unpublished (are the dispatchers "
                    "down, or Temporal away?); it adds none beside it", looked_at - republished)
    return looked_at, republished


async def sweep_batches(db: Database, *, threshold_seconds: float, batch: int, max_batches: int = 1000) -> int:
    """Batches until one comes back short, so a backlog is drained without one long transaction. Bounded by
    max_batches: swept rows leave the due set (woken_at moves forward), so only a pathological backlog reaches it,
    and the next run continues from there."""
    total = 0
    for _ in range(max_batches):
        looked_at, republished = await _sweep(db, threshold_seconds=threshold_seconds, batch=batch)
        total += republished
        if looked_at < batch:
            break
    else:
        log.warning("sweeper stopped after %d full batches; the next run continues", max_batches)
    return total

