-- Queued -> Rejected, this version only. A terms edit in between makes this match nothing, and the edit's own
-- wake-up brings the job back for a fresh evaluation. The reason is kept on the row: the policy's answer.
UPDATE export_jobs SET status = 'Rejected', rejection_reason = :reason
WHERE id = :job_id AND status = 'Queued' AND version = :checked_version;
