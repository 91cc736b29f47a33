-- A worker that shuts down hands back the build it will not finish: the lease ends now, so that the attempt is
-- resumed elsewhere (or taken over by recovery) without waiting it out. Like a renewal it changes only the lease,
-- and only for the build that holds the attempt.
UPDATE export_jobs
SET lease_expires_at = clock_timestamp()
WHERE id = :job_id AND attempt_id = :attempt_id AND status = 'Running' AND claimed_by = :holder;
