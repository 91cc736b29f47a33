-- An expired attempt with no stop request taken back: a Running one, or a Delivering original whose rename fence is
-- open (pass_rename_fence.sql). Under every cap it goes back to the queue with its event and a new outbox row (a new
-- message ID); at a cap it fails AttemptsExhausted, so a job that kills its worker every time (or whose partner drops
-- every upload, each attempt handed back) is not requeued forever. The caps, each counted here only: the attempts
-- lost alone (EXPORTS_MAX_ATTEMPTS), those lost with their worker (EXPORTS_MAX_SHARED_LOSSES, migration 0014:
-- `:with_its_worker` for this one, from recovery_loss.sql; the export's earlier ones from its events), and those
-- handed back by their own worker (EXPORTS_MAX_HAND_BACKS, migration 0013). Which one it did is its answer; the
-- event names the worker that lost the attempt and how.
WITH taken AS (
    SELECT j.id, j.attempt_id,
           (j.attempt_count - j.handed_back_count - shared.losses >= :max_attempts
            OR shared.losses >= :max_shared_losses
            OR j.handed_back_count >= :max_hand_backs) AS at_a_cap
    FROM export_jobs j,
         LATERAL (SELECT count(*) + CASE WHEN :with_its_worker THEN 1 ELSE 0 END AS losses
                  FROM export_attempt_events e
                  WHERE e.job_id = j.id AND e.kind = 'RequeuedByRecovery'
                    AND e.detail = 'lost with its worker') shared
    WHERE j.id = :job_id AND j.attempt_id = :expired_attempt_id
      AND (j.status = 'Running'
           OR (j.status = 'Delivering' AND j.rename_fence = 'open' AND j.replaces_job_id IS NULL))
      AND j.stop_request_id IS NULL
      AND j.lease_expires_at < clock_timestamp()
    -- The row lock orders this with a renewal, the rename fence and cutoff 2: one that commits first makes this
    -- re-check the row it waited for and match nothing.
    FOR UPDATE OF j),
requeued AS (
    UPDATE export_jobs j
    SET status = 'Queued', attempt_id = NULL, claimed_by = NULL, lease_expires_at = NULL,
        expected_file_name = NULL, expected_file_bytes = NULL, expected_file_sha256 = NULL,
        delivery_authorized_at = NULL, rename_fence = NULL, woken_at = clock_timestamp()
    FROM taken
    WHERE j.id = taken.id AND NOT taken.at_a_cap
    RETURNING j.id),
exhausted AS (
    UPDATE export_jobs j
    SET status = 'Failed', failure_reason = 'AttemptsExhausted', lease_expires_at = NULL
    FROM taken
    WHERE j.id = taken.id AND taken.at_a_cap
    RETURNING j.id),
done AS (
    SELECT taken.id, taken.attempt_id, taken.at_a_cap,
           CASE WHEN taken.at_a_cap THEN 'AttemptsExhausted' ELSE 'RequeuedByRecovery' END AS kind
    FROM taken
    WHERE taken.id IN (SELECT id FROM requeued UNION ALL SELECT id FROM exhausted)),
event AS (
    INSERT INTO export_attempt_events (job_id, attempt_id, kind, worker_id, observed_by, detail, recorded_at)
    SELECT id, attempt_id, kind, :lost_by,
           CASE WHEN at_a_cap THEN :recovery_run_id END,
           CASE WHEN :with_its_worker THEN 'lost with its worker' ELSE 'lost alone' END, clock_timestamp()
    FROM done),
-- A requeue's row is the export's next message; a failure's wakes its workflow (a new run if it has closed, say
-- terminated): its result and search attributes follow the row.
woken AS (
    INSERT INTO outbox (message_id, kind, job_id, created_at)
    SELECT gen_random_uuid(), CASE WHEN at_a_cap THEN 'ExportChanged' ELSE 'ExportReady' END, id, clock_timestamp()
    FROM done)
SELECT kind FROM done;
