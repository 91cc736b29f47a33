-- Terms edit of a queued job, at the version the editor read. The version is incremented explicitly, woken_at
-- comes from the database clock, and the new wake-up is written by the same statement: a worker holding the old
-- version fails its claim, and this message brings the job back to one that evaluates the new terms.
WITH edited AS (
    UPDATE export_jobs
    SET destination_id = :destination_id, version = version + 1, woken_at = clock_timestamp()
    WHERE tenant_id = :tenant_id AND id = :job_id AND status = 'Queued' AND version = :expected_version
    RETURNING id)
INSERT INTO outbox (message_id, kind, job_id, created_at)
SELECT gen_random_uuid(), 'ExportReady', id, clock_timestamp() FROM edited;
