-- Renewal. It deliberately does not check expiry: ownership ends only when a takeover commits.
UPDATE export_jobs
SET lease_expires_at = clock_timestamp() + make_interval(secs => :lease_seconds)
WHERE id = :job_id AND attempt_id = :attempt_id AND status IN ('Running', 'Delivering');
