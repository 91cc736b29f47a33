-- An attempt handed back: the lease ends now, so that the attempt is resumed elsewhere or taken back by recovery
-- without waiting it out. A worker that shuts down hands back the build it will not finish (Running); a delivery
-- that failed before its rename fence hands back its attempt (Delivering, the fence still open: recovery's
-- take-back needs it). Like a renewal it changes only the lease, and only for the build that holds the attempt.
UPDATE export_jobs
SET lease_expires_at = clock_timestamp()
WHERE id = :job_id AND attempt_id = :attempt_id AND claimed_by = :holder
  AND (status = 'Running' OR (status = 'Delivering' AND rename_fence = 'open'));
