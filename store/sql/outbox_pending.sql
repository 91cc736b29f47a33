-- The dispatcher's batch: unpublished wake-ups, oldest first, through the partial index ix_outbox_unpublished.
-- A plain read: no row lock is held while Temporal is asked (the advisory lock keeps dispatchers apart).
SELECT message_id, kind, job_id FROM outbox WHERE published_at IS NULL ORDER BY created_at LIMIT :batch
