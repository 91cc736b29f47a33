-- The dispatcher's batch: unpublished wake-ups, each with its export's tenant (the run's fairness key; migration
-- 0012 grants the read of that column only), taken round-robin between tenants, oldest first within each (LD5):
-- a tenant's burst of a thousand wake-ups does not stand in front of another tenant's one. The unpublished rows
-- come through the partial index ix_outbox_unpublished.
-- A plain read: no row lock is held while Temporal is asked (the advisory lock keeps dispatchers apart).
SELECT message_id, kind, job_id, tenant_id
FROM (
    SELECT o.message_id, o.kind, o.job_id, j.tenant_id, o.created_at,
           row_number() OVER (PARTITION BY j.tenant_id ORDER BY o.created_at) AS turn
    FROM outbox o LEFT JOIN export_jobs j ON j.id = o.job_id
    WHERE o.published_at IS NULL
) pending
ORDER BY turn, created_at
LIMIT :batch
