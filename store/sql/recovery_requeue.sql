-- An expired attempt, no stop request, under every cap, back to the queue with its event and a new outbox row (a
-- new message ID): a Running one, or a Delivering original whose rename fence is open (pass_rename_fence.sql).
-- The caps: the attempts lost alone (EXPORTS_MAX_ATTEMPTS), those lost with their worker (migration 0014:
-- `:with_its_worker` for this one, from recovery_loss.sql; the export's earlier ones from its events), and those
-- handed back by their own worker (migration 0013). The event names the worker that lost the attempt and how.
WITH earlier AS (
    SELECT count(*) AS with_worker FROM export_attempt_events
    WHERE job_id = :job_id AND kind = 'RequeuedByRecovery' AND detail = 'lost with its worker'),
requeued AS (
    UPDATE export_jobs
    SET status = 'Queued', attempt_id = NULL, claimed_by = NULL, lease_expires_at = NULL,
        expected_file_name = NULL, expected_file_bytes = NULL, expected_file_sha256 = NULL,
        delivery_authorized_at = NULL, rename_fence = NULL, woken_at = clock_timestamp()
    FROM earlier
    WHERE id = :job_id AND attempt_id = :expired_attempt_id
      AND (status = 'Running'
           OR (status = 'Delivering' AND rename_fence = 'open' AND replaces_job_id IS NULL))
      AND stop_request_id IS NULL
      AND attempt_count - handed_back_count - earlier.with_worker - CASE WHEN :with_its_worker THEN 1 ELSE 0 END
          < :max_attempts
      AND earlier.with_worker + CASE WHEN :with_its_worker THEN 1 ELSE 0 END < :max_shared_losses
      AND handed_back_count < :max_hand_backs
      AND lease_expires_at < clock_timestamp()
    RETURNING id),
event AS (
    INSERT INTO export_attempt_events (job_id, attempt_id, kind, worker_id, detail, recorded_at)
    SELECT id, :expired_attempt_id, 'RequeuedByRecovery', :lost_by,
           CASE WHEN :with_its_worker THEN 'lost with its worker' ELSE 'lost alone' END, clock_timestamp()
    FROM requeued)
INSERT INTO outbox (message_id, kind, job_id, created_at)
SELECT gen_random_uuid(), 'ExportReady', id, clock_timestamp() FROM requeued;
