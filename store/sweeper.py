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
    if batch < 1:
        raise ValueError("batch must be at least 1")
    republished = (await db.write("sweep", threshold_seconds=float(threshold_seconds), batch=batch)).count
    if republished:
        log.info("sweeper republished %d queued exports", republished)
    return republished


async def sweep_batches(db: Database, *, threshold_seconds: float, batch: int, max_batches: int = 1000) -> int:
    """Batches until one comes back short, so a backlog is drained without one long transaction. Bounded by
    max_batches: swept rows leave the due set (woken_at moves forward), so only a pathological backlog reaches it,
    and the next run continues from there."""
    total = 0
    for _ in range(max_batches):
        republished = await sweep_batch(db, threshold_seconds=threshold_seconds, batch=batch)
        total += republished
        if republished < batch:
            break
    else:
        log.warning("sweeper stopped after %d full batches; the next run continues", max_batches)
    return total

