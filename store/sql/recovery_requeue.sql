-- An expired Running attempt with no stop request, under the attempt cap, goes back to the queue, with its
-- event and a new outbox row (a new message ID: a broker that deduplicates must not drop this wake-up).
WITH requeued AS (
    UPDATE export_jobs
    SET status = 'Queued', attempt_id = NULL, claimed_by = NULL, lease_expires_at = NULL,
        woken_at = clock_timestamp()
    WHERE id = :job_id AND status = 'Running' AND attempt_id = :expired_attempt_id
      AND stop_request_id IS NULL AND attempt_count < :max_attempts
      AND lease_expires_at < clock_timestamp()
    RETURNING id),
event AS (
    INSERT INTO export_attempt_events (job_id, attempt_id, kind, recorded_at)
    SELECT id, :expired_attempt_id, 'RequeuedByRecovery', clock_timestamp() FROM requeued)
INSERT INTO outbox (message_id, kind, job_id, created_at)
SELECT gen_random_uuid(), 'ExportReady', id, clock_timestamp() FROM requeued;
