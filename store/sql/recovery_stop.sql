-- An expired Running attempt with a recorded stop request is stopped, not restarted. Terminal states keep
-- attempt_id for audit; only a requeue clears it.
WITH stopped AS (
    UPDATE export_jobs
    SET status = 'Stopped', lease_expires_at = NULL
    WHERE id = :job_id AND status = 'Running' AND attempt_id = :expired_attempt_id
      AND stop_request_id IS NOT NULL
      AND lease_expires_at < clock_timestamp()
    RETURNING id, attempt_id),
event AS (
    INSERT INTO export_attempt_events (job_id, attempt_id, kind, observed_by, recorded_at)
    SELECT id, attempt_id, 'StoppedByRecovery', :recovery_run_id, clock_timestamp() FROM stopped)
-- A new outbox row wakes the export's workflow (a new run if it has closed, say terminated): its result and
-- search attributes follow the row.
INSERT INTO outbox (message_id, kind, job_id, created_at)
SELECT gen_random_uuid(), 'ExportChanged', id, clock_timestamp() FROM stopped;
