-- Recovery's scan only nominates: each takeover statement repeats every condition read here, so a renewal that
-- commits after this scan makes the takeover match nothing. Oldest leases first, through ix_export_jobs_lease.
SELECT id, attempt_id, status, stop_request_id, attempt_count, handed_back_count
FROM export_jobs
WHERE status IN ('Running', 'Delivering') AND lease_expires_at < clock_timestamp()
ORDER BY lease_expires_at
LIMIT :limit;
