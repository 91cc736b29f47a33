-- An expired attempt, no stop request, under both caps (the attempts lost, not handed back by their worker, and
-- the hand-backs: migration 0013), back to the queue with its event and a new outbox row (a new message ID): a
-- Running one, or a Delivering original whose rename fence is open (pass_rename_fence.sql).
WITH requeued AS (
    UPDATE export_jobs
    SET status = 'Queued', attempt_id = NULL, claimed_by = NULL, lease_expires_at = NULL,
        expected_file_name = NULL, expected_file_bytes = NULL, expected_file_sha256 = NULL,
        delivery_authorized_at = NULL, rename_fence = NULL, woken_at = clock_timestamp()
    WHERE id = :job_id AND attempt_id = :expired_attempt_id
      AND (status = 'Running'
           OR (status = 'Delivering' AND rename_fence = 'open' AND replaces_job_id IS NULL))
      AND stop_request_id IS NULL AND attempt_count - handed_back_count < :max_attempts
      AND handed_back_count < :max_hand_backs
      AND lease_expires_at < clock_timestamp()
    RETURNING id),
event AS (
    INSERT INTO export_attempt_events (job_id, attempt_id, kind, recorded_at)
    SELECT id, :expired_attempt_id, 'RequeuedByRecovery', clock_timestamp() FROM requeued)
INSERT INTO outbox (message_id, kind, job_id, created_at)
SELECT gen_random_uuid(), 'ExportReady', id, clock_timestamp() FROM requeued;
