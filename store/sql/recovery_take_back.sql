-- An expired attempt with no stop request taken back: a Running one, or a Delivering one whose rename fence is open
-- (pass_rename_fence.sql; a replacement's too: it never renamed). Under every cap it is requeued with its event and
-- a new outbox row; at a cap it fails AttemptsExhausted. Each cap is counted here only, by how the export's attempts
-- were lost (this one as recovery_loss.sql judged it, the earlier ones as their events say): alone
-- (EXPORTS_MAX_ATTEMPTS), with their worker (EXPORTS_MAX_SHARED_LOSSES), amid other workers' losses
-- (EXPORTS_MAX_LOSSES_AMID_OTHERS), or handed back by their own worker (EXPORTS_MAX_HAND_BACKS; counted on the row,
-- and named there, so that such an attempt is recorded as handed back and counted under no other cap, however
-- recovery_loss.sql judged it). Its answer is the event it recorded, which names the worker that lost the attempt
-- and how.
WITH taken AS (
    SELECT j.id, j.attempt_id, this_loss.detail,
           (j.attempt_count - j.handed_back_count - lost.with_its_worker - lost.amid_others >= :max_attempts
            OR lost.with_its_worker >= :max_shared_losses
            OR lost.amid_others >= :max_losses_amid_others
            OR j.handed_back_count >= :max_hand_backs) AS at_a_cap
    FROM export_jobs j,
         LATERAL (SELECT CASE WHEN j.handed_back_attempt = j.attempt_id THEN 'handed back by its worker'
                              WHEN :amid_others THEN 'lost amid other workers'' losses'
                              WHEN :with_its_worker THEN 'lost with its worker'
                              ELSE 'lost alone' END AS detail) this_loss,
         -- The export's earlier losses and this one.
         LATERAL (SELECT count(*) FILTER (WHERE detail = 'lost with its worker') AS with_its_worker,
                         count(*) FILTER (WHERE detail = 'lost amid other workers'' losses') AS amid_others
                  FROM (SELECT e.detail FROM export_attempt_events e
                        WHERE e.job_id = j.id AND e.kind = 'RequeuedByRecovery'
                        UNION ALL SELECT this_loss.detail) losses) lost
    WHERE j.id = :job_id AND j.attempt_id = :expired_attempt_id
      AND (j.status = 'Running'
           OR (j.status = 'Delivering' AND j.rename_fence = 'open'))
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
    SELECT taken.id, taken.attempt_id, taken.at_a_cap, taken.detail,
           CASE WHEN taken.at_a_cap THEN 'AttemptsExhausted' ELSE 'RequeuedByRecovery' END AS kind
    FROM taken
    WHERE taken.id IN (SELECT id FROM requeued UNION ALL SELECT id FROM exhausted)),
event AS (
    INSERT INTO export_attempt_events (job_id, attempt_id, kind, worker_id, observed_by, detail, recorded_at)
    SELECT id, attempt_id, kind, :lost_by,
           CASE WHEN at_a_cap THEN :recovery_run_id END,
           detail, clock_timestamp()
    FROM done),
-- A requeue's row is the export's next message; a failure's wakes its workflow (a new run if it has closed, say
-- terminated): its result and search attributes follow the row.
woken AS (
    INSERT INTO outbox (message_id, kind, job_id, created_at)
    SELECT gen_random_uuid(), CASE WHEN at_a_cap THEN 'ExportChanged' ELSE 'ExportReady' END, id, clock_timestamp()
    FROM done)
SELECT kind FROM done;
