-- Reconciliation: OutcomeUnknown -> Completed, or Failed with NotDelivered, for the resolved attempt. No lease
-- condition: recovery cleared the lease. One-shot: the unique index allows one Reconciled event per attempt.
-- A new outbox row wakes the export's workflow (a new run if it had closed) to read the settled row again.
WITH reconciled AS (
    UPDATE export_jobs
    SET status = :resolution,
        failure_reason = CASE WHEN :resolution = 'Failed' THEN 'NotDelivered' END,
        confirmed_by = CASE WHEN :resolution = 'Completed' THEN 'reconciliation' END
    WHERE tenant_id = :tenant_id AND id = :job_id AND attempt_id = :attempt_id AND status = 'OutcomeUnknown'
      AND :resolution IN ('Completed', 'Failed')
    RETURNING id, attempt_id, status),
event AS (
    INSERT INTO export_attempt_events (job_id, attempt_id, kind, observed_by, detail, recorded_at)
    SELECT id, attempt_id, 'Reconciled', :reconciled_by, status || ': ' || :evidence_summary, clock_timestamp()
    FROM reconciled)
INSERT INTO outbox (message_id, kind, job_id, created_at)
SELECT gen_random_uuid(), 'ExportChanged', id, clock_timestamp() FROM reconciled;
