-- A build takes its attempt's build slot: Running, this attempt, with the build's holder recorded and a fresh
-- lease, in one statement with its BuildStarted event. The first build and every resumption run it, so from its
-- commit an earlier build of the same attempt (a paused or partitioned worker), whose renewals and writes match
-- its own holder, matches no row. It fails once a takeover has committed, like a renewal.
WITH started AS (
    UPDATE export_jobs
    SET claimed_by = :holder, lease_expires_at = clock_timestamp() + make_interval(secs => :lease_seconds)
    WHERE id = :job_id AND attempt_id = :attempt_id AND status = 'Running'
    RETURNING id, attempt_id, claimed_by)
INSERT INTO export_attempt_events (job_id, attempt_id, kind, worker_id, detail, recorded_at)
SELECT id, attempt_id, 'BuildStarted', claimed_by, :detail, clock_timestamp() FROM started;
