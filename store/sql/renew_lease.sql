-- Renewal. It deliberately does not check expiry: ownership ends only when a takeover commits. It also names the
-- build that holds the attempt (claimed_by), so a build fenced by a resumption renews nothing; NULL is the
-- attempt-level form, for callers that hold no build.
UPDATE export_jobs
SET lease_expires_at = clock_timestamp() + make_interval(secs => :lease_seconds)
WHERE id = :job_id AND attempt_id = :attempt_id AND status IN ('Running', 'Delivering')
  AND claimed_by = coalesce(CAST(:holder AS text), claimed_by);
