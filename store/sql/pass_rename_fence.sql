-- The rename fence: the upload's last write before it sends the rename, which it sends only once this has
-- committed. It passes only for the attempt and build that hold the Delivering row. Recovery's requeue of an
-- attempt whose fence is still open names the same row, so PostgreSQL orders the two: a requeue that commits first
-- makes this match nothing (that attempt never renames), and a fence that passes first makes the requeue match
-- nothing (the attempt is resolved from evidence). No lease condition, as for a renewal: ownership ends only when a
-- takeover commits. Its evidence record ("step rename"), which names the holder, is written by the same statement:
-- the rules (migration 0023) let the fence pass only with it.
WITH passed AS (
    UPDATE export_jobs SET rename_fence = 'passed'
    WHERE id = :job_id AND attempt_id = :attempt_id AND status = 'Delivering'
      AND claimed_by = :holder
    RETURNING id, attempt_id, claimed_by)
INSERT INTO export_attempt_events (job_id, attempt_id, kind, worker_id, observed_by, detail, recorded_at)
SELECT id, attempt_id, 'DeliveryEvidence', CAST(:holder AS text), :observed_by, :detail, clock_timestamp()
FROM passed;
