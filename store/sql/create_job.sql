-- Creation: the job, its deliveries row and its first wake-up in one statement (reference design, The Tables).
-- The final name carries the tenant, so tenants sharing a partner directory never share a name (migration 0007).
WITH delivery AS (
    INSERT INTO deliveries (tenant_id, delivery_key, original_job_id)
    VALUES (:tenant_id, :delivery_key, :job_id)),
created AS (
    INSERT INTO export_jobs (id, tenant_id, status, version, destination_id, delivery_key, final_name, created_by,
                             woken_at)
    VALUES (:job_id, :tenant_id, 'Queued', 1, :destination_id, :delivery_key,
            'contacts-' || CAST(:tenant_id AS uuid) || '-' || :delivery_key || '.csv', :created_by, clock_timestamp())
    RETURNING id)
INSERT INTO outbox (message_id, kind, job_id, created_at)
SELECT gen_random_uuid(), 'ExportReady', id, clock_timestamp() FROM created;
