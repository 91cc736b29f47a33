-- The evidence follow-up settles OutcomeUnknown -> Completed, only on proof: the SHA-256 it read back from the
-- partner's file under the expected final name, or the partner's acknowledgment of that name, is the expected
-- file's. The database requires its ConfirmedByFollowUp event with it, and that event a content proof (0009).
-- A new outbox row wakes the export's workflow (a new run if it had closed) to read the settled row.
-- Never an export that has a replacement: the replacement shares its final name, and the file there may be the
-- replacement's (byte for byte the original's expected file, when the contacts have not changed). Its original is
-- left to the replacement, and to a person. A replacement created after this commits finds its original Completed
-- at its cutoff 2, and sends nothing.
WITH confirmed AS (
    UPDATE export_jobs j
    SET status = 'Completed', confirmed_by = :confirmed_by
    WHERE j.id = :job_id AND j.attempt_id = :attempt_id AND j.status = 'OutcomeUnknown'
      AND j.expected_file_name = :final_name AND j.expected_file_sha256 = decode(:observed_sha256, 'hex')
      AND :confirmed_by IN ('sha256', 'acknowledgment')
      AND NOT EXISTS (SELECT FROM export_jobs r WHERE r.tenant_id = j.tenant_id AND r.replaces_job_id = j.id)
    RETURNING j.id, j.attempt_id),
event AS (
    INSERT INTO export_attempt_events (job_id, attempt_id, kind, observed_by, detail, recorded_at)
    SELECT id, attempt_id, 'ConfirmedByFollowUp', :observed_by, :detail, clock_timestamp() FROM confirmed)
INSERT INTO outbox (message_id, kind, job_id, created_at)
SELECT gen_random_uuid(), 'ExportChanged', id, clock_timestamp() FROM confirmed;
