-- The evidence follow-up settles OutcomeUnknown -> Completed, only on proof: the SHA-256 it read back from the
-- partner's file under the expected final name, or the partner's acknowledgment of that name, is the expected
-- file's. The database requires its ConfirmedByFollowUp event with it, and that event a content proof (0009).
-- A new outbox row wakes the export's workflow (a new run if it had closed) to read the settled row.
WITH confirmed AS (
    UPDATE export_jobs
    SET status = 'Completed', confirmed_by = :confirmed_by
    WHERE id = :job_id AND attempt_id = :attempt_id AND status = 'OutcomeUnknown'
      AND expected_file_name = :final_name AND expected_file_sha256 = decode(:observed_sha256, 'hex')
      AND :confirmed_by IN ('sha256', 'acknowledgment')
    RETURNING id, attempt_id),
event AS (
    INSERT INTO export_attempt_events (job_id, attempt_id, kind, observed_by, detail, recorded_at)
    SELECT id, attempt_id, 'ConfirmedByFollowUp', :observed_by, :detail, clock_timestamp() FROM confirmed)
INSERT INTO outbox (message_id, kind, job_id, created_at)
SELECT gen_random_uuid(), 'ExportChanged', id, clock_timestamp() FROM confirmed;
