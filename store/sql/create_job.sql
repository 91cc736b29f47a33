-- Creation: the job, its deliveries row and its first wake-up in one statement (reference design, The Tables).
WITH delivery AS (
    INSERT INTO deliveries (tenant_id, delivery_key, original_job_id)
    VALUES (:tenant_id, :delivery_key, :job_id)),
created AS (
    INSERT INTO export_jobs (id, tenant_id, status, version, destination_id, delivery_key, created_by, woken_at)
    VALUES (:job_id, :tenant_id, 'Queued', 1, :destination_id, :delivery_key, :created_by, clock_timestamp())
    RETURNING id)
INSERT INTO outbox (message_id, kind, job_id, created_at)
SELECT gen_random_uuid(), 'ExportReady', id, clock_timestamp() FROM created;
