-- StopRequested: only the first stop request is kept. Cutoff 2 refuses delivery from now on.
UPDATE export_jobs SET stop_request_id = :request_id
WHERE id = :job_id AND tenant_id = :tenant_id AND status = 'Running' AND stop_request_id IS NULL;
