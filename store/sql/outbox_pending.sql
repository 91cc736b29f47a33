-- The dispatcher's batch: unpublished wake-ups, oldest first, through the partial index ix_outbox_unpublished,
-- each with its export's tenant (the run's fairness key; migration 0012 grants the read of that column only).
-- A plain read: no row lock is held while Temporal is asked (the advisory lock keeps dispatchers apart).
SELECT o.message_id, o.kind, o.job_id, j.tenant_id
FROM outbox o LEFT JOIN export_jobs j ON j.id = o.job_id
WHERE o.published_at IS NULL ORDER BY o.created_at LIMIT :batch
