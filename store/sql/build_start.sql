-- A build takes its attempt's build slot: Running, this attempt, with the build's holder recorded and a fresh
-- lease, in one statement with its BuildStarted event. The first build and every resumption run it, so from its
-- commit an earlier build of the same attempt (a paused or partitioned worker), whose renewals and writes match
-- its own holder, matches no row. It fails once a takeover has committed, like a renewal, and it never takes the
-- slot from a build the run scheduled after it: a task handed to a paused worker can reach it after the run gave
-- it up and resumed elsewhere. :generation is the run's count of the attempt's resumptions, carried in the holder
-- ("<worker>/b<generation>.<token>", store.jobs.build_holder); a holder without one (the claim's, or a build of
-- an earlier release) counts as -1.
WITH started AS (
    UPDATE export_jobs
    SET claimed_by = :holder, lease_expires_at = clock_timestamp() + make_interval(secs => :lease_seconds)
    WHERE id = :job_id AND attempt_id = :attempt_id AND status = 'Running'
      AND coalesce(CAST(substring(claimed_by FROM '/b([0-9]+)\.[0-9a-f]+$') AS integer), -1) <= :generation
    RETURNING id, attempt_id, claimed_by)
INSERT INTO export_attempt_events (job_id, attempt_id, kind, worker_id, detail, recorded_at)
SELECT id, attempt_id, 'BuildStarted', claimed_by, :detail, clock_timestamp() FROM started;
