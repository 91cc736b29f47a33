-- Running -> Stopped for this attempt, only when a stop request is recorded: a lease takeover or a shutdown
-- can never be written as an operator's stop. A build names itself (a fenced build stops nothing); the workflow,
-- recording a stop while no build runs, passes NULL. A run that read the row and waits on this attempt
-- (run_waits_on_attempt.sql) gets a wake-up: the step may be one Temporal gave up.
WITH stopped AS (
    UPDATE export_jobs
    SET status = 'Stopped', lease_expires_at = NULL
    WHERE id = :job_id AND attempt_id = :attempt_id AND status = 'Running' AND stop_request_id IS NOT NULL
      AND claimed_by = coalesce(CAST(:holder AS text), claimed_by)
    RETURNING id, attempt_id, claimed_by, run_waits_for),
woken AS (
    INSERT INTO outbox (message_id, kind, job_id, created_at)
    SELECT gen_random_uuid(), 'ExportChanged', id, clock_timestamp() FROM stopped WHERE run_waits_for = attempt_id)
INSERT INTO export_attempt_events (job_id, attempt_id, kind, worker_id, detail, recorded_at)
SELECT id, attempt_id, 'Stopped', claimed_by, :stop_point, clock_timestamp() FROM stopped;
