-- An expired attempt that has used up its attempts fails, so a job that kills its worker every time (or whose
-- partner drops every upload, each attempt handed back) is not requeued forever: a Running one, or a Delivering
-- original whose rename fence is still open (as in recovery_requeue.sql).
WITH earlier AS (
    SELECT count(*) AS with_worker FROM export_attempt_events
    WHERE job_id = :job_id AND kind = 'RequeuedByRecovery' AND detail = 'lost with its worker'),
exhausted AS (
    UPDATE export_jobs
    SET status = 'Failed', failure_reason = 'AttemptsExhausted', lease_expires_at = NULL
    FROM earlier
    WHERE id = :job_id AND attempt_id = :expired_attempt_id
      AND (status = 'Running'
           OR (status = 'Delivering' AND rename_fence = 'open' AND replaces_job_id IS NULL))
      -- At a cap (recovery_requeue.sql's conditions, negated): the attempts lost alone, those lost with their
      -- worker, or the hand-backs.
      AND stop_request_id IS NULL
      AND (attempt_count - handed_back_count - earlier.with_worker - CASE WHEN :with_its_worker THEN 1 ELSE 0 END
               >= :max_attempts
           OR earlier.with_worker + CASE WHEN :with_its_worker THEN 1 ELSE 0 END >= :max_shared_losses
           OR handed_back_count >= :max_hand_backs)
      AND lease_expires_at < clock_timestamp()
    RETURNING id, attempt_id),
event AS (
    INSERT INTO export_attempt_events (job_id, attempt_id, kind, worker_id, observed_by, detail, recorded_at)
    SELECT id, attempt_id, 'AttemptsExhausted', :lost_by, :recovery_run_id,
           CASE WHEN :with_its_worker THEN 'lost with its worker' ELSE 'lost alone' END, clock_timestamp()
    FROM exhausted)
-- A new outbox row wakes the export's workflow (a new run if it has closed, say terminated): its result and
-- search attributes follow the row.
INSERT INTO outbox (message_id, kind, job_id, created_at)
SELECT gen_random_uuid(), 'ExportChanged', id, clock_timestamp() FROM exhausted;
