-- Correction of a recorded Completed or Failed, once per attempt, by a named reconciliation operator, with who
-- and why in the same statement. Only the reconciliation role may insert a Corrected event (row-level security),
-- so for any other role the whole statement fails. A new outbox row wakes the export's workflow to read it again.
WITH corrected AS (
    UPDATE export_jobs
    SET status = :corrected_status,
        failure_reason = CASE WHEN :corrected_status = 'Failed' THEN CAST(:failure_reason AS text) END,
        confirmed_by = CASE WHEN :corrected_status = 'Completed' THEN 'correction' END
    WHERE tenant_id = :tenant_id AND id = :job_id AND attempt_id = :attempt_id
      AND status = :recorded_status AND status IN ('Completed', 'Failed')
      AND :corrected_status IN ('Completed', 'Failed') AND :corrected_status <> :recorded_status
    RETURNING id, attempt_id, status),
event AS (
    INSERT INTO export_attempt_events (job_id, attempt_id, kind, observed_by, detail, recorded_at)
    SELECT id, attempt_id, 'Corrected', :corrected_by,
           :recorded_status || ' to ' || status || ': ' || :evidence_ref || '; ' || :why, clock_timestamp()
    FROM corrected)
INSERT INTO outbox (message_id, kind, job_id, created_at)
SELECT gen_random_uuid(), 'ExportChanged', id, clock_timestamp() FROM corrected;
