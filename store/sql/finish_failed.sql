-- Running -> Failed for this attempt and the build that holds it, with its failure code on the row and the cause
-- in the event. A run that read the row and waits on this attempt (run_waits_on_attempt.sql) gets a wake-up: the
-- step may be one Temporal gave up.
WITH failed AS (
    UPDATE export_jobs
    SET status = 'Failed', failure_reason = :failure_reason, lease_expires_at = NULL
    WHERE id = :job_id AND attempt_id = :attempt_id AND status = 'Running'
      AND claimed_by = coalesce(CAST(:holder AS text), claimed_by)
    RETURNING id, attempt_id, claimed_by, failure_reason, run_waits_for),
woken AS (
    INSERT INTO outbox (message_id, kind, job_id, created_at)
    SELECT gen_random_uuid(), 'ExportChanged', id, clock_timestamp() FROM failed WHERE run_waits_for = attempt_id)
INSERT INTO export_attempt_events (job_id, attempt_id, kind, worker_id, detail, recorded_at)
SELECT id, attempt_id, 'Failed', claimed_by, failure_reason || coalesce(': ' || CAST(:cause AS text), ''),
       clock_timestamp()
FROM failed;
