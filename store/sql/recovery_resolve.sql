-- An expired Delivering attempt is resolved from evidence, never stopped, canceled or retried. The caller
-- decides :resolution first: 'Completed' only on evidence matching the expected file, otherwise
-- 'OutcomeUnknown'. The still-expired lease condition lets a renewal during recovery's lookup prevent this.
WITH resolved AS (
    UPDATE export_jobs
    SET status = :resolution, lease_expires_at = NULL,
        confirmed_by = CASE WHEN :resolution = 'Completed' THEN CAST(:confirmed_by AS text) END
    WHERE id = :job_id AND status = 'Delivering' AND attempt_id = :expired_attempt_id
      AND lease_expires_at < clock_timestamp()
      AND :resolution IN ('Completed', 'OutcomeUnknown')
    RETURNING id, attempt_id, status),
event AS (
    INSERT INTO export_attempt_events (job_id, attempt_id, kind, observed_by, detail, recorded_at)
    SELECT id, attempt_id, 'ResolvedByRecovery', :recovery_run_id, status || ': ' || :evidence_summary,
           clock_timestamp()
    FROM resolved)
-- A new outbox row wakes the export's workflow (a new run if it has closed, say terminated): its result and
-- search attributes follow the row.
INSERT INTO outbox (message_id, kind, job_id, created_at)
SELECT gen_random_uuid(), 'ExportChanged', id, clock_timestamp() FROM resolved;
