-- Claim (cutoff 1): Queued -> Running for the checked version, with the lease and the attempt event.
WITH claimed AS (
    UPDATE export_jobs
    SET status = 'Running', attempt_id = :attempt_id, attempt_count = attempt_count + 1,
        claimed_by = :worker_id, lease_expires_at = clock_timestamp() + make_interval(secs => :lease_seconds)
    WHERE id = :job_id AND status = 'Queued' AND version = :checked_version
    RETURNING id, attempt_id, version, claimed_by)
INSERT INTO export_attempt_events (job_id, attempt_id, kind, version, worker_id, recorded_at)
SELECT id, attempt_id, 'Claimed', version, claimed_by, clock_timestamp() FROM claimed;
