-- The attempt's terminal write after cutoff 2: Delivering -> Completed (with what confirmed it), Failed (with its
-- code) or OutcomeUnknown, for this attempt only. With :wake (the delivery learnt that its run is gone, say
-- terminated, or wrote past the step's bound, after Temporal gave it up), or when a run read the row unsettled and
-- waits on this attempt (run_waits_on_attempt.sql; RETURNING reads the row as locked), an outbox row too: the
-- dispatcher wakes or starts a run that reads the row, so the view follows it.
WITH finished AS (
    UPDATE export_jobs
    SET status = :outcome, failure_reason = CAST(:failure_reason AS text), lease_expires_at = NULL,
        confirmed_by = CAST(:confirmed_by AS text)
    WHERE id = :job_id AND attempt_id = :attempt_id AND status = 'Delivering'
      AND claimed_by = coalesce(CAST(:holder AS text), claimed_by)
      AND :outcome IN ('Completed', 'Failed', 'OutcomeUnknown')
    RETURNING id, attempt_id, claimed_by, status, run_waits_for),
woken AS (
    INSERT INTO outbox (message_id, kind, job_id, created_at)
    SELECT gen_random_uuid(), 'ExportChanged', id, clock_timestamp() FROM finished
    WHERE CAST(:wake AS boolean) OR run_waits_for = attempt_id)
INSERT INTO export_attempt_events (job_id, attempt_id, kind, worker_id, detail, recorded_at)
SELECT id, attempt_id, 'Finished', claimed_by, status || ': ' || :summary, clock_timestamp() FROM finished;
