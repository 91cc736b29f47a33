-- CanceledWhileQueued. The conditions repeat what the row lock already guarantees: defense in depth.
UPDATE export_jobs SET status = 'Canceled', cancellation_request_id = :request_id
WHERE id = :job_id AND tenant_id = :tenant_id AND status = 'Queued';
