-- An attempt handed back: the lease ends now, so that the attempt is resumed elsewhere or taken back by recovery
-- without waiting it out. A worker that shuts down hands back the build it will not finish (Running); a delivery
-- that failed before its rename fence hands back its attempt (Delivering, the fence still open: recovery's
-- take-back needs it), and that hand-back is counted (migration 0013), once: only while the lease still runs, so
-- a second call for the same attempt counts nothing. A counted hand-back names its attempt (migration 0018), so
-- that recovery's take-back counts it against the hand-back cap only (recovery_take_back.sql). Like a renewal it
-- changes only the lease (and those two, from the row as locked), and only for the build that holds the attempt.
UPDATE export_jobs
SET lease_expires_at = clock_timestamp(),
    handed_back_count = handed_back_count
        + CASE WHEN status = 'Delivering' AND lease_expires_at > clock_timestamp() THEN 1 ELSE 0 END,
    handed_back_attempt = CASE WHEN status = 'Delivering' AND lease_expires_at > clock_timestamp() THEN attempt_id
                               ELSE handed_back_attempt END
WHERE id = :job_id AND attempt_id = :attempt_id AND claimed_by = :holder
  AND (status = 'Running' OR (status = 'Delivering' AND rename_fence = 'open'));
