-- An upload keeps its partner session for a lease past this write (migration 0016), whatever its export's row says
-- since: written as the upload starts and renewed while it runs. Its worker gone or cut off, it lapses.
UPDATE partner_sessions SET uploading_until = clock_timestamp() + make_interval(secs => :lease_seconds)
WHERE job_id = :job_id AND attempt_id = :attempt_id;
