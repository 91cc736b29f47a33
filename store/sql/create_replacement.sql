-- A replacement: copies the key and the final name (where the original's file may be) from the original, which
-- it locks, and inserts nothing unless the original may be replaced: an original, in the same tenant,
-- OutcomeUnknown or Failed for a reason that proves nothing was finalized. FOR UPDATE waits for a concurrent
-- correction of the original, then re-checks its status.
WITH original AS (
    SELECT id, tenant_id, destination_id, delivery_key, final_name
    FROM export_jobs
    WHERE tenant_id = :tenant_id AND id = :original_job_id AND replaces_job_id IS NULL
      AND (status = 'OutcomeUnknown'
           OR (status = 'Failed' AND failure_reason IN ('BuildFailed', 'AttemptsExhausted', 'NotDelivered')))
    FOR UPDATE),
created AS (
    INSERT INTO export_jobs (id, tenant_id, status, version, destination_id, delivery_key, final_name,
                             replaces_job_id, created_by, replacement_reason, overwrite_agreement_ref, woken_at)
    SELECT :job_id, tenant_id, 'Queued', 1, destination_id, delivery_key, final_name, id,
           :created_by, :replacement_reason, :overwrite_agreement_ref, clock_timestamp()
    FROM original
    RETURNING id)
INSERT INTO outbox (message_id, kind, job_id, created_at)
SELECT gen_random_uuid(), 'ExportReady', id, clock_timestamp() FROM created;
